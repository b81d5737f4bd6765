"""Whether an answer counts as done: the one definition of goodput's "good", shared by the gateway's
goodput counter (services/gateway/request_metrics.py) and `omnistage bench` / the load harness
(load_driver.py), so the server and the client never disagree about the same answer.

An answer is done when its stream carried a finish that is neither ERROR nor ABORT and, when speech
was asked for, that speech came out complete: a spoken request is good only with its audio.
"""

from __future__ import annotations

from omnistage.v1 import common_pb2, omni_pb2

OK = "OK"
_FAILED_REASONS = (common_pb2.FINISH_REASON_ERROR, common_pb2.FINISH_REASON_ABORT)


def answer_code(finish: omni_pb2.Finish | None, *, spoken: bool) -> str:
    """ "OK", or why the answer is not done: NO_FINISH, FINISH_ERROR, FINISH_ABORT, or AUDIO_<code> (the
    AudioStatus code, else its outcome: AUDIO_NONE, AUDIO_PARTIAL) for speech that is not complete."""
    if finish is None:
        return "NO_FINISH"
    if finish.reason in _FAILED_REASONS:
        return common_pb2.FinishReason.Name(finish.reason).replace("_REASON", "")
    if spoken and finish.audio.outcome != omni_pb2.AUDIO_OUTCOME_COMPLETE:
        return f"AUDIO_{finish.audio.code or omni_pb2.AudioOutcome.Name(finish.audio.outcome).split('_')[-1]}"
    return OK
