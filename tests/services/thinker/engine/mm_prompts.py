"""Multimodal prompts for the thinker tests: token ids laid out as the gateway writes them, encoder-like
items with random unit-norm rows, and the model inputs computed straight from ming.md §2.2-2.3
(masked scatter for vision, (start, len) spans after `<audio>` for audio, rope_index on patch-unit
grids), independent of the thinker's own layout code."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from omnistage.common.transport import TransportContext, encode
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.rope_index import get_rope_index
from omnistage.v1 import encoder_pb2, thinker_pb2

# A part of a prompt: ("text", n tokens) | ("image", (h, w)) | ("video", [(h, w), ...] per temporal
# slice) | ("audio", n rows). Grids are merged (token) grids, as the encoder reports them.
Part = tuple[str, object]

MIXED: list[Part] = [
    ("text", 5),
    ("image", (2, 3)),
    ("text", 3),
    ("audio", 4),
    ("text", 2),
    ("video", [(2, 2), (2, 2)]),
    ("text", 3),
    ("image", (2, 2)),
    ("text", 2),
]


@dataclass
class Media:
    kind: str
    rows: torch.Tensor  # [n, H] float32, unit norm
    grids: list[tuple[int, int, int]]  # merged (t, h, w) rows; empty for audio


def _rows(n: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(n, hidden, generator=gen), dim=-1)


def layout(cfg: ThinkerConfig, parts: list[Part], seed: int = 0) -> tuple[list[int], list[Media]]:
    """Token ids of `parts` in the gateway's expansion (ming.md §3.5, §7.2) and each item's rows."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    tok = cfg.special_tokens
    text = lambda n: [rng.randrange(0, 900) for _ in range(n)]  # noqa: E731 - below every special id
    ids: list[int] = []
    media: list[Media] = []
    for kind, spec in parts:
        if kind == "text":
            ids += text(spec)
        elif kind == "image":
            h, w = spec
            ids += [tok["<image>"]] + [cfg.image_patch_token_id] * (h * w) + [tok["</image>"]] + text(1)
            media.append(Media("image", _rows(h * w, cfg.hidden_size, gen), [(1, h, w)]))
        elif kind == "video":
            ids.append(tok["<video>"])
            for h, w in spec:
                ids += text(2) + [tok["<image>"]] + [cfg.video_patch_token_id] * (h * w) + [tok["</image>"]]
            ids.append(tok["</video>"])
            n = sum(h * w for h, w in spec)
            media.append(Media("video", _rows(n, cfg.hidden_size, gen), [(1, h, w) for h, w in spec]))
        else:
            ids += [tok["<audio>"]] + [cfg.audio_patch_token_id] * spec + [tok["</audio>"]]
            media.append(Media("audio", _rows(spec, cfg.hidden_size, gen), []))
    return ids, media


def placeholder(cfg: ThinkerConfig, kind: str) -> int:
    return {
        "image": cfg.image_patch_token_id,
        "video": cfg.video_patch_token_id,
        "audio": cfg.audio_patch_token_id,
    }[kind]


def items(
    cfg: ThinkerConfig,
    media: list[Media],
    transport: TransportContext | None = None,
    force: str | None = None,
) -> list[thinker_pb2.MultimodalEmbedding]:
    """The items as the gateway forwards them (inline refs, or `force`="shm" through `transport`)."""
    return [
        thinker_pb2.MultimodalEmbedding(
            placeholder_token_id=placeholder(cfg, m.kind),
            embeddings=encode(m.rows, transport=transport, force=force),
            merged_grids=[encoder_pb2.GridTHW(t=t, h=h, w=w) for t, h, w in m.grids],
        )
        for m in media
    ]


def reference_inputs(
    cfg: ThinkerConfig, embedding: torch.Tensor, ids: list[int], media: list[Media], merge: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(inputs_embeds [P, H], modality [P], positions [3, P], rope_delta) the way the reference builds
    them: vision rows by masked scatter over all vision items in order, audio by spans after `<audio>`."""
    ids_t = torch.tensor(ids)
    embeds = embedding[ids_t].clone()
    modality = torch.zeros(len(ids), dtype=torch.int8)
    for kind in ("image", "video"):
        mask = ids_t == placeholder(cfg, kind)
        feats = [m.rows for m in media if m.kind == kind]
        if feats:
            embeds[mask] = torch.cat(feats).to(embeds.dtype)
        modality[mask] = 1
    clips = iter(m for m in media if m.kind == "audio")
    for k, token in enumerate(ids):
        if token == cfg.special_tokens["<audio>"]:
            rows = next(clips).rows
            embeds[k + 1 : k + 1 + rows.shape[0]] = rows.to(embeds.dtype)
            modality[k + 1 : k + 1 + rows.shape[0]] = 2
    positions, delta = get_rope_index(
        ids,
        image_start_token_id=cfg.image_start_token_id,
        image_patch_token_id=cfg.image_patch_token_id,
        video_patch_token_id=cfg.video_patch_token_id,
        image_grid_thw=[(t, h * merge, w * merge) for m in media if m.kind == "image" for t, h, w in m.grids]
        or None,
        video_grid_thw=[(t, h * merge, w * merge) for m in media if m.kind == "video" for t, h, w in m.grids]
        or None,
        spatial_merge_size=merge,
    )
    return embeds, modality, positions, delta
