"""The real-size deploy files (deploy/h200x4.yaml, deploy/h200x2.yaml; deploy/h100x4.yaml on 80 GB cards) pass `omnistage serve --check`
(the config, the per-GPU memory ledger, the checkpoint, secrets and ports: everything `serve` checks
before it starts anything) on H200s with the config-only Ming-flash checkpoint and dummy weights;
every stage's budget holds its weights at the release's sizes (built on meta), and an 80 GB GPU is
refused by the ledger before anything starts."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from omnistage.common.checkpoint.config_only import write_config_checkpoint
from omnistage.common.config import load_config
from omnistage.common.launcher import launch
from omnistage.common.preflight import planned_ports
from omnistage.services.encoder.models.audio import AudioEncoder
from omnistage.services.encoder.models.config import EncoderModelConfig
from omnistage.services.encoder.models.vision import VisionEncoder
from omnistage.services.imagegen.models.config import ImageGenModelConfig
from omnistage.services.imagegen.models.connector import ConditionEncoder
from omnistage.services.imagegen.models.dit import ZImageDiT
from omnistage.services.imagegen.models.vae import AutoencoderKL
from omnistage.services.talker.models.audio_vae import AudioVAE
from omnistage.services.talker.models.config import TalkerModelConfig
from omnistage.services.talker.models.talker_lm import TalkerModel
from omnistage.services.thinker.models.bailing_moe_v2 import BailingMoeV2ForCausalLM
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.layers.parallel import TPGroup

from load_tests.chaos_launch import free_port_block, free_ports

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
H200, H100 = 143771 * 2**20, 80 * 10**9
H100_HBM3 = 81559 * 2**20  # what an "NVIDIA H100 80GB HBM3" reports
REAL_SIZE = {DEPLOY / "h200x4.yaml": 4, DEPLOY / "h200x2.yaml": 2, DEPLOY / "h100x4.yaml": 4}
REPLICAS = {
    DEPLOY / "h200x4.yaml": 2,
    DEPLOY / "h200x2.yaml": 1,
    DEPLOY / "h100x4.yaml": 2,
}  # talker, imagegen
CARD = {DEPLOY / "h200x4.yaml": H200, DEPLOY / "h200x2.yaml": H200, DEPLOY / "h100x4.yaml": H100_HBM3}
GIB = 2**30


@pytest.fixture(scope="module")
def ming_flash(tmp_path_factory) -> Path:
    return write_config_checkpoint(tmp_path_factory.mktemp("ming-flash"), "ming-flash")


def _free_port() -> int:
    return free_ports(1)[0]


def _port_overrides(path: Path) -> list[str]:
    """Every port the file binds moved to a free one, each its own (other pipelines may run on this host)."""
    cfg = load_config(path)
    out, used = [], set()
    for key, _, _ in planned_ports(cfg):
        if "+" in key:
            continue
        tp = cfg.service(key.split(".")[1]).tp_size if key.endswith("dist_port") else 1
        port = free_port_block(tp) if key.endswith("dist_port") else _free_port()
        while used & set(range(port, port + tp)):
            port = free_port_block(tp) if key.endswith("dist_port") else _free_port()
        used |= set(range(port, port + tp))
        out.append(f"{key}={port}")
    return out


def _check(path: Path, ckpt: Path, total: int) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    overrides = [
        f"model.checkpoint={ckpt}",
        "model.load_format=dummy",
        f"devices.total_bytes_override={total}",
        *_port_overrides(path),
    ]
    rc = launch(path, overrides, out=out, err=err, check_only=True)
    return rc, out.getvalue(), err.getvalue()


def _bf16_bytes(*modules: torch.nn.Module) -> int:
    return sum(p.numel() * 2 for m in modules for p in m.parameters())


def _release_weights(ckpt: Path, tp: int) -> dict[str, int]:
    """bf16 bytes of each stage's weights at the release's sizes (one thinker rank), built on meta."""
    enc, talk, img = (
        c.from_checkpoint(ckpt) for c in (EncoderModelConfig, TalkerModelConfig, ImageGenModelConfig)
    )
    with torch.device("meta"):
        return {
            "thinker": _bf16_bytes(
                BailingMoeV2ForCausalLM(ThinkerConfig.from_checkpoint(ckpt), TPGroup(0, tp))
            ),
            "encoder": _bf16_bytes(VisionEncoder(enc.vision), AudioEncoder(enc.audio)),
            "talker": _bf16_bytes(TalkerModel(talk), AudioVAE(talk.vae)),
            "imagegen": _bf16_bytes(
                ConditionEncoder(img.mlp, img.connector, img.thinker_hidden, img.dit.cap_feat_dim),
                ZImageDiT(img.dit),
                AutoencoderKL(img.vae),
            ),
        }


@pytest.mark.parametrize("path", list(REAL_SIZE), ids=lambda p: p.name)
def test_real_size_deploy_file_passes_the_pre_start_checks_on_its_cards(path, ming_flash):
    card = CARD[path]
    rc, out, err = _check(path, ming_flash, card)
    assert rc == 0, err
    tp = REAL_SIZE[path]
    cfg = load_config(path)
    thinker = cfg.service("thinker")
    assert (thinker.tp_size, thinker.gpus) == (tp, tuple(range(tp)))
    for gpu in range(tp):  # the ledger's table: every GPU carries a thinker rank and has headroom
        assert f"cuda:{gpu}  thinker (rank {gpu})" in out and f"cuda:{gpu}  headroom" in out
    assert "nothing started" in out
    weights = _release_weights(ming_flash, tp)
    assert 47 * GIB < weights["thinker"] < 49 * GIB if tp == 4 else 95 * GIB < weights["thinker"] < 97 * GIB
    assert len(cfg.services_of("talker")) == len(cfg.services_of("imagegen")) == REPLICAS[path]
    for svc in cfg.services.values():  # each budget holds its weights with room for KV cache / activations
        if svc.kind == "gateway":
            continue
        w = weights[svc.kind]
        assert svc.device == "cuda" and svc.gpus[0] < tp
        assert svc.memory.budget_of(card) >= w + 4 * GIB, (
            f"{svc.name}: budget {svc.memory.budget_of(card)} < {w}"
        )


@pytest.mark.parametrize("path", [p for p, card in CARD.items() if card == H200], ids=lambda p: p.name)
def test_real_size_deploy_file_is_refused_on_80gb_gpus_before_anything_starts(path, ming_flash):
    rc, out, err = _check(path, ming_flash, H100)
    assert rc == 2 and "budgets exceed device memory on cuda:0" in err and "overshoot" in err
    assert "nothing started" not in out


def test_without_dummy_weights_the_config_only_checkpoint_is_refused(ming_flash):
    path = DEPLOY / "h200x2.yaml"
    out, err = io.StringIO(), io.StringIO()
    overrides = [
        f"model.checkpoint={ming_flash}",
        f"devices.total_bytes_override={H200}",
        *_port_overrides(path),
    ]
    assert launch(path, overrides, out=out, err=err, check_only=True) == 2
    assert "has no *.safetensors weights" in err.getvalue()
