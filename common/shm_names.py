"""How omnistage names its `/dev/shm` segments: `omnistage-<owner pid>-<16 hex>`.

Apart from the transport package (whose tensor modules import torch) so that a process can find its own segments
at any time, also before torch is imported (common/runtime/orphan.py).
"""

from __future__ import annotations

import re

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "omnistage"
_NAME_RE = re.compile(rf"^{SEGMENT_PREFIX}-(\d+)-([0-9a-f]{{16}})$")


def segment_owner_pid(name: str) -> int | None:
    """Owner pid encoded in a segment name, or None if `name` is not one of ours."""
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None
