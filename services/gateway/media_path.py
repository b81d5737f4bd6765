"""`Media.path`: a file on the gateway's host, accepted only inside `gateway.media_dir`.

A path is a capability to read the gateway's disk, so it is refused (PERMISSION_DENIED) unless the
operator named a directory, and its real path (every symlink resolved) must lie inside it. The
check runs before any other media check, and what later stages read is the resolved path it
returns, not the client's string.
"""

from __future__ import annotations

import os
from pathlib import Path

from omnistage.common.runtime.errors import InvalidRequest, PermissionDenied
from omnistage.v1 import omni_pb2

MEDIA_KINDS = ("image", "audio", "video")


def resolve_media_path(path: str, media_dir: str, where: str) -> Path:
    """The real path of `path` (relative paths are relative to `media_dir`); raises naming `where`."""
    if not media_dir:
        raise PermissionDenied(
            f"{where}: this gateway accepts no file paths (gateway.media_dir is not set); "
            "send the file's bytes in Media.data"
        )
    if not path or "\0" in path:
        raise InvalidRequest(f"{where}: must be a non-empty path without NUL characters")
    root = Path(os.path.realpath(media_dir))
    real = Path(os.path.realpath(root / path))
    if not real.is_relative_to(root):
        raise PermissionDenied(f"{where}: {path!r} is outside the gateway's media directory")
    if not real.is_file():
        raise InvalidRequest(f"{where}: {path!r} is not a file in the gateway's media directory")
    return real


def check_media_paths(request: omni_pb2.GenerateRequest, media_dir: str) -> dict[str, Path]:
    """Every Media.path of `request`, checked: `messages[i].parts[j].<kind>.path` → its real path."""
    resolved = {}
    for i, msg in enumerate(request.messages):
        for j, part in enumerate(msg.parts):
            kind = part.WhichOneof("content")
            if kind in MEDIA_KINDS and getattr(part, kind).WhichOneof("source") == "path":
                where = f"messages[{i}].parts[{j}].{kind}.path"
                resolved[where] = resolve_media_path(getattr(part, kind).path, media_dir, where)
    return resolved
