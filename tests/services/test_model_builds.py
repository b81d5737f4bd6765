"""A stage process loading its models imports neither torch._dynamo nor torch's symbolic shapes: those
imports cost about 3 s of CPU in every model-stage start (the CPU pipelines of the e2e tests start
dozens). What imported them: math on the meta device (torch runs it in Python reference kernels:
parameter initialisers, rope tables, `to_empty`'s `empty_like`) and the memory meter's dispatch hook
(torch guards it for dynamo)."""

from __future__ import annotations

import subprocess
import sys

# The service path: each stage's loader (`load_format: dummy`) under the simulated device's meter.
SCRIPT = """
import sys
import torch
from omnistage.common.checkpoint.config_only import write_config_checkpoint
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.encoder.models.loader import load_encoders
from omnistage.services.imagegen.models.loader import load_imagegen
from omnistage.services.talker.models.loader import load_talker
from omnistage.services.thinker.models.loader import load_model

ckpt = write_config_checkpoint(sys.argv[1], "tiny")
with torch.inference_mode(), SimulatedDeviceMemory(2 << 30).meter():
    for load in (load_encoders, load_talker, load_imagegen):
        load(ckpt, dtype=torch.float32, device="cpu", dummy=True)
    load_model(ckpt, dtype=torch.float32, device="cpu", load_format="dummy")
heavy = ("torch._dynamo", "torch.fx.experimental.symbolic_shapes")
print(sorted(name for name in sys.modules if name.startswith(heavy)))
"""


def test_loading_every_stages_models_imports_neither_dynamo_nor_symbolic_shapes(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-2000:]
