"""Test doubles of the engine tests: a byte tokenizer and a small real-attention fake model."""

from __future__ import annotations

import math
import time

import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.models.layers.attention import PagedAttention
from torch import nn

EOS = 256


class ByteTokenizer:
    """Ids 0..255 are bytes, 256 is EOS (decodes to nothing); byte-level like the real BPE."""

    stop_token_ids = (EOS,)
    vocab_size = 260

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class FakeModel(nn.Module):
    """One paged-attention layer over position-aware embeddings: outputs depend on the whole cached
    context, so any cache or batching mistake changes the tokens. Same API as the thinker."""

    def __init__(
        self, vocab: int = 260, hidden: int = 32, heads: int = 4, kv_heads: int = 2, seed: int = 0
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.head_dim = hidden // heads
        self.embed = nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.pos = nn.Parameter(torch.randn(4096, hidden, generator=g) * 0.5)
        self.q = nn.Parameter(torch.randn(hidden, hidden, generator=g) / math.sqrt(hidden))
        self.kv = nn.Parameter(
            torch.randn(hidden, 2 * kv_heads * self.head_dim, generator=g) / math.sqrt(hidden)
        )
        self.head = nn.Parameter(torch.randn(hidden, vocab, generator=g))
        self.attn = PagedAttention(heads, kv_heads, self.head_dim, 1 / math.sqrt(self.head_dim))

    def forward(
        self, input_ids, positions, modality=None, inputs_embeds=None, media_index=None, media_rows=None
    ):
        x = self.embed[input_ids]
        if media_index is not None:
            x = x.index_copy(0, media_index, media_rows)
        x = x + self.pos[positions[0]]
        t = x.shape[0]
        q = (x @ self.q).view(t, -1, self.head_dim)
        k, v = (x @ self.kv).view(t, 2, -1, self.head_dim).unbind(1)
        return x + self.attn(q, k, v).reshape(t, -1)

    def compute_logits(self, hidden_rows):
        return (hidden_rows @ self.head).float()

    def attention_layers(self):
        return [self.attn]

    def kv_cache_shape(self, num_blocks, block_size):
        return (num_blocks, block_size, self.attn.num_kv_heads, self.head_dim)


def make_fake_engine(**engine_kw) -> LLMEngine:
    cfg = resolve_engine_config(EngineConfig(**engine_kw))
    runner = ModelRunner(FakeModel(), cfg, "cpu")
    return LLMEngine(runner, ByteTokenizer(), [EOS])


def slow_steps(engine: LLMEngine, step_s: float) -> LLMEngine:
    """Make each of `engine`'s steps take `step_s` longer, so a request lives long enough to be
    cancelled or aborted mid-way."""
    real_step = engine.step

    def step():
        time.sleep(step_s)
        return real_step()

    engine.step = step
    return engine
