"""The thinker's step engine (`engine:`): paged KV cache, continuous batching, kernels, graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from omnistage.common.config.checks import ConfigError, positive_fields

# The thinker's kernel choices (engine.attention_backend / engine.moe_backend); `auto` takes the
# fastest one the device runs (services/thinker/models/layers/backends.py).
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
MOE_BACKENDS = ("auto", "torch", "triton")
# The TP group's all-reduce (engine.tp_allreduce): auto takes the one-shot peer all-reduce for small
# messages where every rank can (services/thinker/tp/allreduce_choice.py); nccl never does.
TP_ALLREDUCE_MODES = ("auto", "nccl")


@dataclass(frozen=True)
class EngineConfig:
    """Thinker engine limits (paged KV cache, continuous batching)."""

    # Tokens per KV block.
    block_size: int = 16
    # KV blocks; 0 means sized automatically (CPU: from max_num_seqs * max_model_len).
    num_kv_blocks: int = 0
    # Requests decoded together in one step.
    max_num_seqs: int = 32
    # Tokens (prefill chunks + decodes) in one step.
    max_num_batched_tokens: int = 512
    # Prompt + output tokens of one request.
    max_model_len: int = 2048
    # Split long prompts into chunks of at most max_num_batched_tokens, mixed with decodes.
    chunked_prefill: bool = True
    # Prompt tokens a step computes while other sequences decode (chunked prefill only): bounds how
    # long a decode waits behind a long prompt; 0 means whatever max_num_batched_tokens leaves.
    prefill_tokens_while_decoding: int = 0
    # max_tokens when a request gives 0; requests may not exceed max_model_len - prompt.
    default_max_tokens: int = 256
    # Requests waiting beyond the running ones before RESOURCE_EXHAUSTED.
    max_queued_requests: int = 256
    # Arrivals together are one batch: an idle engine holds its first step at most this long while
    # requests are still on their way through the thinker's request flow (checked, tokenized), so a
    # burst is prefilled in one step; a request alone never waits. 0: never hold.
    gather_arrivals_ms: float = 5.0
    # Reuse the KV blocks of a prompt prefix computed before (same tokens, same media, same
    # positions) instead of computing them again; freed blocks keep their K/V until needed.
    prefix_caching: bool = True
    # KV cache size in tokens; 0 means auto-profile (on a device with a budget), >0 pins it and skips the search.
    kv_tokens: int = 0
    # Multiplier (0, 1] on the KV budget the auto-profile computes (1.0 = use all measured headroom).
    kv_safety_factor: float = 1.0
    # Headroom the auto-profile keeps and proves free after the rebuild by allocating it once.
    kv_canary_bytes: int = 256 * 1024 * 1024
    # KV tokens of the probe cache used while measuring the peak; 0 means chosen by the engine.
    kv_probe_tokens: int = 0
    # Attention kernels: auto | torch (reference) | triton (paged prefill, decode and KV writes in
    # Triton) | flashinfer (prefill and mixed steps through FlashInfer, the rest as triton).
    attention_backend: str = "auto"
    # Routed-expert kernels: auto | torch (reference, one GEMM pair per expert) | triton (fused MoE).
    moe_backend: str = "auto"
    # Plan and launch the next step while the device runs the current one (the decodes' new ids stay
    # on the device): auto | on | off; auto is on for CUDA, off elsewhere.
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    # The TP group's all-reduce: auto | nccl. auto sums small messages (decode steps) with a one-shot
    # kernel over CUDA IPC peer buffers where every rank can, NCCL the rest (torch.distributed for
    # everything elsewhere, the reason logged); nccl always NCCL. auto because on 2 x H200 it decodes
    # Ming-flash 5 % faster at c=1, and bigger batches' messages go to NCCL (past 128 KiB, where NCCL
    # is faster: MAX_MESSAGE_BYTES in tp/peer_allreduce.py; bench/RESULTS.md 2026-11-29 session 7).
    tp_allreduce: Literal["auto", "nccl"] = "auto"
    # Capture decode steps as CUDA graphs at padded batch sizes (CUDA with graph-safe backends only).
    cuda_graphs: bool = True
    # Largest decode batch replayed from a graph; 0 means max_num_seqs (bigger batches run eagerly).
    cuda_graph_max_batch: int = 0
    # With cuda_graphs: token counts at which text prefill and mixed steps (a prompt chunk, with any
    # decodes beside it) also replay from CUDA graphs, a step padded to the next count; larger steps
    # (counts above max_num_batched_tokens are dropped), and steps with images or audio, run eagerly.
    # () turns it off.
    prefill_graph_tokens: tuple[int, ...] = (64, 128, 256, 512)
    # Structured outputs: one constraint's compile time, past which it is killed and refused.
    grammar_compile_timeout_s: float = 5.0
    # Constraint compiles running at once (each a process of the compile server: a core each).
    grammar_compiles: int = 2
    # Compiles waiting for one of those; more get RESOURCE_EXHAUSTED.
    grammar_waiting: int = 16
    # When rank 0 starts the compile server (and the tokenizer's grammar info): auto | startup |
    # first_use; auto is startup on CUDA, first_use on a plain CPU (its cores are the stages' start-up's).
    grammar_server: Literal["auto", "startup", "first_use"] = "auto"

    def validate(self, path: str) -> None:
        positive_fields(
            self,
            path,
            (
                "block_size",
                "max_num_seqs",
                "max_num_batched_tokens",
                "max_model_len",
                "default_max_tokens",
                "grammar_compile_timeout_s",
                "grammar_compiles",
            ),
        )
        positive_fields(
            self,
            path,
            (
                "num_kv_blocks",
                "max_queued_requests",
                "gather_arrivals_ms",
                "prefill_tokens_while_decoding",
                "kv_tokens",
                "kv_canary_bytes",
                "kv_probe_tokens",
                "cuda_graph_max_batch",
                "grammar_waiting",
            ),
            allow_zero=True,
        )
        for key, allowed in (("attention_backend", ATTENTION_BACKENDS), ("moe_backend", MOE_BACKENDS)):
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"{path}.{key}: expected one of {', '.join(allowed)}, got {getattr(self, key)!r}"
                )
        if any(n < 2 for n in self.prefill_graph_tokens):
            raise ConfigError(
                f"{path}.prefill_graph_tokens: expected token counts of 2 or more (a step of one token "
                f"is a decode), got {list(self.prefill_graph_tokens)}"
            )
        if self.tp_allreduce not in TP_ALLREDUCE_MODES:
            raise ConfigError(
                f"{path}.tp_allreduce: expected one of {', '.join(TP_ALLREDUCE_MODES)}, got {self.tp_allreduce!r}"
            )
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError(
                f"{path}.async_scheduling: expected auto, on or off, got {self.async_scheduling!r}"
            )
        if not 0 < self.kv_safety_factor <= 1:
            raise ConfigError(
                f"{path}.kv_safety_factor: expected a number in (0, 1], got {self.kv_safety_factor}"
            )
        if self.kv_tokens and self.num_kv_blocks:
            raise ConfigError(f"{path}.kv_tokens: set kv_tokens or num_kv_blocks, not both")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"{path}.max_num_batched_tokens: must be >= max_model_len ({self.max_model_len}) "
                "when chunked_prefill is false"
            )
