"""One request inside the engine: its tokens, progress through the KV cache, and how it samples."""

from __future__ import annotations

import enum
import itertools
import secrets
import time
from dataclasses import dataclass, fields

import torch
from omnistage.common.sampling import sampling_violation
from omnistage.services.thinker.engine.block_hash import BlockKey, block_key
from omnistage.services.thinker.engine.grammar import Grammar, Matcher
from omnistage.services.thinker.engine.hidden_states import HiddenCapture
from omnistage.services.thinker.engine.media import PromptMedia


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended; values match omnistage.v1.FinishReason names without the prefix."""

    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or max_model_len
    STOP_STRING = "stop_string"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks tokens; neutral defaults mean "off" (temperature 0 is greedy).

    Values follow omnistage.v1.SamplingParams and are checked by the same rules
    (`omnistage.common.sampling`); a proto zero that means "off" (top_p 0, repetition_penalty 0) is
    stored as its neutral value (1.0).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # multiplicative, over prompt and output tokens
    presence_penalty: float = 0.0  # additive, over output tokens
    seed: int | None = None
    max_tokens: int = 0  # 0: the engine default
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0  # top-n logprobs per generated token; 0: none
    ignore_eos: bool = False
    grammar: Grammar | None = None  # structured output: the compiled constraint (grammar.py)
    keep_special_tokens: bool = False  # False: special tokens are left out of the text (not the ids)

    def __post_init__(self) -> None:
        error = sampling_violation({f.name: getattr(self, f.name) for f in fields(self)})
        if error is not None:
            raise ValueError(error)
        for name in ("top_p", "repetition_penalty"):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, 1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


_seq_ids = itertools.count()


def placeholder(row: int) -> int:
    """The token id a sequence holds for a token its launched step sampled at `row` (of that step's
    sampled ids) until the id reaches the host; a plan carries it as is and the runner puts the
    sampled id in its place on the device (model_runner.SampledFeed)."""
    return -(row + 1)


class Sequence:
    """Token ids (prompt then output), KV progress and per-request sampling state.

    `num_computed_tokens` counts tokens whose K/V sit in the cache or are written there by a step
    already launched; after a preemption it drops to 0 and the prompt plus the output so far are
    prefilled again (recompute), so output never changes. The last `num_pending` token ids are
    placeholders: sampled by launched steps, not yet known on the host (async scheduling).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        rope_delta: int = 0,
        prompt_positions: torch.Tensor | None = None,
        media: PromptMedia | None = None,
        hidden: HiddenCapture | None = None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.rope_delta = rope_delta
        self.prompt_positions = prompt_positions  # [3, num_prompt_tokens] for multimodal prompts
        # Encoder rows spliced into the prompt, kept until the request ends (chunks, recompute).
        self.media = media
        # Hidden-state mode: no tokens, the final-norm rows at these slots instead (hidden_states.py).
        self.hidden = hidden
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_pending = 0
        # Prefix caching: keys of this sequence's full blocks (made as needed, block_hash.py), how many
        # blocks of block_table are in the cache's index, and prompt tokens its first admission found
        # cached (Usage.cached_prompt_tokens).
        self.block_keys: list[BlockKey] = []
        self.num_indexed_blocks = 0
        self.num_cached_prompt_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.error = ""  # why it ended with FinishReason.ERROR
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None  # admitted the first time (queue time ends)
        self.first_token_time: float | None = None
        # When the last token and the one before it were emitted (inter-token latency).
        self.last_token_time: float | None = None
        self.prev_token_time: float | None = None
        # An unseeded request gets a random seed now, so its draws stay one stream across preemptions.
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator: torch.Generator | None = None
        # Structured output: this sequence's place in its grammar, advanced by the sampler.
        self.matcher: Matcher | None = params.grammar.matcher() if params.grammar is not None else None

    def generator(self, device: torch.device) -> torch.Generator:
        """This request's own random stream on `device` (where the logits are), made on first use."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def add_pending(self, row: int) -> None:
        """A launched step samples this sequence's next token at `row`: its placeholder goes last."""
        self.token_ids.append(placeholder(row))
        self.num_pending += 1

    def resolve_pending(self, token_id: int) -> int:
        """The oldest placeholder becomes `token_id` (steps complete in launch order); returns how
        many tokens the sequence has up to and including it."""
        assert self.num_pending > 0, f"{self.request_id}: no token is pending"
        index = len(self.token_ids) - self.num_pending
        self.token_ids[index] = token_id
        self.num_pending -= 1
        return index + 1

    def drop_pending(self) -> None:
        """Forget the tokens still pending (the sequence ended: a step launched before it ended
        sampled them for nothing)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending :]
            self.num_pending = 0

    @property
    def needs_tokens_on_host(self) -> bool:
        """Its next draw reads its tokens on the host (a grammar's matcher, repetition or presence
        penalties): a step that samples it completes before the next step is planned."""
        p = self.params
        return self.matcher is not None or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_hidden_states(self) -> bool:
        """A hidden-state request: it ends when its prompt is computed and never samples."""
        return self.hidden is not None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def keys_of_full_blocks(self, block_size: int, num_blocks: int) -> list[BlockKey]:
        """Keys of the first `num_blocks` blocks (each must be full of known tokens), made once each."""
        assert num_blocks * block_size <= self.num_tokens - self.num_pending, "a key over a pending token"
        keys = self.block_keys
        while len(keys) < num_blocks:
            keys.append(block_key(self, len(keys), block_size, keys[-1] if keys else None))
        return keys[:num_blocks]

    def positions(self, start: int, end: int) -> list[list[int]]:
        """3D rope positions of tokens [start, end): the prompt's own (multimodal) or index + rope_delta."""
        text = list(range(start + self.rope_delta, end + self.rope_delta))
        if self.prompt_positions is None or start >= self.num_prompt_tokens:
            return [text, text, text]
        split = min(end, self.num_prompt_tokens)
        own = self.prompt_positions[:, start:split].tolist()
        tail = text[split - start :]
        return [own[axis] + tail for axis in range(3)]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )
