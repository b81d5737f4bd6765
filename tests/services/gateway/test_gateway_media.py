"""Media parts through the gateway: the placeholder markup of the reference layout (sized by the
encoder's counts and accepted by the thinker's layout), one Encode call with the client's deadline,
refusals naming the part, and the leases of refs that never reached the thinker released."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from omnistage.common.checkpoint import write_tiny_checkpoint
from omnistage.common.runtime.errors import InvalidRequest, OmniError, StageUnavailable
from omnistage.common.transport import TransportContext, TransportOptions, encode
from omnistage.services.gateway.media import MediaStage
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.prompt import render
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.stages import StageError
from omnistage.services.gateway.validation import RequestLimits, plan_request
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.tokenizer import MingTokenizer
from omnistage.services.thinker.multimodal import MediaInputs
from omnistage.v1 import common_pb2, encoder_pb2, omni_pb2, thinker_pb2

HIDDEN = 256
DEPLOYED = {"thinker", "encoder"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming-gw"), seed=0)


@pytest.fixture
def producer():
    """The encoder's shm pool, in this process."""
    with TransportContext(TransportOptions(shm_pool_bytes=4 << 20)) as ctx:
        yield ctx


def leases(producer: TransportContext) -> int:
    pool = producer.shm_pool()
    pool.arena.reclaim()
    return pool.arena.active_leases


def encoded(
    kind: str, producer: TransportContext, ckpt_cfg: ThinkerConfig, grids=(), n: int = 0, timestamps=()
) -> encoder_pb2.EncodedItem:
    """What the encoder answers for one item (rows in shm)."""
    n = n or sum(t * h * w for t, h, w in grids)
    pid = {
        "image": ckpt_cfg.image_patch_token_id,
        "video": ckpt_cfg.video_patch_token_id,
        "audio": ckpt_cfg.audio_patch_token_id,
    }[kind]
    return encoder_pb2.EncodedItem(
        kind={"image": 1, "audio": 2, "video": 3}[kind],
        embeddings=encode(torch.randn(n, HIDDEN), transport=producer, force="shm"),
        num_tokens=n,
        placeholder_token_id=pid,
        merged_grids=[encoder_pb2.GridTHW(t=t, h=h, w=w) for t, h, w in grids],
        timestamps_s=list(timestamps),
    )


def user(*parts: omni_pb2.ContentPart) -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=list(parts))],
        sampling=common_pb2.SamplingParams(max_tokens=4),
    )


def text(t: str) -> omni_pb2.ContentPart:
    return omni_pb2.ContentPart(text=t)


def image(data: bytes = b"png") -> omni_pb2.ContentPart:
    return omni_pb2.ContentPart(image=omni_pb2.Media(data=data))


def audio(data: bytes = b"wav") -> omni_pb2.ContentPart:
    return omni_pb2.ContentPart(audio=omni_pb2.Media(data=data))


def video(data: bytes = b"mp4") -> omni_pb2.ContentPart:
    return omni_pb2.ContentPart(video=omni_pb2.Media(data=data))


# --- the prompt -----------------------------------------------------------------------------------


def test_the_reference_layout_sized_by_the_encoder(ckpt, producer):
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    plan = plan_request(
        user(text("Look:"), image(), image(), text("and"), video(), audio(), audio(), text("?")),
        DEPLOYED,
        "",
        RequestLimits(),
    )
    items = [
        encoded("image", producer, cfg, [(1, 2, 3)]),
        encoded("image", producer, cfg, [(1, 1, 2)]),
        encoded("video", producer, cfg, [(1, 2, 2), (1, 2, 2)], timestamps=[0.25, 1.25]),
        encoded("audio", producer, cfg, n=3),
        encoded("audio", producer, cfg, n=2),
    ]
    chat = plan.chat(items)
    human = render(chat).split("<role>HUMAN</role>")[1]
    assert human == (
        "Look:<image>" + "<imagePatch>" * 6 + "</image>\n\n<image>" + "<imagePatch>" * 2 + "</image>\n"
        "and<video><0.2 seconds><image>"
        + "<framePatch>" * 4
        + "</image><1.2 seconds><image>"
        + "<framePatch>" * 4
        + "</image></video>"
        "<audio>"
        + "<audioPatch>" * 3
        + "</audio>\n<audio>"
        + "<audioPatch>" * 2
        + "</audio>?<|role_end|><role>ASSISTANT</role>"
    )
    texts = [p.text for p in chat.pieces if p.WhichOneof("piece") == "text"]
    assert texts[1:] == ["Look:", "and", "?"]  # client text stays text; the markup is template
    # The thinker takes this prompt as it is: tokenized, its slots match the items one to one.
    tok = MingTokenizer(ckpt)
    ids = tok.encode_pieces([(p.WhichOneof("piece"), p.template or p.text) for p in chat.pieces])
    inputs = MediaInputs(cfg, torch.float32, TransportContext())
    forwarded = [
        thinker_pb2.MultimodalEmbedding(
            placeholder_token_id=i.placeholder_token_id, embeddings=i.embeddings, merged_grids=i.merged_grids
        )
        for i in items
    ]
    built = inputs.build(ids, forwarded)
    assert built.media.num_rows == 6 + 2 + 8 + 3 + 2 and built.positions is not None
    assert leases(producer) == 0  # the thinker's copy ended them


def test_a_system_message_takes_text_only():
    req = omni_pb2.GenerateRequest(
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_SYSTEM, parts=[image()]),
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[text("hi")]),
        ]
    )
    with pytest.raises(InvalidRequest, match=r"^messages\[0\]\.parts: a system message takes text only"):
        plan_request(req, DEPLOYED, "", RequestLimits())
    with pytest.raises(InvalidRequest, match=r"^messages\[0\]\.parts\[1\]\.audio\.data: empty"):
        plan_request(user(text("x"), audio(b"")), DEPLOYED, "", RequestLimits())
    with pytest.raises(InvalidRequest, match=r"^messages\[0\]\.parts\[0\]\.video: set data or path"):
        plan_request(user(omni_pb2.ContentPart(video=omni_pb2.Media())), DEPLOYED, "", RequestLimits())


# --- the servicer with a fake encoder and thinker --------------------------------------------------


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FakeEncoder:
    """Answers with shm refs from `producer`, or with `error`; remembers the requests and deadlines."""

    def __init__(self, producer, cfg, error: grpc.aio.AioRpcError | None = None) -> None:
        self.producer, self.cfg, self.fails_with = producer, cfg, error
        self.calls: list[tuple[encoder_pb2.EncodeRequest, float | None]] = []

    async def encode(self, request, timeout_s):
        self.calls.append((request, timeout_s))
        if self.fails_with is not None:
            raise self.fails_with
        kinds = {1: "image", 2: "audio", 3: "video"}
        out = []
        for item in request.items:
            kind = kinds[item.kind]
            if kind == "audio":
                out.append(encoded(kind, self.producer, self.cfg, n=3))
            else:
                out.append(
                    encoded(kind, self.producer, self.cfg, [(1, 2, 2)], timestamps=[0.0] * (kind == "video"))
                )
        return encoder_pb2.EncodeResponse(items=out, spatial_merge_size=2)


class FakeThinker:
    """`started` and a finish, or an error before `started`; remembers the requests."""

    def __init__(self, error: grpc.aio.AioRpcError | None = None) -> None:
        self.fails_with, self.calls = error, []

    def error(self, exc: grpc.aio.AioRpcError) -> StageError:  # as ThinkerClient.error of a stage that is up
        return StageError("thinker", exc)

    async def generate(self, request_id, prompt, sampling, timeout_s, multimodal=None):
        self.calls.append((prompt, list(multimodal or [])))
        if self.fails_with is not None:
            raise self.fails_with
        yield thinker_pb2.ThinkerEvent(started=thinker_pb2.Started(engine_request_id="e" * 32))
        yield thinker_pb2.ThinkerEvent(finish=thinker_pb2.ThinkerFinish(reason=common_pb2.FINISH_REASON_STOP))


class Context:
    def time_remaining(self):
        return 12.5


def run_gateway(thinker, encoder, request, producer, media_dir=""):
    media = (
        MediaStage(encoder, TransportContext(), max_request_bytes=1 << 20) if encoder is not None else None
    )
    servicer = OmniServicer(
        Pipeline(
            thinker,
            DEPLOYED,
            max_concurrent_requests=4,
            media=media,
            media_dir=media_dir,
            limits=RequestLimits(),
            system_prompt="",
        )
    )

    async def collect():
        return [e async for e in servicer.Generate(request, Context())]

    return asyncio.run(collect())


def test_media_is_encoded_once_with_the_deadline_and_the_refs_go_to_the_thinker_unchanged(
    ckpt, producer, tmp_path
):
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    (tmp_path / "cat.png").write_bytes(b"file-bytes")
    encoder, thinker = FakeEncoder(producer, cfg), FakeThinker()
    request = user(text("What?"), omni_pb2.ContentPart(image=omni_pb2.Media(path="cat.png")), audio())
    events = run_gateway(thinker, encoder, request, producer, media_dir=str(tmp_path))
    assert [e.WhichOneof("event") for e in events] == ["finish"]
    ((sent, deadline),) = encoder.calls
    assert [i.data for i in sent.items] == [b"file-bytes", b"wav"] and deadline == 12.5
    ((prompt, multimodal),) = thinker.calls
    assert [m.embeddings.shm.lease_id for m in multimodal] == [r.embeddings.shm.lease_id for r in multimodal]
    assert render(prompt).count("<imagePatch>") == 4 and render(prompt).count("<audioPatch>") == 3
    assert leases(producer) == 2  # handed over at `started`: the thinker ends them, not the gateway


@pytest.mark.parametrize(
    "thinker_error, code, needle",
    [
        (
            rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"),
            grpc.StatusCode.UNAVAILABLE,
            "thinker: connection refused",
        ),
        (
            rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt: too long"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "thinker: prompt: too long",
        ),
        (
            rpc_error(
                grpc.StatusCode.INVALID_ARGUMENT,
                "multimodal: 7 embedding rows leave no room to generate (max_model_len 7)",
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "thinker: multimodal: 7 embedding rows leave no room to generate (max_model_len 7)",
        ),
    ],
    ids=["thinker-unreachable", "thinker-refuses", "media-over-max-model-len"],
)
def test_refs_that_never_reach_the_thinker_are_released(ckpt, producer, thinker_error, code, needle):
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    with pytest.raises(OmniError) as err:
        run_gateway(
            FakeThinker(thinker_error),
            FakeEncoder(producer, cfg),
            user(image(), audio(), text("?")),
            producer,
        )
    assert err.value.code == code and needle in str(err.value), str(err.value)
    assert leases(producer) == 0


def test_an_encoder_refusal_names_the_part(ckpt, producer):
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    bad = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "items[1] (image): cannot decode the image")
    thinker = FakeThinker()
    with pytest.raises(OmniError) as err:
        run_gateway(
            thinker, FakeEncoder(producer, cfg, bad), user(text("a"), audio(), text("b"), image()), producer
        )
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(err.value) == "encoder: messages[0].parts[3].image: cannot decode the image"
    assert not thinker.calls


def test_media_needs_an_encoder(ckpt, producer, tmp_path):
    with pytest.raises(
        StageUnavailable, match=r"^messages\[0\]\.parts\[1\]\.image: the 'encoder' stage is not available"
    ):
        run_gateway(FakeThinker(), None, user(text("a"), image()), producer)
    (tmp_path / "big.wav").write_bytes(b"x" * (2 << 20))
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    request = user(omni_pb2.ContentPart(audio=omni_pb2.Media(path="big.wav")))
    with pytest.raises(
        InvalidRequest, match=r"^messages\[0\]\.parts\[0\]\.audio\.path: the file has 2097152 bytes"
    ):
        run_gateway(FakeThinker(), FakeEncoder(producer, cfg), request, producer, media_dir=str(tmp_path))
    request = user(*[audio(b"x" * (400 << 10))] * 3)  # each fits, together they do not
    with pytest.raises(InvalidRequest, match=r"^messages: the media parts hold 1228800 bytes, more than the"):
        run_gateway(FakeThinker(), FakeEncoder(producer, cfg), request, producer)


def test_a_converse_turns_pcm_goes_to_the_encoder_as_int16_samples(ckpt, producer):
    """No WAV between the client's PCM16 and the encoder: the samples as they came, at their rate."""
    from omnistage.services.gateway.validation import MediaPart
    from omnistage.v1 import tensor_pb2

    encoder = FakeEncoder(producer, ThinkerConfig.from_checkpoint(ckpt))
    stage = MediaStage(encoder, TransportContext(), max_request_bytes=1 << 20)
    pcm = b"\x01\x00\xff\x7f" * 100
    part = MediaPart("audio (turn 0)", "audio", omni_pb2.Media(data=pcm), pcm_rate_hz=24000)
    items = asyncio.run(stage.encode("c1", [part], {}, 5.0))
    ((request, _),) = encoder.calls
    (sent,) = request.items
    assert (sent.WhichOneof("source"), sent.sample_rate_hz) == ("samples", 24000)
    samples = sent.samples
    assert (samples.dtype, list(samples.shape), samples.inline_data) == (tensor_pb2.DTYPE_INT16, [200], pcm)
    stage.release(items)
