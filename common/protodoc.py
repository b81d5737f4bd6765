"""The API reference `docs/api.md`, generated from the omnistage/v1 .proto files and their comments."""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2
from omnistage.common import protogen

# The upstream grpc.reflection.v1 proto, vendored as is: not ours to document.
VENDORED = frozenset({"grpc_reflection_v1.proto"})
API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"

# descriptor.proto field numbers that make up SourceCodeInfo.Location paths.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE, _FILE_SYNTAX = 4, 5, 6, 12
_MSG_FIELD, _MSG_NESTED, _MSG_ENUM, _MSG_ONEOF = 2, 3, 4, 8
_ENUM_VALUE, _SERVICE_METHOD = 2, 2

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    _F.TYPE_DOUBLE: "double",
    _F.TYPE_FLOAT: "float",
    _F.TYPE_INT64: "int64",
    _F.TYPE_UINT64: "uint64",
    _F.TYPE_INT32: "int32",
    _F.TYPE_FIXED64: "fixed64",
    _F.TYPE_FIXED32: "fixed32",
    _F.TYPE_BOOL: "bool",
    _F.TYPE_STRING: "string",
    _F.TYPE_BYTES: "bytes",
    _F.TYPE_UINT32: "uint32",
    _F.TYPE_SFIXED32: "sfixed32",
    _F.TYPE_SFIXED64: "sfixed64",
    _F.TYPE_SINT32: "sint32",
    _F.TYPE_SINT64: "sint64",
}


@dataclass(frozen=True)
class Element:
    """One documentable element of a .proto file and its leading comment ('' when it has none)."""

    file: str
    kind: str  # service, rpc, message, field, oneof, enum, value
    name: str  # full name, e.g. omnistage.v1.TensorRef.shape
    comment: str


def descriptor_set(root: Path | None = None) -> descriptor_pb2.FileDescriptorSet:
    """Parse every omnistage/v1/*.proto under `root` (with source info: comments and locations)."""
    from grpc_tools import protoc

    root = root or protogen.proto_root()
    protos = sorted((root / protogen.PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files in {root / protogen.PACKAGE_DIR}")
    with tempfile.TemporaryDirectory(prefix="omnistage-protodoc-") as tmp:
        out = Path(tmp) / "api.pb"
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            *(str(p.relative_to(root)) for p in protos),
        ]
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} (args: {' '.join(args[1:])})")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _ours(fds: descriptor_pb2.FileDescriptorSet) -> list[descriptor_pb2.FileDescriptorProto]:
    return [f for f in fds.file if Path(f.name).name not in VENDORED]


def _comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    return {
        tuple(loc.path): loc.leading_comments
        for loc in file.source_code_info.location
        if loc.leading_comments.strip()
    }


def _walk_enum(file, comments, enum, path, prefix):
    name = f"{prefix}.{enum.name}"
    yield Element(file.name, "enum", name, comments.get(path, "")), enum, path
    for i, value in enumerate(enum.value):
        vpath = (*path, _ENUM_VALUE, i)
        yield Element(file.name, "value", f"{name}.{value.name}", comments.get(vpath, "")), value, vpath


def _walk_message(file, comments, msg, path, prefix):
    name = f"{prefix}.{msg.name}"
    yield Element(file.name, "message", name, comments.get(path, "")), msg, path
    for i, oneof in enumerate(msg.oneof_decl):
        opath = (*path, _MSG_ONEOF, i)
        if not _is_synthetic(msg, i):
            yield Element(file.name, "oneof", f"{name}.{oneof.name}", comments.get(opath, "")), oneof, opath
    for i, field in enumerate(msg.field):
        fpath = (*path, _MSG_FIELD, i)
        yield Element(file.name, "field", f"{name}.{field.name}", comments.get(fpath, "")), field, fpath
    for i, nested in enumerate(msg.nested_type):
        yield from _walk_message(file, comments, nested, (*path, _MSG_NESTED, i), name)
    for i, enum in enumerate(msg.enum_type):
        yield from _walk_enum(file, comments, enum, (*path, _MSG_ENUM, i), name)


def _is_synthetic(msg: descriptor_pb2.DescriptorProto, oneof_index: int) -> bool:
    """The oneof protoc makes for a proto3 `optional` field (not a oneof of the source)."""
    return any(
        f.proto3_optional and f.oneof_index == oneof_index and f.HasField("oneof_index") for f in msg.field
    )


def _walk(file: descriptor_pb2.FileDescriptorProto):
    """(Element, descriptor, path) of every element of one file, in source order per kind."""
    comments = _comments(file)
    prefix = file.package
    for i, svc in enumerate(file.service):
        path = (_FILE_SERVICE, i)
        yield Element(file.name, "service", f"{prefix}.{svc.name}", comments.get(path, "")), svc, path
        for j, method in enumerate(svc.method):
            mpath = (*path, _SERVICE_METHOD, j)
            yield (
                Element(file.name, "rpc", f"{prefix}.{svc.name}.{method.name}", comments.get(mpath, "")),
                method,
                mpath,
            )
    for i, msg in enumerate(file.message_type):
        yield from _walk_message(file, comments, msg, (_FILE_MESSAGE, i), prefix)
    for i, enum in enumerate(file.enum_type):
        yield from _walk_enum(file, comments, enum, (_FILE_ENUM, i), prefix)


def elements(fds: descriptor_pb2.FileDescriptorSet | None = None) -> list[Element]:
    """Every element of our (not vendored) protos."""
    fds = fds or descriptor_set()
    return [element for file in _ours(fds) for element, _, _ in _walk(file)]


def undocumented(fds: descriptor_pb2.FileDescriptorSet | None = None) -> list[Element]:
    """Elements without a leading comment."""
    return [e for e in elements(fds) if not e.comment.strip()]


# --- rendering -------------------------------------------------------------------------------------


def _paragraphs(comment: str) -> str:
    """A leading comment as Markdown paragraphs: wrapped lines joined, blank lines kept."""
    lines = [line.strip() for line in comment.strip().splitlines()]
    paragraphs, current = [], []
    for line in lines:
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


def _cell(comment: str) -> str:
    """A comment as one table cell: one line, pipes escaped."""
    return _paragraphs(comment).replace("\n\n", "<br>").replace("|", "\\|")


def _link(type_name: str) -> str:
    name = type_name.lstrip(".")
    return f"[`{name.rsplit('.', 1)[-1]}`](#{_anchor(name)})"


def _anchor(full_name: str) -> str:
    return full_name.lower().replace(".", "-")


def _file_anchor(file: descriptor_pb2.FileDescriptorProto) -> str:
    return Path(file.name).name.replace(".", "-")


def _field_type(field: descriptor_pb2.FieldDescriptorProto) -> str:
    if field.type in (_F.TYPE_MESSAGE, _F.TYPE_ENUM):
        base = _link(field.type_name)
    else:
        base = f"`{_SCALARS[field.type]}`"
    if field.label == _F.LABEL_REPEATED:
        return f"repeated {base}"
    if field.proto3_optional:
        return f"optional {base}"
    return base


def _render_file(file: descriptor_pb2.FileDescriptorProto, out: list[str]) -> None:
    comments = _comments(file)
    header = comments.get((_FILE_SYNTAX,), "")
    out += [f'<a id="{_file_anchor(file)}"></a>', "", f"## {Path(file.name).name}", ""]
    if header:
        out += [_paragraphs(header), ""]
    for element, desc, path in _walk(file):
        heading = f'<a id="{_anchor(element.name)}"></a>'
        text = _paragraphs(element.comment)
        name = element.name.removeprefix(file.package + ".")
        if element.kind == "service":
            out += [heading, "", f"### service `{element.name}`", "", text, ""]
        elif element.kind == "rpc":
            req = ("stream " if desc.client_streaming else "") + _link(desc.input_type)
            resp = ("stream " if desc.server_streaming else "") + _link(desc.output_type)
            out += [f"#### rpc `{desc.name}`", "", f"{req} → {resp}", "", text, ""]
        elif element.kind == "message":
            out += [heading, "", f"### message `{name}`", "", text, ""]
            _render_message(desc, path, comments, out)
        elif element.kind == "enum":
            out += [heading, "", f"### enum `{name}`", "", text, ""]
            out += ["| Value | Number | Description |", "|---|---|---|"]
            for i, value in enumerate(desc.value):
                out.append(
                    f"| `{value.name}` | {value.number} | {_cell(comments.get((*path, _ENUM_VALUE, i), ''))} |"
                )
            out.append("")


def _render_message(
    desc: descriptor_pb2.DescriptorProto,
    path: tuple[int, ...],
    comments: dict[tuple[int, ...], str],
    out: list[str],
) -> None:
    """A message's fields table, its oneofs and its reserved numbers and names."""
    if desc.field:
        out += ["| Field | Type | Number | Description |", "|---|---|---|---|"]
        oneofs = [o.name for o in desc.oneof_decl]
        for i, field in enumerate(desc.field):
            note = _cell(comments.get((*path, _MSG_FIELD, i), ""))
            if field.HasField("oneof_index") and not field.proto3_optional:
                note = f"*oneof `{oneofs[field.oneof_index]}`.* {note}"
            out.append(f"| `{field.name}` | {_field_type(field)} | {field.number} | {note} |")
        out.append("")
    for i, oneof in enumerate(desc.oneof_decl):
        if not _is_synthetic(desc, i):
            out += [f"oneof `{oneof.name}`: {_paragraphs(comments.get((*path, _MSG_ONEOF, i), ''))}", ""]
    if desc.reserved_range or desc.reserved_name:
        numbers = ", ".join(
            str(r.start) if r.end - r.start == 1 else f"{r.start}..{r.end - 1}" for r in desc.reserved_range
        )
        names = ", ".join(f"`{n}`" for n in desc.reserved_name)
        out += [f"Reserved: {', '.join(x for x in (numbers, names) if x)}.", ""]


def render(fds: descriptor_pb2.FileDescriptorSet | None = None) -> str:
    """The Markdown of docs/api.md."""
    fds = fds or descriptor_set()
    files = sorted(_ours(fds), key=lambda f: (Path(f.name).name != "omni.proto", f.name))
    out = [
        "# API reference",
        "",
        "<!-- Generated from protos/omnistage/v1/*.proto by `make docs` (common/protodoc.py); do not edit. -->",
        "",
        "Package `omnistage.v1`. The public API is the gateway's `Omni` service (`omni.proto`); the",
        "others are stage APIs between services (`thinker`, `encoder`, `talker`, `imagegen`) and the",
        "`Control` API on every service's admin port. Streaming is marked `stream`.",
        "",
    ]
    for file in files:
        names = [f"[`{s.name}`](#{_anchor(f'{file.package}.{s.name}')})" for s in file.service]
        out.append(
            f"- [`{Path(file.name).name}`](#{_file_anchor(file)})"
            + (f": {', '.join(names)}" if names else "")
        )
    out.append("")
    for file in files:
        _render_file(file, out)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(line.rstrip() for line in out).replace("\n\n\n", "\n\n") + "\n"


def check(path: Path = API_DOC, root: Path | None = None) -> list[str]:
    """Why `path` differs from a fresh render; empty when up to date."""
    if not path.exists():
        return [f"{path}: missing (run `make docs`)"]
    if path.read_text() != render(descriptor_set(root)):
        return [f"{path}: stale (run `make docs`)"]
    return []


def write(path: Path = API_DOC, root: Path | None = None) -> Path:
    path.write_text(render(descriptor_set(root)))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnistage.common.protodoc", description=__doc__.split("\n")[0]
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/api.md is stale")
    mode.add_argument("--coverage", action="store_true", help="count elements with a leading comment")
    args = parser.parse_args(argv)
    if args.coverage:
        every = elements()
        missing = [e for e in every if not e.comment.strip()]
        for e in missing:
            print(f"undocumented {e.kind}: {e.name} ({e.file})")
        done = len(every) - len(missing)
        print(f"{done}/{len(every)} elements documented ({100 * done / max(len(every), 1):.0f}%)")
        return 1 if missing else 0
    if args.check:
        problems = check()
        for line in problems:
            print(f"protodoc: {line}", file=sys.stderr)
        return 1 if problems else 0
    print(f"protodoc: wrote {write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
