"""ThinkerServicer: proto in → request flow → proto out; it knows only the flow's events (request_flow.py).

Rank 0 serves `omnistage.v1.Thinker`. A caller stops a request by cancelling its stream: the
engine request is aborted at once and its KV blocks freed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import grpc
from omnistage.common.runtime.deadlines import deadline_after
from omnistage.services.thinker.request_flow import (
    Event,
    Finished,
    Hidden,
    Started,
    ThinkerEngine,
    Tokens,
    logprob_token_bytes,
)
from omnistage.v1 import common_pb2, thinker_pb2, thinker_pb2_grpc

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop_string": common_pb2.FINISH_REASON_STOP_STRING,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


class ThinkerServicer(thinker_pb2_grpc.ThinkerServicer):
    def __init__(self, engine: ThinkerEngine) -> None:
        self.engine = engine

    async def Generate(self, request: thinker_pb2.ThinkerRequest, context: grpc.aio.ServicerContext):
        token_bytes = logprob_token_bytes(self.engine, request.sampling.keep_special_tokens)
        deadline = deadline_after(context.time_remaining())
        async with contextlib.aclosing(self.engine.generate(request, deadline)) as events:
            async for event in events:
                yield _event(event, token_bytes)

    async def Tokenize(self, request: thinker_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        ids = await self.engine.tokenize(request)
        return common_pb2.TokenizeResponse(token_ids=ids, max_model_len=self.engine.max_model_len)

    async def Detokenize(self, request: common_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        return common_pb2.DetokenizeResponse(text=await self.engine.detokenize(request.token_ids))


def _event(event: Event, tokens: Callable[[int], bytes]) -> thinker_pb2.ThinkerEvent:
    if isinstance(event, Started):
        return thinker_pb2.ThinkerEvent(
            started=thinker_pb2.Started(
                engine_request_id=event.engine_request_id, prompt_tokens=event.prompt_tokens
            )
        )
    if isinstance(event, Tokens):
        return _delta(event, tokens)
    if isinstance(event, Hidden):
        return thinker_pb2.ThinkerEvent(hidden_states=thinker_pb2.HiddenStates(tensor=event.ref))
    assert isinstance(event, Finished)
    return _finish(event)


def _delta(event: Tokens, tokens: Callable[[int], bytes]) -> thinker_pb2.ThinkerEvent:
    out = event.out
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
                    token=tokens(lp.token_id),
                    top_tokens=[tokens(t) for t in lp.top_token_ids],
                )
                for lp in out.logprobs
            ],
        )
    )


def _finish(event: Finished) -> thinker_pb2.ThinkerEvent:
    out = event.out
    usage = out.usage
    return thinker_pb2.ThinkerEvent(
        finish=thinker_pb2.ThinkerFinish(
            reason=_FINISH[out.finish_reason.value],
            usage=common_pb2.Usage(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                time_to_first_token_ms=usage.time_to_first_token_ms,
                cached_prompt_tokens=usage.cached_prompt_tokens,
            )
            if usage
            else None,
            message="aborted" if out.finish_reason.value == "abort" else out.message,
        )
    )
