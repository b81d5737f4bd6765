"""Bounds on a request's wire records, checked on the raw bytes before protobuf builds the message.

A protobuf message of 16 MiB can hold 8 M empty sub-messages: the C parser builds them in a quarter
of a second and any Python loop over them takes seconds, all on the event loop that serves every
other call. So before a request is decoded, `WireBounds.refusal` walks its records (tag, length,
skip; sub-messages by their descriptor) and stops at the first bound passed: a repeated field with
more elements than its configured limit (`messages: more than 256 elements (max_messages)`), or a
request with more records in all than `max_records`. The walk costs at most about `max_records`
steps, whatever the size of the request; a normal request has a few dozen records, and bytes
fields (media) are skipped by their length, never read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf.descriptor import Descriptor, FieldDescriptor

# Records of one request, in all: far above any legitimate request (the gateway's largest is
# max_messages x max_parts_per_message parts of a few records each), and small enough to walk in
# well under a tenth of a second.
DEFAULT_MAX_RECORDS = 100_000
_MAX_DEPTH = 32  # nesting the walk follows (protobuf's own recursion limit is 100)


class _Refused(Exception):
    """A bound passed; the message says which."""


@dataclass(frozen=True)
class WireBounds:
    """The bounds of one request type.

    `limits`: field path (`messages`, `messages.parts`: names from the request type down) → the most
    elements it may hold in one parent, with the config key in `keys` for the message.
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


class _Walk:
    def __init__(self, bounds: WireBounds) -> None:
        self.bounds = bounds
        self.records = 0

    def message(self, data: memoryview, descriptor: Descriptor | None, path: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            return
        counts: dict[int, int] = {}
        pos, end = 0, len(data)
        while pos < end:
            self.records += 1
            if self.records > self.bounds.max_records:
                raise _Refused(f"request: more than {self.bounds.max_records} protobuf fields in all")
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
                continue
            if wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                if pos + length > end:
                    raise _Malformed
                fd = _fields(descriptor).get(number) if descriptor is not None else None
                if fd is not None:
                    name, repeated, sub_type = fd
                    sub = f"{path}.{name}" if path else name
                    if repeated:
                        self._count(counts, number, sub)
                    if sub_type is not None:
                        self.message(data[pos : pos + length], sub_type, sub, depth + 1)
                pos += length
            else:
                raise _Malformed  # groups (3, 4) are not used by these protos; 6, 7 do not exist
        if pos > end:
            raise _Malformed

    def _count(self, counts: dict[int, int], number: int, path: str) -> None:
        n = counts.get(number, 0) + 1
        counts[number] = n
        limit = self.bounds.limits.get(path)
        if limit is not None and n > limit:
            key = self.bounds.keys.get(path)
            raise _Refused(f"{path}: more than {limit} elements{f' ({key})' if key else ''}")


_FIELDS: dict[str, dict[int, tuple[str, bool, Descriptor | None]]] = {}


def _fields(descriptor: Descriptor) -> dict[int, tuple[str, bool, Descriptor | None]]:
    """number → (name, repeated, message type or None) of a message type's fields (cached)."""
    table = _FIELDS.get(descriptor.full_name)
    if table is None:
        table = {
            fd.number: (
                fd.name,
                fd.is_repeated,
                fd.message_type if fd.type == FieldDescriptor.TYPE_MESSAGE else None,
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
