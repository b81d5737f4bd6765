"""The speaker vector: CAM++ (`talker/campplus.onnx`, run with onnxruntime on the CPU) on the mean-normalised
80-bin Kaldi fbank of the 16 kHz clip → 192-d (ming.md §5.1). `spk_head` maps it into the LM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime
from omnistage.common.checkpoint.shards import CheckpointError
from omnistage.services.talker.fbank import kaldi_fbank


class SpeakerEncoder:
    def __init__(self, onnx_path: str | Path, threads: int = 2) -> None:
        path = Path(onnx_path)
        if not path.is_file():
            raise CheckpointError(f"{path} not found (the CAM++ speaker model)")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = onnxruntime.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self.input_name = self.session.get_inputs()[0].name
        self.dim = int(self.session.get_outputs()[0].shape[-1])

    def features(self, wave16k: np.ndarray) -> np.ndarray:
        feats = kaldi_fbank(wave16k)
        return feats - feats.mean(axis=0, keepdims=True)

    def __call__(self, wave16k: np.ndarray) -> np.ndarray:
        """16 kHz mono float waveform (≥ 25 ms) → [dim] float32 speaker vector."""
        feats = self.features(wave16k)
        if feats.shape[0] == 0:
            raise ValueError("clip shorter than one 25 ms frame")
        out = self.session.run(None, {self.input_name: feats[None].astype(np.float32)})[0]
        return np.asarray(out, dtype=np.float32).reshape(-1)
