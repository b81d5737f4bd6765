"""A request's outputs that queued while its consumer was busy reach it as one event (tokens, text and
logprobs joined, in order), never past its end, a hidden-state output or an error."""

from __future__ import annotations

import asyncio

from omnistage.services.thinker.engine.llm_engine import RequestOutput, Usage
from omnistage.services.thinker.engine.sequence import FinishReason
from omnistage.services.thinker.request_flow import next_output


def _out(*ids: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        "r",
        list(ids),
        "".join(f"<{i}>" for i in ids),
        logprobs=[f"lp{i}" for i in ids],  # opaque to the joining
        finished=finished,
        finish_reason=FinishReason.STOP if finished else None,
        usage=Usage(3, len(ids), 0.0) if finished else None,
    )


def _drain(stream: asyncio.Queue) -> list:
    async def go() -> list:
        held: list[BaseException] = []
        got = []
        while not (got and isinstance(got[-1], RequestOutput) and got[-1].finished):
            got.append(await next_output(stream, held))
            if isinstance(got[-1], BaseException):
                break
        return got

    return asyncio.run(go())


def test_outputs_queued_behind_a_busy_consumer_come_as_one_in_order_up_to_the_end():
    stream: asyncio.Queue = asyncio.Queue()
    for out in (_out(1), _out(2, 3), _out(4), _out(5, finished=True)):
        stream.put_nowait(out)
    (joined,) = _drain(stream)
    assert joined.token_ids == [1, 2, 3, 4, 5]
    assert joined.text == "<1><2><3><4><5>" and joined.logprobs == ["lp1", "lp2", "lp3", "lp4", "lp5"]
    assert joined.finished and joined.finish_reason is FinishReason.STOP and joined.usage == Usage(3, 1, 0.0)


def test_a_consumer_that_keeps_up_gets_each_step_and_an_error_comes_after_the_tokens_before_it():
    async def scenario() -> list:
        stream: asyncio.Queue = asyncio.Queue()
        held: list[BaseException] = []
        got = []
        stream.put_nowait(_out(1))
        got.append(await next_output(stream, held))  # nothing else queued: one step's output
        stream.put_nowait(_out(2))
        stream.put_nowait(_out(3))
        stream.put_nowait(RuntimeError("rank 1 died"))
        got.append(await next_output(stream, held))
        got.append(await next_output(stream, held))
        return got

    first, joined, error = asyncio.run(scenario())
    assert first.token_ids == [1]
    assert joined.token_ids == [2, 3] and not joined.finished
    assert isinstance(error, RuntimeError)


def test_nothing_is_joined_past_a_final_output():
    stream: asyncio.Queue = asyncio.Queue()
    stream.put_nowait(_out(1, finished=True))
    stream.put_nowait(_out(9))  # never happens in the engine; if it did, it is not this request's end
    (end,) = _drain(stream)
    assert end.token_ids == [1] and stream.qsize() == 1
