"""ThinkerServicer: proto in → engine call → proto out. No model or scheduling logic here.

Rank 0 serves `omnistage.v1.Thinker`; a cancelled stream (client gone, deadline, gateway abort)
aborts the engine request at once so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc
from omnistage.common.runtime.errors import InvalidRequest, Overloaded, StageUnavailable
from omnistage.services.thinker.engine.llm_engine import QueueFullError, RequestError, RequestOutput
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.engine_loop import EngineFailed, EngineLoop
from omnistage.services.thinker.models.tokenizer import MingTokenizer
from omnistage.v1 import common_pb2, thinker_pb2, thinker_pb2_grpc

_log = logging.getLogger(__name__)
_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop_string": common_pb2.FINISH_REASON_STOP_STRING,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def sampling_from_proto(s: common_pb2.SamplingParams, vocab_size: int) -> SamplingParams:
    """Proto zero values mean "off"; the engine's own checks give the INVALID_ARGUMENT message."""
    for i, tid in enumerate(s.stop_token_ids):
        if not 0 <= tid < vocab_size:
            raise InvalidRequest(f"sampling.stop_token_ids[{i}]: {tid} is outside the vocabulary (0..{vocab_size - 1})")
    try:
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p or 1.0,
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty or 1.0,
            presence_penalty=s.presence_penalty,
            seed=s.seed if s.HasField("seed") else None,
            max_tokens=s.max_tokens,
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            logprobs=s.logprobs,
            ignore_eos=s.ignore_eos,
        )
    except ValueError as exc:
        raise InvalidRequest(f"sampling: {exc}") from exc


def _delta(out: RequestOutput) -> thinker_pb2.ThinkerEvent:
    return thinker_pb2.ThinkerEvent(
        delta=thinker_pb2.TokenDelta(
            token_ids=out.token_ids,
            text=out.text,
            logprobs=[
                common_pb2.TokenLogprobs(
                    token_id=lp.token_id,
                    logprob=lp.logprob,
                    top_token_ids=lp.top_token_ids,
                    top_logprobs=lp.top_logprobs,
                )
                for lp in out.logprobs
            ],
        )
    )


def _finish(out: RequestOutput) -> thinker_pb2.ThinkerEvent:
    usage = out.usage
    return thinker_pb2.ThinkerEvent(
        finish=thinker_pb2.ThinkerFinish(
            reason=_FINISH[out.finish_reason.value],
            usage=common_pb2.Usage(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                time_to_first_token_ms=usage.time_to_first_token_ms,
            )
            if usage
            else None,
        )
    )


class ThinkerServicer(thinker_pb2_grpc.ThinkerServicer):
    """One short method per RPC; the engine thread does the work."""

    def __init__(self, loop: EngineLoop, tokenizer: MingTokenizer, max_model_len: int) -> None:
        self.loop = loop
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._ids = itertools.count()

    def _prompt_ids(self, request: thinker_pb2.ThinkerRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            ids = self.tokenizer.encode(request.text)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
            vocab = self.tokenizer.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(f"token_ids: {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        else:
            raise InvalidRequest("prompt: set text or token_ids")
        if not ids:
            raise InvalidRequest("prompt: empty after tokenization")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt: {len(ids)} tokens leave no room to generate (max_model_len {self.max_model_len})"
            )
        if request.multimodal:
            raise StageUnavailable("multimodal: embeddings are not accepted by this thinker yet", retryable=False)
        return ids

    async def Generate(self, request: thinker_pb2.ThinkerRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or f"thinker-{next(self._ids)}"
        ids = self._prompt_ids(request)
        params = sampling_from_proto(request.sampling, self.tokenizer.vocab_size)
        try:
            stream = await self.loop.submit(request_id, ids, params)
        except RequestError as exc:
            raise InvalidRequest(str(exc)) from exc
        except QueueFullError as exc:
            raise Overloaded(f"thinker queue full: {exc}", retry_after_ms=200) from exc
        except EngineFailed as exc:
            raise StageUnavailable(f"thinker {exc}") from exc
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):  # e.g. "thinker rank 2 died while serving (step 57): ..."
                    raise StageUnavailable(f"thinker {out}")
                if out.token_ids or out.text:
                    yield _delta(out)
                if out.finished:
                    finished = True
                    yield _finish(out)
        finally:
            if not finished:
                # Cancelled or failed mid-stream: free the KV blocks now, not at max_tokens.
                self.loop.abort(request_id)
                _log.info("request %s aborted before it finished", request_id)

    async def Abort(self, request: thinker_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        aborted = await asyncio.wrap_future(self.loop.abort(request.request_id))
        return thinker_pb2.AbortResponse(aborted=bool(aborted))
