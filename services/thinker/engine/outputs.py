"""What a request gets from the engine: each step's detokenized text, stop strings, its end and usage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from omnistage.services.thinker.engine.detokenizer import Decoder, Detokenizer
from omnistage.services.thinker.engine.sampler import TokenLogprobs
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams, Sequence


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache at the first admission


@dataclass
class RequestOutput:
    """What one request gained in one step (or its end)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    message: str = ""  # why a request ended with FinishReason.ERROR
    # Hidden-state mode, in the final output: [N, H] final-norm rows at the request's slots (rank 0's device).
    hidden_states: torch.Tensor | None = None


@dataclass
class GenerateResult:
    """A whole request's output (generate())."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    hidden_states: torch.Tensor | None = None
    message: str = ""  # why it ended with FinishReason.ERROR
    usage: Usage | None = None  # the final output's (its time to first token: a benchmark's decode rate)


def usage(seq: Sequence) -> Usage:
    ttft = (seq.first_token_time - seq.arrival_time) * 1000 if seq.first_token_time else 0.0
    return Usage(seq.num_prompt_tokens, seq.num_output_tokens, ttft, seq.num_cached_prompt_tokens)


def final_output(seq: Sequence, message: str = "", hidden: torch.Tensor | None = None) -> RequestOutput:
    """A request's last output with nothing new in it: aborted, refused, or its hidden states."""
    return RequestOutput(
        seq.request_id,
        [],
        "",
        finished=True,
        finish_reason=seq.finish_reason,
        usage=usage(seq),
        message=message,
        hidden_states=hidden,
    )


Sampled = tuple[Sequence, int, TokenLogprobs | None]  # a sequence, the token it got, its logprobs


class Emitter:
    """Each request's detokenizer and the outputs of its tokens; a stop string ends its request
    through `finish` (the scheduler's), so the text and the request end together."""

    def __init__(self, tokenizer: Decoder, finish: Callable[[Sequence, FinishReason], None]) -> None:
        self.tokenizer = tokenizer
        self.finish = finish
        self.detokenizers: dict[str, Detokenizer] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detokenizers[request_id] = Detokenizer(
            self.tokenizer, prompt_token_ids, params.stop, keep_special=params.keep_special_tokens
        )

    def drop(self, request_id: str) -> None:
        """The request ended without a last token (text held back for a stop string is dropped)."""
        self.detokenizers.pop(request_id, None)

    def tokens(self, sampled: list[Sampled], now: float) -> list[RequestOutput]:
        """One output per sequence that got a token this step (its token stops already applied)."""
        outputs = []
        for seq, token_id, logprobs in sampled:
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.prev_token_time, seq.last_token_time = seq.last_token_time, now
            if seq.error:  # the refused token is not shown
                del self.detokenizers[seq.request_id]
                message = f"{seq.error} (after {seq.num_output_tokens - 1} output tokens)"
                outputs.append(final_output(seq, message))
                continue
            outputs.append(self._token(seq, token_id, logprobs))
        return outputs

    def _token(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        detok = self.detokenizers[seq.request_id]
        if seq.finish_reason is FinishReason.STOP:
            text = detok.finish()  # the stop token's own text is never shown
        else:
            text = detok.add(token_id)
            if detok.stopped:
                # Also when this token hit max_tokens: the stop string is why the text ends.
                self.finish(seq, FinishReason.STOP_STRING)
                seq.finish_reason = FinishReason.STOP_STRING
            elif seq.is_finished:
                text += detok.finish()
        out = RequestOutput(seq.request_id, [token_id], text, [logprobs] if logprobs else [])
        if seq.is_finished:
            out.finished, out.finish_reason, out.usage = True, seq.finish_reason, usage(seq)
            del self.detokenizers[seq.request_id]
        return out

    @staticmethod
    def hidden(seq: Sequence, now: float) -> RequestOutput:
        """The final output of a hidden-state request whose prompt is now computed (blocks freed)."""
        seq.first_token_time = now  # "first output": the states are ready
        rows, seq.hidden = seq.hidden.rows if seq.hidden is not None else None, None
        return final_output(seq, hidden=rows)
