"""Output stages behind one interface.

Every kind of the stage table (common/stages.py) that makes an output beside text (its row's `outputs`)
has its adapter in this package, in the module named by the kind (`talker.py`, `imagegen.py`): its
`OUTPUT_STAGE` class says what the stage does for a request (`plan`), how it is admitted (its gate,
`joins`), how a replica is brought in (`on_up`: its Describe, a warm-up), and what it does with the
answer — during it (`during`: a sink the thinker's text feeds, the speech) or after it (`after`: the
image from the thinker's hidden states). The gateway's start-up builds one per deployed kind by
iterating the table's rows; adding an output stage is one row, one adapter module here, one client.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.services.gateway.replicas import Replicas
from omnistage.services.gateway.stages import StageClient
from omnistage.services.gateway.validation import PlannedRequest
from omnistage.v1 import omni_pb2

T = TypeVar("T")


class AnswerSink(Protocol):
    """What an output stage that runs during the answer is given of it, in order."""

    def started(self) -> None:
        """The thinker took the request: its text will come."""

    async def text(self, text: str) -> None:
        """A piece of the answer's text, before it goes to the client."""

    async def end(self, finish: omni_pb2.GenerateEvent) -> None:
        """The text is over (its Finish, not sent yet): finish this stage's part and say how it went in
        the Finish."""


class Startup(Protocol):
    """What an output stage's `on_up` may ask of the gateway being started (startup.py)."""

    async def needs_thinker(self, what: str) -> None:
        """Wait (bounded) until the thinker is admitted; RuntimeError naming `what` otherwise."""

    async def generate(
        self, request: omni_pb2.GenerateRequest, timeout_s: float
    ) -> list[omni_pb2.GenerateEvent]:
        """One request through the path clients take (a warm-up)."""

    def resize(self) -> None:
        """The gates follow the replicas' capacities (one was read)."""

    async def through(self, client: StageClient, warm_up: Awaitable[T]) -> T:
        """Run `warm_up` through `client`, let through although the replica is not admitted yet."""


class OutputStage:
    """The gateway's side of one output stage kind (see the module doc); subclasses set the class
    attributes and override what they do."""

    kind: ClassVar[str] = ""  # its row of the stage table
    client_class: ClassVar[type[StageClient]] = StageClient  # one per replica (the kind's services)
    after_answer: ClassVar[bool] = False  # runs after the text answer (else during it)
    thinker_calls: ClassVar[int] = 0  # thinker calls of its own that read the request's media
    joins: ClassVar[bool] = False  # its slot is taken when free, never holding the text (no refusal)

    replicas: Replicas

    @classmethod
    def from_deploy(
        cls, cfg: DeployConfig, svc: ServiceConfig, clients: Sequence[StageClient]
    ) -> OutputStage:
        """The stage from the deploy file: its replicas' clients and the limits the file gives."""
        raise NotImplementedError

    def plan(self, request: omni_pb2.GenerateRequest, planned: PlannedRequest) -> Any:
        """This request's options for the stage (INVALID_ARGUMENT naming the field when wrong)."""
        return None

    def capacity(self) -> tuple[int, int | None]:
        """(requests at once, requests waiting; None: the gateway's admission_max_waiting) its replicas
        that are up take: its admission gate's size (0 at once: not limited here)."""
        return 0, None

    async def on_up(self, client: StageClient, startup: Startup) -> None:
        """A replica says SERVING: read its limits and send it a warm-up (an error keeps it out)."""

    def during(self, run: Any, options: Any, answer: Any) -> AnswerSink:
        """The sink this stage's part of `answer` is fed through (stages that run during the answer)."""
        raise NotImplementedError

    async def after(
        self, answer: Any, options: Any, finish: omni_pb2.GenerateEvent
    ) -> omni_pb2.GenerateEvent:
        """Its part after the answer (whose Finish is `finish`, not sent yet); the Finish to send."""
        raise NotImplementedError

    async def close(self) -> None:
        for client in self.replicas.clients:
            await client.close()


def output_stage(kind: str) -> type[OutputStage]:
    """The adapter of a stage kind that makes an output: `outputs/<kind>.py`'s OUTPUT_STAGE."""
    return importlib.import_module(f"{__name__}.{kind}").OUTPUT_STAGE
