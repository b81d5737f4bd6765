"""EncoderEngine in process: every kind encodes to shm refs equal to the towers' output; bad items fail
the whole request with INVALID_ARGUMENT naming the item, leave no lease behind and stop nobody else."""

from __future__ import annotations

import asyncio
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.transport import decode
from omnistage.services.encoder.items import MediaItem, prepare_item
from omnistage.services.encoder.runner import vision_forward
from PIL import Image

from tests.services.encoder.engine_helpers import SMALL, leases, run_engine
from tests.services.encoder.media_samples import audio_file, image_bytes, video_file, wav_bytes


def _png_of_size(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def _wav_with_bad_utf8_title() -> bytes:
    """A valid WAV whose LIST/INFO title is not UTF-8 (found by fuzzing: metadata decoding raised)."""
    wav = wav_bytes(0.5)
    info = b"INFO" + b"INAM" + (4).to_bytes(4, "little") + b"\xff\xfe\xfd\x00"
    at = wav.find(b"data")
    out = wav[:at] + b"LIST" + len(info).to_bytes(4, "little") + info + wav[at:]
    return out[:4] + (len(out) - 8).to_bytes(4, "little") + out[8:]


def _mkv_with_unknown_codec() -> bytes:
    """A Matroska video whose codec id is unknown to FFmpeg (found by fuzzing: no codec context)."""
    return video_file(12, fmt="matroska").replace(b"V_MPEG4/ISO/ASP", b"V_XXXXX/ISO/ASP")


def _solid_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


GOOD = {
    "image": MediaItem("image", data=image_bytes(300, 200)),
    "audio_flac": MediaItem("audio", data=audio_file("flac", 1.3, rate=22050)),
    "audio_ogg": MediaItem("audio", data=audio_file("ogg", 0.8)),
    "audio_samples": MediaItem(
        "audio", samples=np.sin(np.arange(8000) / 7).astype(np.float32), sample_rate_hz=8000
    ),
    "video_file": MediaItem("video", data=video_file(25, fps=10)),
    "video_frames": MediaItem("video", frames=tuple(image_bytes(80, 60, seed=i) for i in range(3)), fps=4.0),
}


def test_undecodable_metadata_is_not_an_error(tiny_encoders):
    async def body(engine):
        (out,) = await engine.encode([MediaItem("audio", data=_wav_with_bad_utf8_title())])
        return decode(out.ref, transport=engine.transport).shape[0], out.duration_s

    assert run_engine(tiny_encoders, body) == (13, 0.5)


def test_every_kind_encodes_to_shm_refs_that_decode_to_the_tower_output(tiny_encoders):
    names = list(GOOD)

    async def body(engine):
        outputs = await engine.encode([GOOD[n] for n in names[:4]])
        outputs += await engine.encode([GOOD[n] for n in names[4:]])
        rows = [decode(o.ref, transport=engine.transport) for o in outputs]
        return outputs, rows, leases(engine)

    outputs, rows, after = run_engine(tiny_encoders, body)
    ph = tiny_encoders.config.placeholders
    for name, out, got in zip(names, outputs, rows, strict=True):
        item = GOOD[name]
        assert out.ref.WhichOneof("payload") == "shm", name
        x = prepare_item(item, _limits(tiny_encoders))
        if item.kind == "audio":
            want = tiny_encoders.audio.encode_items([x.mel])[0]
            assert out.placeholder_token_id == ph.audio_patch and out.merged_grids == ()
        else:
            want = vision_forward(tiny_encoders, [x.frames])[0]
            t, h, w = x.grid
            assert out.merged_grids == ((1, h // 2, w // 2),) * t
            assert out.placeholder_token_id == (ph.image_patch if item.kind == "image" else ph.video_patch)
        assert got.shape == (out.num_tokens, 256) and torch.allclose(got, want, atol=1e-6), name
    assert after == (0, 0)  # decoding with copy=True released every lease


def _limits(models):
    from omnistage.services.encoder.items import ItemLimits

    return ItemLimits.of(SMALL, models.config)


def test_item_details_grids_timestamps_and_durations(tiny_encoders):
    async def body(engine):
        return await engine.encode(
            [GOOD["image"], GOOD["video_file"], GOOD["video_frames"], GOOD["audio_flac"]]
        )

    image, video, frames, audio = run_engine(tiny_encoders, body)
    assert image.resized == (192, 288) and image.num_tokens == 192 * 288 // 1024 and image.timestamps_s == ()
    # 25 frames at 10 fps: 2 fps gives 5 → 4 frames (0, 8, 16, 24) → patches at 0.4 s and 2.0 s.
    assert video.timestamps_s == pytest.approx((0.4, 2.0)) and video.duration_s == pytest.approx(2.4)
    assert len(video.merged_grids) == 2
    # 3 frames at 4 fps → 4 (last repeated): 0, .25, .5, .75 s → patches at 0.125 and 0.625 s.
    assert frames.timestamps_s == pytest.approx((0.125, 0.625)) and len(frames.merged_grids) == 2
    assert audio.duration_s == pytest.approx(1.3) and audio.num_tokens == 33  # 130 frames → 65 → 33


BAD = {
    "corrupt image": (MediaItem("image", data=b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4), "image"),
    "truncated image": (MediaItem("image", data=image_bytes(64, 64)[:400]), "truncated"),
    "zero-size image": (MediaItem("image", data=_png_of_size(0, 16)), "zero-size image (0x16)"),
    "image above the pixel bound": (
        MediaItem("image", data=_solid_png(2001, 2000)),
        "exceeds the limit of 4000000",
    ),
    "image aspect above 200": (MediaItem("image", data=_solid_png(2010, 10)), "aspect ratio 201.0"),
    "unsupported image format": (
        MediaItem("image", data=b"just some text, not a picture"),
        "not a supported image format",
    ),
    "empty image": (MediaItem("image", data=b""), "empty image data"),
    "corrupt audio": (
        MediaItem("audio", data=bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8))),
        "not a decodable audio file",
    ),
    "truncated audio": (MediaItem("audio", data=wav_bytes(2.0)[:20000]), "truncated audio"),
    "audio over the limit": (
        MediaItem("audio", data=wav_bytes(3.5)),
        "the limit is 3 s (encoder.max_audio_seconds)",
    ),
    "unsupported audio format": (
        MediaItem("audio", data=audio_file("adts", 1.0)),
        "unsupported audio format 'aac'",
    ),
    "an image as audio": (MediaItem("audio", data=image_bytes(32, 32)), "unsupported audio format"),
    "samples without a rate": (
        MediaItem("audio", samples=np.zeros(1000, np.float32)),
        "sample_rate_hz must be > 0",
    ),
    "samples with NaN": (
        MediaItem("audio", samples=np.full(1000, np.nan, np.float32), sample_rate_hz=16000),
        "NaN",
    ),
    "samples over the limit": (
        MediaItem("audio", samples=np.zeros(16000 * 4, np.float32), sample_rate_hz=16000),
        "the limit is 3 s (encoder.max_audio_seconds)",
    ),
    "corrupt video": (MediaItem("video", data=b"\x00\x00\x00\x18ftypmp42" + bytes(3000)), "video"),
    "truncated video": (MediaItem("video", data=video_file(20)[:1400]), "not a decodable video file"),
    "truncated video, index first": (
        MediaItem("video", data=video_file(20, faststart=True)[:1900]),
        "truncated video: the container lists 20 frames",
    ),
    "video with an unknown codec": (
        MediaItem("video", data=_mkv_with_unknown_codec()),
        "unknown or unsupported codec",
    ),
    "one-frame video": (MediaItem("video", data=video_file(1)), "at least 2"),
    "video over the limit": (
        MediaItem("video", data=video_file(210, fps=10)),
        "the limit is 20 s (encoder.max_video_seconds)",
    ),
    "an image as video": (MediaItem("video", data=image_bytes(32, 32)), "image format, not a video"),
    "a corrupt frame": (MediaItem("video", frames=(image_bytes(32, 32), b"nope")), "frames.images[1]"),
    "too many frames": (
        MediaItem("video", frames=(image_bytes(32, 32),) * 17),
        "17 frames exceed the limit of 16",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_item_fails_the_request_naming_it_and_leaves_nothing_behind(case, tiny_encoders):
    item, reason = BAD[case]

    async def body(engine):
        with pytest.raises(InvalidRequest) as err:
            await engine.encode([GOOD["image"], item])
        after_failure = leases(engine)
        good = await engine.encode([GOOD["image"]])  # the engine keeps serving
        decode(good[0].ref, transport=engine.transport)
        return str(err.value), after_failure

    message, after = run_engine(tiny_encoders, body)
    assert message.startswith(f"items[1] ({item.kind}): "), message
    assert reason in message, message
    assert after == (0, 0)


def test_request_shape_errors(tiny_encoders):
    async def body(engine):
        with pytest.raises(
            InvalidRequest, match=r"items: 5 items exceed the limit of 4 \(encoder.max_items_per_request\)"
        ):
            await engine.encode([GOOD["image"]] * 5)
        with pytest.raises(InvalidRequest, match="at least one item"):
            await engine.encode([])

    run_engine(tiny_encoders, body)


def test_a_failure_after_some_refs_were_made_revokes_them(tiny_encoders, monkeypatch):
    """The hand-over of item 2 fails: item 1's slice is taken back, nothing stays leased."""

    async def body(engine):
        real = engine._ref
        calls = []

        def failing(t, host, cuda):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("copy failed")
            return real(t, host, cuda)

        monkeypatch.setattr(engine, "_ref", failing)
        with pytest.raises(RuntimeError, match="copy failed"):
            await engine.encode([GOOD["image"], GOOD["audio_flac"]])
        return leases(engine)

    assert run_engine(tiny_encoders, body) == (0, 0)


def test_a_remote_consumer_gets_inline_bytes(tiny_encoders):
    async def body(engine):
        (out,) = await engine.encode([GOOD["image"]], consumer_host_id="another-host:boot")
        return out.ref.WhichOneof("payload"), leases(engine)

    assert run_engine(tiny_encoders, body) == ("inline_data", (0, 0))


def test_cancelled_request_leaves_no_lease(tiny_encoders):
    async def body(engine):
        task = asyncio.ensure_future(engine.encode([GOOD["image"], GOOD["audio_flac"]]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # let the device thread finish what it had started
        return leases(engine)

    assert run_engine(tiny_encoders, body) == (0, 0)
