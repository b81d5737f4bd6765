"""The one table of stage kinds: what runs each kind and what the deployment gets from it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """One kind of service process."""

    kind: str
    # `python -m <module> --config F --service NAME [--rank R]` runs one process of this kind.
    module: str
    # Loads `model.checkpoint` (preflight checks it exists before anything starts).
    loads_checkpoint: bool = True
    # The public capability this kind brings (health names `omnistage.v1.Omni.<capability>`), and the
    # other kinds it needs for it; "" for none (the gateway).
    capability: str = ""
    needs: tuple[str, ...] = ()
    # Request parts the gateway sends to this stage (Omni `Part.content` names: image, audio, video).
    media_inputs: tuple[str, ...] = ()
    # Output modalities this stage makes beside text (`omnistage.v1.Modality` names without MODALITY_).
    outputs: tuple[str, ...] = ()


STAGES: tuple[Stage, ...] = (
    Stage("gateway", "omnistage.services.gateway", loads_checkpoint=False),
    Stage("thinker", "omnistage.services.thinker", capability="text"),
    Stage(
        "encoder",
        "omnistage.services.encoder",
        capability="media_input",
        needs=("thinker",),
        media_inputs=("image", "audio", "video"),
    ),
    Stage("talker", "omnistage.services.talker", capability="speech", needs=("thinker",), outputs=("audio",)),
    Stage(
        "imagegen",
        "omnistage.services.imagegen",
        capability="image_output",
        needs=("thinker",),
        outputs=("image",),
    ),
)

# Every `services.<name>.kind` a deploy file may give, in table order.
SERVICE_KINDS: tuple[str, ...] = tuple(s.kind for s in STAGES)
# The kinds behind the gateway that hold a model (the gateway's admission gates and refusal labels).
MODEL_KINDS: tuple[str, ...] = tuple(s.kind for s in STAGES if s.loads_checkpoint)
# Kind → the module that runs it (the launcher's table; tests substitute entries).
MODULES: dict[str, str] = {s.kind: s.module for s in STAGES}
# Public capability → the kinds it needs, all deployed and admitted before the gateway serves it.
CAPABILITIES: dict[str, tuple[str, ...]] = {s.capability: (*s.needs, s.kind) for s in STAGES if s.capability}
# Request part → the kind that encodes it; output modality → the kind that makes it.
MEDIA_INPUT_KIND: dict[str, str] = {m: s.kind for s in STAGES for m in s.media_inputs}
OUTPUT_KIND: dict[str, str] = {o: s.kind for s in STAGES for o in s.outputs}
