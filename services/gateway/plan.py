"""A checked Generate request becomes a RequestPlan: the stages it passes, in order, and what each
output stage makes of it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistage.common.runtime.errors import StageUnavailable
from omnistage.services.gateway import media_path
from omnistage.services.gateway.validation import PlannedRequest, RequestLimits, check_counts, plan_request
from omnistage.v1 import omni_pb2


@dataclass(frozen=True)
class PlannedOutput:
    """One output stage's part of a request: its kind (its row of the stage table), the modality it
    makes, its options for this request (a VoiceChoice, an ImagePlan), and when it runs: during the
    text answer (fed by it), or after it (the image: the thinker's hidden states, then its stage)."""

    kind: str
    modality: int
    options: Any = None
    after_answer: bool = False
    thinker_calls: int = 0  # thinker calls of its own that read the request's media


@dataclass(frozen=True)
class RequestPlan:
    """A checked Generate request: what it runs, in which order."""

    request: PlannedRequest
    paths: dict[str, Path]  # media_dir files of its `Media.path` parts, by field path
    arrived_at: float
    outputs: tuple[PlannedOutput, ...] = field(default=())

    def output(self, kind: str) -> PlannedOutput | None:
        return next((o for o in self.outputs if o.kind == kind), None)

    @property
    def answers(self) -> bool:
        """A text answer streams (first): asked for, or made for an output that runs during it."""
        after = {o.modality for o in self.outputs if o.after_answer}
        return bool(self.request.outputs - after)

    @property
    def thinker_calls(self) -> int:
        """The thinker calls that read the media: the answer's, and those of the outputs after it."""
        return int(self.answers) + sum(o.thinker_calls for o in self.outputs if o.after_answer)

    @property
    def stages(self) -> list[str]:
        """The stages it passes, in order (its admission judges the gate of each)."""
        during = [o.kind for o in self.outputs if not o.after_answer]
        after = [o.kind for o in self.outputs if o.after_answer]
        return [*(["encoder"] if self.request.media else []), "thinker", *during, *after]


@dataclass(frozen=True)
class Planner:
    """What a request is checked against: the deployed stages, the gateway's limits, and the stages
    that are there to run it (None / absent: not deployed, or not reached at start-up)."""

    deployed: set[str]
    limits: RequestLimits
    system_prompt: str
    media_dir: str
    has_thinker: bool
    has_encoder: bool
    outputs: dict[int, Any]  # modality → the output stage that makes it (outputs/__init__.py)
    output_kinds: dict[int, str]  # modality → the stage kind the table names for it

    async def plan(self, request: omni_pb2.GenerateRequest, arrived_at: float) -> RequestPlan:
        """Check the request (counts first, then file paths, then the rest) against the deployed stages."""
        check_counts(request, self.limits)  # before any per-message work
        # A file path is a permission question, asked next; resolving thousands of them (realpath,
        # stat) is file-system work for a worker thread, not the event loop (without a media_dir the
        # first path is refused at once).
        paths = (
            await asyncio.to_thread(media_path.check_media_paths, request, self.media_dir)
            if self.media_dir
            else media_path.check_media_paths(request, self.media_dir)
        )
        planned = plan_request(
            request, self.deployed, self.system_prompt, self.limits, output_kinds=self.output_kinds
        )
        outputs = tuple(
            self._output(request, planned, m) for m in sorted(planned.outputs) if m in self.output_kinds
        )
        if not self.has_thinker:
            raise StageUnavailable("the 'thinker' stage is not available (gateway started degraded)")
        if planned.media and not self.has_encoder:
            raise StageUnavailable(
                f"{planned.media[0].where}: the 'encoder' stage is not available (gateway started degraded)"
            )
        return RequestPlan(planned, paths, arrived_at, outputs)

    def _output(
        self, request: omni_pb2.GenerateRequest, planned: PlannedRequest, modality: int
    ) -> PlannedOutput:
        stage = self.outputs.get(modality)
        if stage is None:
            raise StageUnavailable(
                f"output_modalities: {omni_pb2.Modality.Name(modality)} needs the "
                f"'{self.output_kinds[modality]}' stage, which is not available (gateway started degraded)"
            )
        return PlannedOutput(
            stage.kind, modality, stage.plan(request, planned), stage.after_answer, stage.thinker_calls
        )
