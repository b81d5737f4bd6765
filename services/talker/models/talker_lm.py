"""`BailingTalker2`'s modules under their checkpoint names (ming.md §5.6): the Qwen2 LM (`model`), the
CFM DiT (`cfm.model`), the aggregator, the stop head and the speaker head.

One talker step per request: LM hidden c → CFM patch z (4 latents) → aggregator(z) is the next LM
input; the stop head on c says whether this was the last patch.
"""

from __future__ import annotations

import torch
from omnistage.services.talker.models.config import TalkerModelConfig
from omnistage.services.talker.models.dit import Aggregator, FlowDiT
from omnistage.services.talker.models.qwen2 import Qwen2Stack
from torch import nn


class CFM(nn.Module):
    """Holds the DiT as `cfm.model` (the checkpoint's prefix); sampling lives in `FlowDiT.sample_planned`."""

    def __init__(self, dit: FlowDiT) -> None:
        super().__init__()
        self.model = dit


class TalkerModel(nn.Module):
    def __init__(self, config: TalkerModelConfig) -> None:
        super().__init__()
        hidden = config.llm.hidden_size
        self.config = config
        self.model = Qwen2Stack(config.llm, with_embeddings=True)
        self.cfm = CFM(FlowDiT(config.flow, cond_dim=hidden))
        self.aggregator = Aggregator(config.aggregator, out_dim=hidden)
        self.stop_head = nn.Linear(hidden, 2)
        self.spk_head = nn.Linear(config.spk_dim, hidden)

    @property
    def dit(self) -> FlowDiT:
        return self.cfm.model

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.model.embed_tokens is not None
        return self.model.embed_tokens(ids)

    def stop_probability(self, hidden: torch.Tensor) -> torch.Tensor:
        """softmax(stop_head(c))[1] per row, float32."""
        return torch.softmax(self.stop_head(hidden).float(), dim=-1)[..., 1]
