"""The thinker's multimodal layout (MediaInputs) on the tiny checkpoint's ids: slots, router codes and
3D positions against the reference construction (mm_prompts.reference_inputs, rope_index), precise
refusals naming the item, and no lease left behind whatever happens."""

from __future__ import annotations

import pytest
import torch
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.transport import TransportContext, TransportOptions
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.multimodal import MediaInputs

from tests.services.thinker.engine.mm_prompts import MIXED, Media, items, layout, reference_inputs


@pytest.fixture(scope="module")
def cfg(tiny_ckpt) -> ThinkerConfig:
    return ThinkerConfig.from_checkpoint(tiny_ckpt)


@pytest.fixture
def inputs(cfg):
    media = MediaInputs(cfg, torch.float32, TransportContext())
    yield media
    media.close()


@pytest.fixture
def producer():
    """The encoder's side: a shm pool whose leases the thinker must end."""
    with TransportContext(TransportOptions(shm_pool_bytes=4 << 20)) as ctx:
        yield ctx


def leases(producer: TransportContext) -> int:
    pool = producer.shm_pool()
    pool.arena.reclaim()
    return pool.arena.active_leases


def check_against_reference(cfg, inputs, parts, embedding):
    ids, media = layout(cfg, parts, seed=3)
    built = inputs.build(ids, items(cfg, media))
    embeds, modality, positions, delta = reference_inputs(cfg, embedding, ids, media)
    spliced = embedding[torch.tensor(ids)].clone()
    spliced[built.media.slots] = built.media.rows
    assert torch.equal(spliced, embeds)
    got_modality = torch.zeros(len(ids), dtype=torch.int8)
    got_modality[built.media.slots] = built.media.modality.to(torch.int8)
    assert torch.equal(got_modality, modality)
    assert built.token_ids == ids
    return built, positions, delta


def test_mixed_prompt_matches_the_reference_construction(cfg, inputs):
    embedding = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    built, positions, delta = check_against_reference(cfg, inputs, MIXED, embedding)
    assert torch.equal(built.positions, positions) and built.rope_delta == delta
    ids = built.token_ids
    patch_ids = {cfg.image_patch_token_id, cfg.video_patch_token_id, cfg.audio_patch_token_id}
    assert built.media.slots.tolist() == [k for k, t in enumerate(ids) if t in patch_ids]
    assert delta < 0  # vision blocks compress positions, so decode positions trail the cache index


def test_several_images_take_their_rows_in_order(cfg, inputs):
    embedding = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    parts = [("text", 2), ("image", (2, 2)), ("image", (1, 3)), ("text", 1), ("image", (3, 2)), ("text", 2)]
    built, positions, delta = check_against_reference(cfg, inputs, parts, embedding)
    assert torch.equal(built.positions, positions) and built.rope_delta == delta


def test_worked_example_of_ming_md(cfg, inputs):
    """ming.md §2.3: [x, x, x, <image>, 6 patches (H'=2, W'=3), </image>, x, x]."""
    x = 7
    ids = (
        [x, x, x, cfg.image_start_token_id] + [cfg.image_patch_token_id] * 6 + [cfg.image_end_token_id, x, x]
    )
    rows = torch.nn.functional.normalize(torch.randn(6, cfg.hidden_size), dim=-1)
    (item,) = items(cfg, [Media("image", rows, [(1, 2, 3)])])
    built = inputs.build(ids, [item])
    assert built.positions.tolist() == [
        [0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 5, 6, 7],
        [0, 1, 2, 3, 3, 4, 5, 3, 4, 5, 5, 6, 7],
    ]
    assert built.rope_delta == -5
    assert built.media.slots.tolist() == list(range(4, 10)) and torch.equal(built.media.rows, rows)


def test_audio_only_prompt_keeps_1d_positions(cfg, inputs):
    ids, media = layout(cfg, [("text", 3), ("audio", 5), ("text", 2), ("audio", 2)])
    built = inputs.build(ids, items(cfg, media))
    assert built.positions is None and built.rope_delta == 0
    assert built.media.modality.tolist() == [2] * 7
    assert torch.equal(built.media.rows, torch.cat([m.rows for m in media]))


def _bad(cfg, case):
    """(ids, items) broken one way; the message names the item."""
    ids, media = layout(cfg, [("text", 2), ("image", (2, 2)), ("text", 1), ("audio", 3), ("text", 1)])
    its = items(cfg, media)
    if case == "unknown-placeholder":
        its[1].placeholder_token_id = cfg.image_start_token_id
    elif case == "hidden-size":
        its[0].embeddings.shape[1] = cfg.hidden_size // 2
    elif case == "grid-vs-rows":
        its[0].merged_grids[0].w = 3
    elif case == "audio-with-grid":
        its[1].merged_grids.add(t=1, h=1, w=3)
    elif case == "image-two-grids":
        its[0].merged_grids[0].w = 1
        its[0].merged_grids.add(t=1, h=2, w=1)
    elif case == "vision-no-grid":
        del its[0].merged_grids[:]
    elif case == "run-too-long":
        k = ids.index(cfg.audio_patch_token_id)
        ids.insert(k, cfg.audio_patch_token_id)
    elif case == "missing-run":
        its.append(its[1])
    elif case == "unfilled-slots":
        ids += [cfg.special_tokens["<audio>"], cfg.audio_patch_token_id, cfg.special_tokens["</audio>"]]
    elif case == "not-after-image":
        k = ids.index(cfg.image_patch_token_id)
        ids[k - 1] = 5
    return ids, its


@pytest.mark.parametrize(
    "case, needle",
    [
        ("unknown-placeholder", "multimodal[1].placeholder_token_id: "),
        ("hidden-size", "multimodal[0].embeddings: shape [4, 128], expected [rows >= 1, hidden_size 256]"),
        ("grid-vs-rows", "multimodal[0]: 4 embedding rows but merged_grids [(1, 2, 3)] hold 6 tokens"),
        ("audio-with-grid", "multimodal[1].merged_grids: an audio item has none"),
        ("image-two-grids", "multimodal[0].merged_grids: an image has one row, got 2"),
        ("vision-no-grid", "multimodal[0].merged_grids: a vision item needs"),
        ("run-too-long", "multimodal[1]: its <audioPatch> run at token"),
        ("missing-run", "multimodal[2]: the prompt has no <audioPatch> run left for it"),
        ("unfilled-slots", "multimodal: 1 <audioPatch> slot(s) from token"),
        ("not-after-image", "multimodal[0]: its <imagePatch> run at token 3 does not follow <image>"),
    ],
)
def test_mismatches_are_refused_naming_the_item(cfg, inputs, producer, case, needle):
    ids, its = _bad(cfg, case)
    with pytest.raises(InvalidRequest) as err:
        inputs.check_items(its)
        inputs.build(ids, its)
    assert needle in str(err.value), str(err.value)


def test_every_lease_ends_after_a_build_and_after_a_refusal(cfg, inputs, producer):
    ids, media = layout(cfg, MIXED)
    its = items(cfg, media, producer, force="shm")
    assert all(i.embeddings.WhichOneof("payload") == "shm" for i in its) and leases(producer) == len(its)
    built = inputs.build(ids, its)
    assert leases(producer) == 0  # copying released them
    assert torch.equal(built.media.rows[: media[0].rows.shape[0]], media[0].rows)
    its = items(cfg, media, producer, force="shm")
    with pytest.raises(InvalidRequest):
        inputs.build(ids[:-12], its)  # the last image's run is cut: refused before any copy
    assert leases(producer) == len(its)
    inputs.release(its)
    assert leases(producer) == 0
    inputs.release(its)  # twice is harmless


def test_a_lease_the_caller_keeps_outlives_the_copy_and_a_refusal(cfg, inputs, producer):
    """The gateway sends one encoding to two thinker calls: the first copies the rows and leaves the
    leases to the gateway, which releases them after the last call."""
    ids, media = layout(cfg, MIXED)
    its = items(cfg, media, producer, force="shm")
    for item in its:
        item.caller_keeps_lease = True
    built = inputs.build(ids, its)
    assert torch.equal(built.media.rows[: media[0].rows.shape[0]], media[0].rows)
    assert leases(producer) == len(its)  # copied, not released
    inputs.release(its)  # a refusal's or a cancel's clean-up leaves them too
    assert leases(producer) == len(its)
    again = inputs.build(ids, its)  # the second call reads the same rows
    assert torch.equal(again.media.rows, built.media.rows)
    for item in its:
        item.caller_keeps_lease = False
    inputs.release(its)  # the caller's own release
    assert leases(producer) == 0


def test_an_expired_lease_is_refused_naming_the_item(cfg, inputs, producer):
    ids, media = layout(cfg, [("text", 1), ("audio", 3)])
    its = items(cfg, media, producer, force="shm")
    its[0].embeddings.shm.lease_expiry_unix_ms = 1
    with pytest.raises(InvalidRequest, match=r"^multimodal\[0\]\.embeddings: shm lease \d+ expired"):
        inputs.build(ids, its)
