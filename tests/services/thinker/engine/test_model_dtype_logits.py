"""Logits in the model's dtype (issue 40): the LM head makes no fp32 copy; the sampler's greedy
argmax reads bf16 logits as they are and gives the ids of their fp32 cast (ties to the lowest
index, -0.0 equal to 0.0, a NaN above everything), while penalties, grammar masks, random draws
and logprobs see the fp32 cast's values, bit for bit what they saw when the runner cast."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine import sampler as sampler_module
from omnistage.services.thinker.engine.sampler import Sampler
from omnistage.services.thinker.engine.sequence import SamplingParams, Sequence
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank

NAN, INF = float("nan"), float("inf")


def seq(params: SamplingParams, i: int = 0) -> Sequence:
    s = Sequence(f"r{i}", [1, 2, 3], params, max_tokens=16)
    s.token_ids.extend([4, 5])  # two output tokens: presence penalties apply
    return s


def tied_bf16_rows() -> torch.Tensor:
    """bf16 rows with many ties at the max, signed zeros, infinities and NaNs."""
    rows = (torch.randint(-4, 5, (8, 300), generator=torch.Generator().manual_seed(3)) / 4).bfloat16()
    rows[1] = 1.0  # all tied: the first
    rows[2], rows[2, [40, 7, 250]] = -1.0, 0.0  # a tie at 0.0, the lowest index wins
    rows[2, 7] = -0.0  # -0.0 equal to 0.0: still the lowest index
    rows[3], rows[3, 299] = -INF, -1.0
    rows[4, [100, 30]] = INF
    rows[5, [200, 60]] = NAN  # the first NaN, above everything
    rows[6] = torch.linspace(2.99, 3.0, 300).bfloat16()  # distinct values equal once rounded: ties
    return rows


def recorded_greedy(monkeypatch) -> list[torch.Tensor]:
    """What the sampler's greedy argmax reads, step by step."""
    seen: list[torch.Tensor] = []
    inner = sampler_module.greedy_ids

    def greedy_ids(logits, out=None):
        seen.append(logits)
        return inner(logits, out)

    monkeypatch.setattr(sampler_module, "greedy_ids", greedy_ids)
    return seen


def test_a_bf16_greedy_step_reads_the_logits_as_they_are_and_picks_their_casts_ids(monkeypatch):
    seen = recorded_greedy(monkeypatch)
    logits = tied_bf16_rows()
    before = logits.clone()
    out = torch.full((8,), -1, dtype=torch.int64)
    sample = Sampler().sample(logits, [seq(SamplingParams(), i) for i in range(8)], out=out)
    assert len(seen) == 1 and seen[0] is logits  # no fp32 copy on the greedy step
    ids = sample.to_host().token_ids
    assert ids == logits.float().argmax(dim=-1).tolist() == out.tolist()
    assert ids[1:6] == [0, 7, 299, 30, 60]
    assert ids[6] == int((torch.linspace(2.99, 3.0, 300).bfloat16() == 3.0).int().argmax()) < 299
    assert torch.equal(logits.view(torch.int16), before.view(torch.int16))  # never changed


class FakeMask:
    """A grammar mask (grammar_masks.PendingMask's interface): row 0 may not take its top token."""

    def __init__(self) -> None:
        self.dtypes: list[torch.dtype] = []

    def apply(self, logits: torch.Tensor) -> None:
        self.dtypes.append(logits.dtype)
        logits[0, logits[0].argmax()] = -INF

    def accept(self, token_ids) -> dict[int, str]:
        return {}


SAMPLING = [
    SamplingParams(),
    SamplingParams(logprobs=4),
    SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, logprobs=2),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=7, logprobs=3),
    SamplingParams(temperature=1.3, seed=11),
    SamplingParams(),
]


def sampled(logits: torch.Tensor, mask: FakeMask | None) -> tuple[list[int], list]:
    seqs = [seq(p, i) for i, p in enumerate(SAMPLING)]  # fresh generators: the same draws
    got = Sampler()(logits, seqs, mask)
    return got.token_ids, got.logprobs


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "grammar-masked"])
def test_every_value_reader_sees_the_fp32_cast_bit_for_bit(monkeypatch, masked):
    """Penalties, masks, draws and logprobs of bf16 logits are those of their fp32 cast (today's
    runner output): the same ids and the same logprob floats, ties included."""
    seen = recorded_greedy(monkeypatch)
    logits = (torch.randn(6, 500, generator=torch.Generator().manual_seed(9)) * 3).bfloat16()
    logits[0, [10, 3]] = logits[0].max() + 1  # a tie at the top
    masks = (FakeMask(), FakeMask()) if masked else (None, None)
    got = sampled(logits, masks[0])
    want = sampled(logits.float(), masks[1])
    assert got == want
    assert got[1][1].top_token_ids and got[1][0] is None and got[1][4] is None
    assert [t.dtype for t in seen] == [torch.float32] * 2  # penalised rows: an fp32 copy read
    if masked:
        assert masks[0].dtypes == masks[1].dtypes == [torch.float32]


def test_plain_draws_and_logprobs_without_penalties_leave_the_greedy_argmax_on_bf16(monkeypatch):
    seen = recorded_greedy(monkeypatch)
    logits = tied_bf16_rows()[:3]
    params = [SamplingParams(logprobs=3), SamplingParams(temperature=0.7, seed=3), SamplingParams()]
    runs = [Sampler()(x, [seq(p, i) for i, p in enumerate(params)]) for x in (logits, logits.float())]
    assert seen[0] is logits and seen[1].dtype == torch.float32
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].logprobs == runs[1].logprobs
    assert runs[0].token_ids[2] == int(logits[2].float().argmax())


def test_fp32_logits_are_read_as_they_are(monkeypatch):
    seen = recorded_greedy(monkeypatch)
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    assert Sampler()(logits, [seq(SamplingParams(logprobs=1)), seq(SamplingParams())]).token_ids == (
        logits.argmax(-1).tolist()
    )
    assert seen == [logits] and seen[0] is logits


def bf16_engine(ckpt, cast: bool):
    """A bf16 CPU engine; `cast`: its runner hands the sampler the fp32 cast (the old contract)."""
    cfg = EngineConfig(block_size=16, max_model_len=256, max_num_batched_tokens=128)
    e = rank0_engine(start_rank(RankConfig(str(ckpt), cfg, dtype="bfloat16", full_warmup=False)))
    if cast:
        inner = e.runner.execute_step

        def execute_step(plan):
            out = inner(plan)
            return out if out.logits is None else dataclasses.replace(out, logits=out.logits.float())

        e.runner.execute_step = execute_step
    return e


def test_a_bf16_engine_gives_the_tokens_and_logprobs_of_its_logits_fp32_cast(tiny_ckpt, monkeypatch):
    prompts = [[5, 9, 200, 31, 7], list(range(40, 75)), [800, 3, 3, 3]]
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, repetition_penalty=1.2),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5, logprobs=2),
    ]
    runs = []
    for cast in (False, True):
        e = bf16_engine(tiny_ckpt, cast)
        seen = recorded_greedy(monkeypatch)
        results = [e.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
        runs.append([(r.token_ids, r.logprobs) for r in results])
        if not cast:  # the plain greedy request's steps read the model's bf16 logits
            assert {t.dtype for t in seen[:8]} == {torch.bfloat16}
    assert runs[0] == runs[1]
    assert all(len(tokens) == 8 for tokens, _ in runs[0])
