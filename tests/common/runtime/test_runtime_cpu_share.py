"""The host's cores shared by the deployment's CPU model stages: each stage process takes its share as
torch threads (each TP rank one; the gateway and CUDA stages do not count) unless the environment's
OMP_NUM_THREADS says otherwise; a stage alone keeps every core."""

from __future__ import annotations

import pytest
from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.runtime import cpu_share
from omnistage.common.runtime.cpu_share import share_cpu_cores, threads_each


def _svc(name: str, kind: str, device: str = "cpu", tp_size: int = 1) -> ServiceConfig:
    gpus = tuple(range(tp_size)) if device == "cuda" else ()
    return ServiceConfig(name=name, kind=kind, device=device, gpus=gpus, tp_size=tp_size)


def _deploy(*services: ServiceConfig) -> DeployConfig:
    return DeployConfig(services={s.name: s for s in services})


TINY = _deploy(  # deploy/local-tiny.yaml's processes
    _svc("thinker", "thinker"),
    _svc("encoder", "encoder"),
    _svc("talker", "talker"),
    _svc("imagegen", "imagegen"),
    _svc("gateway", "gateway"),
)


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n: int) -> None:
        monkeypatch.setattr(cpu_share.os, "sched_getaffinity", lambda pid: set(range(n)))

    return set_cores


@pytest.fixture
def threads_set(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(cpu_share.torch, "set_num_threads", calls.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return calls


def test_the_cores_are_shared_by_every_cpu_model_stage_process(cores):
    cores(2)
    assert threads_each(TINY) == 1  # 4 model stages on 2 cores: one thread each, never 0
    cores(16)
    assert threads_each(TINY) == 4  # the gateway does not count
    assert threads_each(_deploy(_svc("thinker", "thinker", tp_size=2), _svc("talker", "talker"))) == 5
    assert threads_each(_deploy(_svc("encoder", "encoder"))) == 16  # alone: every core
    gpu_thinker = _deploy(_svc("thinker", "thinker", "cuda", tp_size=2), _svc("talker", "talker"))
    assert threads_each(gpu_thinker) == 16  # CUDA stages do not share the CPU's cores


def test_a_cpu_model_stage_takes_its_share_and_the_gateway_and_cuda_stages_keep_theirs(cores, threads_set):
    cores(8)
    assert share_cpu_cores(TINY, TINY.services["talker"]) == 2 and threads_set == [2]
    assert share_cpu_cores(TINY, TINY.services["gateway"]) is None
    cuda = _svc("thinker", "thinker", "cuda")
    assert share_cpu_cores(_deploy(cuda), cuda) is None
    assert threads_set == [2]


def test_the_environments_own_count_wins(cores, threads_set, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cores(8)
    assert share_cpu_cores(TINY, TINY.services["encoder"]) is None and threads_set == []
