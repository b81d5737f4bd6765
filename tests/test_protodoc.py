"""Every element of the omnistage/v1 protos carries a leading comment, and docs/api.md is what the
protos say now (common/protodoc.py)."""

from __future__ import annotations

import shutil

from omnistage.common import protodoc, protogen


def test_every_proto_element_has_a_leading_comment():
    fds = protodoc.descriptor_set()
    missing = protodoc.undocumented(fds)
    every = protodoc.elements(fds)
    assert missing == [], (
        f"{len(missing)} of {len(every)} proto elements have no leading comment:\n"
        + "\n".join(f"  {e.kind} {e.name} ({e.file})" for e in missing)
    )
    kinds = {e.kind for e in every}
    assert kinds == {"service", "rpc", "message", "field", "oneof", "enum", "value"}
    assert not any(e.file.endswith("grpc_reflection_v1.proto") for e in every), (
        "the vendored proto is upstream's"
    )


def _copy_protos(tmp_path):
    root = tmp_path / "protos"
    shutil.copytree(
        protogen.proto_root() / protogen.PACKAGE_DIR,
        root / protogen.PACKAGE_DIR,
        ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"),
    )
    return root


def test_a_missing_comment_is_found_for_each_kind(tmp_path):
    root = _copy_protos(tmp_path)
    with open(root / protogen.PACKAGE_DIR / "control.proto", "a") as f:
        f.write(
            "\n// Documented.\nmessage Later {\n  int32 plain = 1;\n  oneof choice {\n    // Documented.\n"
            "    string a = 2;\n  }\n  enum Inner {\n    // Documented.\n    INNER_UNSPECIFIED = 0;\n  }\n}\n"
            "service Bare {\n  // Documented.\n  rpc Call(Later) returns (Later);\n  rpc Other(Later) returns (Later);\n}\n"
            "\n// Detached from the enum below by a blank line: not a leading comment.\n\n"
            "enum Loose {\n  // Documented.\n  LOOSE_UNSPECIFIED = 0;\n  LOOSE_ONE = 1;\n}\n"
        )
    missing = {(e.kind, e.name) for e in protodoc.undocumented(protodoc.descriptor_set(root))}
    assert missing == {
        ("field", "omnistage.v1.Later.plain"),
        ("oneof", "omnistage.v1.Later.choice"),
        ("enum", "omnistage.v1.Later.Inner"),
        ("service", "omnistage.v1.Bare"),
        ("rpc", "omnistage.v1.Bare.Other"),
        ("enum", "omnistage.v1.Loose"),
        ("value", "omnistage.v1.Loose.LOOSE_ONE"),
    }


def test_api_doc_is_fresh():
    problems = protodoc.check()
    assert problems == [], "docs/api.md is stale; run `make docs`:\n" + "\n".join(problems)


def test_check_detects_a_stale_api_doc(tmp_path):
    root = _copy_protos(tmp_path)
    doc = tmp_path / "api.md"
    assert protodoc.check(doc, root) == [f"{doc}: missing (run `make docs`)"]
    protodoc.write(doc, root)
    assert protodoc.check(doc, root) == []
    proto = root / protogen.PACKAGE_DIR / "tensor.proto"
    proto.write_text(
        proto.read_text().replace(
            "// Byte offset of the tensor inside the segment.",
            "// Byte offset of the tensor inside the segment, in bytes.",
        )
    )
    assert protodoc.check(doc, root) == [f"{doc}: stale (run `make docs`)"]


def test_api_doc_lists_every_element():
    fds = protodoc.descriptor_set()
    text = protodoc.render(fds)
    for e in protodoc.elements(fds):
        short = e.name.rsplit(".", 1)[-1]
        if e.kind in ("service", "message", "enum"):
            assert f'<a id="{e.name.lower().replace(".", "-")}"></a>' in text, e.name
        elif e.kind == "rpc":
            assert f"#### rpc `{short}`" in text, e.name
        elif e.kind == "field":
            assert f"| `{short}` |" in text, e.name
        elif e.kind == "value":
            assert f"| `{short}` |" in text, e.name
        else:
            assert f"oneof `{short}`" in text, e.name
    # Streaming shapes and field numbers come from the descriptors.
    assert (
        "stream [`ConverseRequest`](#omnistage-v1-converserequest) → stream "
        "[`GenerateEvent`](#omnistage-v1-generateevent)"
    ) in text
    assert "| `custom_voice` | [`VoiceClip`](#omnistage-v1-voiceclip) | 20 |" in text
    assert "| `seed` | optional `uint64` | 7 |" in text
