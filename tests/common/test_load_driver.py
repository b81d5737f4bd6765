"""The load driver shared by `omnistage bench` and load_tests/pipeline_load.py, against a fake Omni stub:
the runs in order, one unmeasured request per kind first, closed loops of `c` clients, the request's
metadata and deadline, and what counts as an error."""

from __future__ import annotations

import asyncio

import grpc
from omnistage.common.load_driver import RequestShape, finish_code, plan, run_plan
from omnistage.v1 import common_pb2, omni_pb2


class FakeStub:
    """Omni.Generate that answers text (and audio for speech), failing request ids in `fail`."""

    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.fail = fail
        self.calls: list[tuple[str, float, tuple]] = []
        self.running = self.most_running = 0

    def Generate(self, request, timeout=None, metadata=()):
        self.calls.append((request.request_id, timeout, tuple(metadata)))
        return self._events(request)

    async def _events(self, request):
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(0.01)
            if request.request_id in self.fail:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()
                )
            yield omni_pb2.GenerateEvent(text=omni_pb2.TextDelta(text="hi"))
            audio = omni_pb2.AudioStatus(outcome=omni_pb2.AUDIO_OUTCOME_COMPLETE)
            if omni_pb2.MODALITY_AUDIO in request.output_modalities:
                yield omni_pb2.GenerateEvent(
                    audio=omni_pb2.AudioChunk(pcm16=b"\0\0" * 441, sample_rate_hz=44100)
                )
            yield omni_pb2.GenerateEvent(
                finish=omni_pb2.Finish(
                    reason=common_pb2.FINISH_REASON_LENGTH,
                    usage=common_pb2.Usage(completion_tokens=4),
                    audio=audio,
                )
            )
        finally:
            self.running -= 1


def test_plan_orders_runs_by_kind_then_mode():
    assert list(plan(["text", "speech"], ["closed", "offline", "poisson"], [1, 4], [0.5])) == [
        ("closed", "text", "1"),
        ("closed", "text", "4"),
        ("offline", "text", "all"),
        ("poisson", "text", "0.5/s"),
        ("closed", "speech", "1"),
        ("closed", "speech", "4"),
        ("offline", "speech", "all"),
        ("poisson", "speech", "0.5/s"),
    ]


def test_closed_runs_send_at_least_the_concurrency_with_the_shapes_metadata():
    stub = FakeStub(fail={"load-text-1"})
    shape = RequestShape(max_tokens=4, timeout_s=7.0, metadata=(("authorization", "Bearer k"),))
    runs = list(plan(["text", "speech"], ["closed"], [1, 3]))
    summaries = asyncio.run(run_plan(stub, runs, 2, shape))
    assert [(s.kind, s.load, s.requests) for s in summaries] == [
        ("text", "1", 2),
        ("text", "3", 3),
        ("speech", "1", 2),
        ("speech", "3", 3),
    ]
    assert stub.most_running == 3
    # one unmeasured request per kind first, then the runs; every call with the shape's deadline and key
    assert [c[0] for c in stub.calls[:3]] == ["load-text-0", "load-speech-0", "load-text-0"]
    assert len(stub.calls) == 2 + 2 + 3 + 2 + 3
    assert {(c[1], c[2]) for c in stub.calls} == {(7.0, (("authorization", "Bearer k"),))}
    text1 = summaries[0]
    assert text1.errors == {"UNAVAILABLE": 1} and text1.ok == 1 and text1.tok_per_s > 0
    assert summaries[2].ttfa_ms["p50"] is not None and summaries[2].rtf["p50"] is not None


def test_finish_codes_say_why_a_request_does_not_count():
    fin = omni_pb2.Finish
    assert finish_code("text", None) == "NO_FINISH"
    assert finish_code("text", fin(reason=common_pb2.FINISH_REASON_ERROR)) == "FINISH_ERROR"
    assert finish_code("text", fin(reason=common_pb2.FINISH_REASON_STOP)) == "OK"
    partial = fin(
        reason=common_pb2.FINISH_REASON_STOP,
        audio=omni_pb2.AudioStatus(outcome=omni_pb2.AUDIO_OUTCOME_PARTIAL, code="UNAVAILABLE"),
    )
    assert finish_code("speech", partial) == "AUDIO_UNAVAILABLE"
    assert finish_code("text", partial) == "OK"


def test_an_aborted_answer_and_speech_with_no_audio_are_not_done():
    fin = omni_pb2.Finish
    assert finish_code("text", fin(reason=common_pb2.FINISH_REASON_ABORT)) == "FINISH_ABORT"
    none = fin(
        reason=common_pb2.FINISH_REASON_STOP, audio=omni_pb2.AudioStatus(outcome=omni_pb2.AUDIO_OUTCOME_NONE)
    )
    assert finish_code("speech", none) == "AUDIO_NONE"
    complete = fin(
        reason=common_pb2.FINISH_REASON_STOP,
        audio=omni_pb2.AudioStatus(outcome=omni_pb2.AUDIO_OUTCOME_COMPLETE),
    )
    assert finish_code("speech", complete) == "OK"


def test_vision_requests_send_an_image_before_the_text_and_ask_for_text():
    from omnistage.common.load_driver import make_request

    req = make_request("vision", 3, RequestShape(input_image_px=64))
    (image, text) = req.messages[0].parts
    assert (
        image.image.data.startswith(b"\x89PNG")
        and text.text
        and list(req.output_modalities) == [omni_pb2.MODALITY_TEXT]
    )
    assert (
        make_request("vision", 4, RequestShape(input_image_px=64)).messages[0].parts[0].image.data
        != image.image.data
    )


def test_a_mixed_run_cycles_the_kinds_and_judges_each_request_by_its_own():
    from omnistage.common.load_driver import MIXED, make_request

    shape = RequestShape(max_tokens=4, input_image_px=32)
    kinds = [make_request("mixed", i, shape) for i in range(8)]
    assert [r.request_id.split("-")[1] for r in kinds] == [*MIXED, *MIXED]
    stub = FakeStub()
    (summary,) = asyncio.run(run_plan(stub, list(plan(["mixed"], ["closed"], [4])), 8, shape))
    # one unmeasured request of every kind first; the speech requests' audio made them OK
    assert [c[0] for c in stub.calls[:4]] == [f"load-{k}-0" for k in MIXED]
    assert (summary.kind, summary.requests, summary.ok, summary.errors) == ("mixed", 8, 8, {})
    assert summary.ttfa_ms["p50"] is not None


def test_every_request_has_its_own_prompt_unless_one_is_given_or_asked_for():
    """Concurrent greedy answers to one prompt are the same tokens (a batch of them reads a
    fraction of a real batch's expert weights): each request gets its own tag by default."""
    from omnistage.common.load_driver import PROMPTS, make_request

    def text(i: int, shape: RequestShape) -> str:
        return make_request("text", i, shape).messages[0].parts[-1].text

    default = RequestShape()
    assert text(0, default).startswith(PROMPTS["text"]) and text(0, default) != text(1, default)
    assert text(7, default) == text(7, default)  # reproducible
    assert len({text(i, default) for i in range(64)}) == 64
    assert text(0, RequestShape(distinct_prompts=False)) == text(1, RequestShape(distinct_prompts=False))
    assert text(3, RequestShape(prompt="exactly this")) == "exactly this"
