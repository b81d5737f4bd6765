"""Media.path: refused unless gateway.media_dir is set, and only inside it (symlinks resolved)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from omnistage.common.config import config_from_dict
from omnistage.common.runtime.errors import InvalidRequest, PermissionDenied
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.services.gateway.media_path import check_media_paths, resolve_media_path
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import omni_pb2, omni_pb2_grpc

from tests.common.runtime.synthetic_stage import free_port

WHERE = "messages[0].parts[1].image.path"


@pytest.fixture
def media(tmp_path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(b"\x89PNG")
    (tmp_path / "secret.txt").write_text("not for clients")
    (root / "escape.png").symlink_to(tmp_path / "secret.txt")
    (root / "sub").mkdir()
    return root


def image_request(path: str) -> omni_pb2.GenerateRequest:
    parts = [
        omni_pb2.ContentPart(text="What is this?"),
        omni_pb2.ContentPart(image=omni_pb2.Media(path=path)),
    ]
    return omni_pb2.GenerateRequest(messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=parts)])


def test_paths_inside_the_media_dir_resolve(media):
    assert resolve_media_path("cat.png", str(media), WHERE) == media / "cat.png"
    assert resolve_media_path(str(media / "cat.png"), str(media), WHERE) == media / "cat.png"
    assert resolve_media_path("sub/../cat.png", str(media), WHERE) == media / "cat.png"
    assert check_media_paths(image_request("cat.png"), str(media)) == {WHERE: media / "cat.png"}


@pytest.mark.parametrize(
    ("path", "error", "needle"),
    [
        ("../secret.txt", PermissionDenied, "'../secret.txt' is outside the gateway's media directory"),
        ("escape.png", PermissionDenied, "is outside the gateway's media directory"),  # a symlink out
        ("/etc/passwd", PermissionDenied, "is outside"),
        ("missing.png", InvalidRequest, "is not a file in the gateway's media directory"),
        ("sub", InvalidRequest, "is not a file"),
        ("a\0b", InvalidRequest, "without NUL characters"),
    ],
)
def test_paths_outside_or_missing_are_refused_naming_the_field(media, path, error, needle):
    with pytest.raises(error) as exc:
        check_media_paths(image_request(path), str(media))
    assert str(exc.value).startswith(f"{WHERE}: ") and needle in str(exc.value)


def test_without_a_media_dir_every_path_is_refused(media):
    with pytest.raises(
        PermissionDenied,
        match=rf"^{WHERE.replace('[', '.').replace(']', '.')}: this gateway accepts no file paths",
    ):
        check_media_paths(image_request(str(media / "cat.png")), "")


async def _status(tmp_path, media_dir: str, request: omni_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    """The status of `request` through the gateway's servicer (no stages deployed)."""
    cfg = config_from_dict({"services": {"gateway": {"kind": "gateway", "port": free_port()}}})
    rt = ServiceRuntime(cfg, cfg.service("gateway"), 0, run_dir=tmp_path)
    await rt.start()
    servicer = OmniServicer(
        Pipeline(
            None,
            set(),
            max_concurrent_requests=4,
            limits=RequestLimits(max_prompt_chars=1000),
            system_prompt="",
            media_dir=media_dir,
        )
    )
    rt.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, servicer, "omnistage.v1.Omni")
    rt.set_serving()
    try:
        async with grpc.aio.insecure_channel(rt.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [e async for e in omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=10)]
            return err.value.code(), err.value.details()
    finally:
        rt.request_stop()
        await asyncio.wait_for(rt.serve_until_stopped(), 10)


def test_the_path_check_comes_before_the_missing_encoder(tmp_path, media):
    """Through the gateway's servicer: PERMISSION_DENIED for a bad path, FAILED_PRECONDITION (no encoder) for a good one."""
    code, details = asyncio.run(_status(tmp_path, "", image_request("cat.png")))
    assert code == grpc.StatusCode.PERMISSION_DENIED and details.startswith(f"{WHERE}: ")
    code, details = asyncio.run(_status(tmp_path, str(media), image_request("escape.png")))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "outside" in details
    code, details = asyncio.run(_status(tmp_path, str(media), image_request("cat.png")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "'encoder' stage" in details


def test_the_counts_come_before_the_path_check(tmp_path, media):
    """Too many messages is refused before any message is looked at (the path check walks every part)."""
    request = image_request("cat.png")
    request.messages.extend([request.messages[0]] * RequestLimits().max_messages)
    code, details = asyncio.run(_status(tmp_path, "", request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"messages: {RequestLimits().max_messages + 1} messages, at most 256 (max_messages)"


def test_paths_are_resolved_off_the_event_loop(tmp_path, media, monkeypatch):
    """Resolving every path (realpath, stat: 16 k of them at the bounds) is a worker thread's job."""
    import threading

    from omnistage.services.gateway import media_path

    threads = []
    real = media_path.check_media_paths
    monkeypatch.setattr(
        media_path,
        "check_media_paths",
        lambda request, media_dir: threads.append(threading.current_thread()) or real(request, media_dir),
    )
    code, _ = asyncio.run(_status(tmp_path, str(media), image_request("cat.png")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # resolved, then: no encoder
    assert threads and threads[0] is not threading.main_thread()
