"""Bounds on a request's wire records, checked on the raw bytes before protobuf builds the message."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf.descriptor import Descriptor, FieldDescriptor

# Records of one request, in all: far above any legitimate request (the gateway's largest is
# max_messages x max_parts_per_message parts of a few records each), and small enough to walk in
# well under a tenth of a second.
DEFAULT_MAX_RECORDS = 100_000
# Nesting the walk follows: protobuf's own recursion limit, past which the parser refuses too.
_MAX_DEPTH = 100
_VARINT_MAX_BYTES = 10
# Records walked between two moments the walk lets another thread (the event loop) take the GIL.
_YIELD_EVERY = 2048
# Bytes per value of a packed field by its type; 0: varints (1 to 10 bytes each).
_FIXED_WIDTH = {
    FieldDescriptor.TYPE_DOUBLE: 8,
    FieldDescriptor.TYPE_FIXED64: 8,
    FieldDescriptor.TYPE_SFIXED64: 8,
    FieldDescriptor.TYPE_FLOAT: 4,
    FieldDescriptor.TYPE_FIXED32: 4,
    FieldDescriptor.TYPE_SFIXED32: 4,
}
_NOT_PACKABLE = frozenset(
    {
        FieldDescriptor.TYPE_STRING,
        FieldDescriptor.TYPE_BYTES,
        FieldDescriptor.TYPE_MESSAGE,
        FieldDescriptor.TYPE_GROUP,
    }
)
_CONTINUATION_BYTES = bytes(range(0x80, 0x100))


class _Refused(Exception):
    """A bound passed; the message says which."""


@dataclass(frozen=True)
class WireBounds:
    """The bounds of one request type.

    `limits`: field path (`messages`, `messages.parts`: names from the request type down) → the most
    elements it may hold in one parent, with the config key in `keys` for the message. A repeated
    field without a limit is bounded by `max_records`.
    """

    descriptor: Descriptor
    limits: Mapping[str, int] = field(default_factory=dict)
    keys: Mapping[str, str] = field(default_factory=dict)
    max_records: int = DEFAULT_MAX_RECORDS

    def refusal(self, data: bytes) -> str:
        """'' when `data` keeps every bound (or is not valid protobuf: the parser says why); else why not."""
        try:
            _Walk(self).message(memoryview(data), self.descriptor, "", 0)
        except _Refused as exc:
            return str(exc)
        except _Malformed:
            return ""
        return ""


class _Malformed(Exception):
    """Bytes that are not protobuf wire format: left to the real parser, which names the problem."""


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    repeated: bool
    message: Descriptor | None  # the type of a message field
    width: int  # bytes per value when packed (0: varints); -1: not packable


class _Walk:
    def __init__(self, bounds: WireBounds) -> None:
        self.bounds = bounds
        self.records = 0

    def message(self, data: memoryview, descriptor: Descriptor | None, path: str, depth: int) -> None:
        if self._records(data, 0, descriptor, path, depth, group=None) != len(data):
            raise _Malformed

    def _records(
        self,
        data: memoryview,
        pos: int,
        descriptor: Descriptor | None,
        path: str,
        depth: int,
        group: int | None,
    ) -> int:
        """Walk records from `pos` to the end of `data`, or (in a group) to the group's end record;
        the position after them."""
        if depth > _MAX_DEPTH:
            raise _Malformed
        counts: dict[int, int] = {}
        table = _fields(descriptor) if descriptor is not None else {}
        end = len(data)
        while pos < end:
            self._add_records(1)
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if number == 0:
                raise _Malformed
            fd = table.get(number)
            if wire_type == 4:
                if number != group:
                    raise _Malformed
                return pos
            if wire_type == 3:  # a group: no proto here declares one; skipped like an unknown field
                pos = self._records(data, pos, None, path, depth + 1, group=number)
                continue
            if fd is not None and fd.repeated:
                sub = f"{path}.{fd.name}" if path else fd.name
                self._count(counts, number, sub, self._elements(data, pos, wire_type, fd, sub))
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                if pos + length > end:
                    raise _Malformed
                if fd is not None and fd.message is not None:
                    sub = f"{path}.{fd.name}" if path else fd.name
                    self.message(data[pos : pos + length], fd.message, sub, depth + 1)
                pos += length
            else:
                raise _Malformed  # wire types 6, 7 do not exist
        if group is not None or pos > end:
            raise _Malformed  # a group never ended, or a record runs past the end
        return pos

    def _elements(self, data: memoryview, pos: int, wire_type: int, fd: _Field, path: str) -> int:
        """How many values one record of a repeated field adds: 1, or those of a packed run of numbers."""
        if wire_type != 2 or fd.width < 0:
            return 1
        length, start = _varint(data, pos)
        if fd.width:
            return length // fd.width
        # Varints: at least one byte each, at most ten. Bounded by the byte length before counting,
        # so no more than `limit` x 10 bytes are ever looked at.
        limit = self.bounds.limits.get(path, self.bounds.max_records)
        if length <= limit:
            return length if length <= 1 else _count_varints(data[start : start + length])
        if length > limit * _VARINT_MAX_BYTES:
            return limit + 1
        return _count_varints(data[start : start + length])

    def _add_records(self, n: int) -> None:
        before, self.records = self.records, self.records + n
        if self.records > self.bounds.max_records:
            raise _Refused(f"request: more than {self.bounds.max_records} protobuf fields in all")
        if before // _YIELD_EVERY != self.records // _YIELD_EVERY:
            time.sleep(
                0
            )  # the GIL, let go: a long walk (in a thread: large_requests.py) never starves the loop

    def _count(self, counts: dict[int, int], number: int, path: str, elements: int) -> None:
        n = counts.get(number, 0) + elements
        counts[number] = n
        if elements > 1:
            self._add_records(elements - 1)  # each packed value is a record of its own for the budget
        limit = self.bounds.limits.get(path)
        if limit is not None and n > limit:
            key = self.bounds.keys.get(path)
            raise _Refused(f"{path}: more than {limit} elements{f' ({key})' if key else ''}")


def _count_varints(chunk: memoryview) -> int:
    """Varints in `chunk`: its bytes without the continuation bit (C speed: bytes.translate)."""
    raw = bytes(chunk)
    return len(raw.translate(None, _CONTINUATION_BYTES))


_FIELDS: dict[str, dict[int, _Field]] = {}


def _fields(descriptor: Descriptor) -> dict[int, _Field]:
    """number → what the walk needs of each of a message type's fields (cached)."""
    table = _FIELDS.get(descriptor.full_name)
    if table is None:
        table = {
            fd.number: _Field(
                fd.name,
                fd.is_repeated,
                fd.message_type if fd.type == FieldDescriptor.TYPE_MESSAGE else None,
                -1 if fd.type in _NOT_PACKABLE else _FIXED_WIDTH.get(fd.type, 0),
            )
            for fd in descriptor.fields
        }
        _FIELDS[descriptor.full_name] = table
    return table


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Malformed
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
