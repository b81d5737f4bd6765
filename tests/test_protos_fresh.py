"""The committed omnistage/v1 generated code equals what protoc makes from the .proto files now."""

from __future__ import annotations

import shutil

from omnistage.common import protogen


def test_generated_code_is_fresh():
    problems = protogen.check()
    assert problems == [], "stale generated code; run `omnistage protos`:\n" + "\n".join(problems)


def test_check_detects_a_stale_file(tmp_path):
    root = tmp_path / "protos"
    shutil.copytree(protogen.proto_root() / protogen.PACKAGE_DIR, root / protogen.PACKAGE_DIR)
    assert protogen.check(root) == []
    with open(root / protogen.PACKAGE_DIR / "control.proto", "a") as f:
        f.write("\nmessage AddedLater {}\n")
    (root / protogen.PACKAGE_DIR / "orphan_pb2.py").write_text("")
    problems = protogen.check(root)
    assert any(p.startswith("control_pb2.py: stale") for p in problems)
    assert "orphan_pb2.py: generated file without a .proto" in problems
    protogen.write(root)
    assert protogen.check(root) == []
    assert not (root / protogen.PACKAGE_DIR / "orphan_pb2.py").exists()
