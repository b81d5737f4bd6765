from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.engine.sampler import Sampler, apply_penalties, filter_logits
from omnistage.services.thinker.engine.sequence import SamplingParams, Sequence


def seq(params: SamplingParams, tokens=(1, 2, 3), prompt_len: int = 2) -> Sequence:
    s = Sequence("r", list(tokens[:prompt_len]), params, max_tokens=16)
    s.token_ids.extend(tokens[prompt_len:])
    return s


def test_greedy_is_argmax_of_each_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, [seq(SamplingParams()) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_top_k_top_p_min_p_masks_match_direct_computation():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    top_k, top_p, min_p = (
        torch.tensor([5, 0, 0]),
        torch.tensor([1.0, 0.6, 1.0]),
        torch.tensor([0.0, 0.0, 0.3]),
    )
    kept = filter_logits(logits, top_k, top_p, min_p) > float("-inf")
    # row 0: the 5 largest
    assert set(kept[0].nonzero().flatten().tolist()) == set(logits[0].topk(5).indices.tolist())
    # row 1: smallest prefix of the sorted distribution whose mass reaches 0.6
    probs, order = logits[1].softmax(-1).sort(descending=True)
    n = int((probs.cumsum(0) < 0.6).sum()) + 1
    assert set(kept[1].nonzero().flatten().tolist()) == set(order[:n].tolist())
    # row 2: probability at least 0.3 * max
    p = logits[2].softmax(-1)
    assert kept[2].tolist() == (p >= 0.3 * p.max()).tolist()


def test_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.randn(1, 30)
    kept = filter_logits(logits, torch.tensor([0]), torch.tensor([1e-6]), torch.tensor([0.0])) > float("-inf")
    assert kept[0].nonzero().flatten().tolist() == [int(logits.argmax())]


def test_repetition_and_presence_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    s = seq(SamplingParams(repetition_penalty=2.0, presence_penalty=0.25), tokens=(0, 1, 2, 2), prompt_len=2)
    out = apply_penalties(logits.clone(), [s])
    # prompt+output tokens {0,1,2}: positive / 2, negative * 2; output tokens {2}: - 0.25
    assert out.tolist() == [[1.0, -4.0, 0.5 - 0.25, 0.5, 3.0]]


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    s = seq(SamplingParams(repetition_penalty=2.0), tokens=(0, 0), prompt_len=1)
    assert Sampler()(logits, [s]).token_ids == [1]


def test_same_seed_same_tokens_whatever_the_batch():
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(1, 64, generator=gen) for _ in range(6)]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)

    def run(batch_logits: list[torch.Tensor], seqs: list[Sequence], steps: int = 8) -> list[list[int]]:
        out = [[] for _ in seqs]
        for _ in range(steps):
            toks = Sampler()(torch.cat(batch_logits), seqs).token_ids
            for o, t in zip(out, toks, strict=True):
                o.append(t)
        return out

    alone = run([rows[0]], [seq(params)])[0]
    others = [seq(SamplingParams(temperature=1.0, seed=i)) for i in range(4)] + [seq(SamplingParams())]
    mixed = run(rows[1:3] + [rows[0]] + rows[3:], others[:2] + [seq(params)] + others[2:])[2]
    assert alone == mixed
    other_seed = run([rows[0]], [seq(SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=99))])[0]
    assert other_seed != alone


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]]))
    s = seq(SamplingParams(temperature=1.0, seed=0))
    counts = torch.zeros(4)
    for _ in range(2000):
        counts[Sampler()(logits, [s]).token_ids[0]] += 1
    freq = counts / counts.sum()
    assert freq[3] == 0
    assert torch.allclose(freq[:3], torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_the_step_logits_are_never_changed_and_a_penalised_rows_logprobs_are_the_models():
    """The logits may be a decode graph's output buffer: penalties (and masks) work on a copy, the
    plain path reads them as they are; either way the logprobs are of the model's logits."""
    logits = torch.tensor([[5.0, 4.0, 0.0], [1.0, 3.0, 2.0]])
    before = logits.clone()
    plain = Sampler()(logits, [seq(SamplingParams(logprobs=1)), seq(SamplingParams())])
    assert plain.token_ids == [0, 1] and torch.equal(logits, before)
    penalised = [seq(SamplingParams(repetition_penalty=2.0, logprobs=1), tokens=(0, 0), prompt_len=1)]
    out = Sampler()(logits[:1], penalised)
    assert out.token_ids == [1] and torch.equal(logits, before)
    assert out.logprobs[0].logprob == pytest.approx(float(before[0].log_softmax(-1)[1]))


def test_logprobs_top_n_are_the_models():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(5))
    seqs = [seq(SamplingParams(logprobs=3)), seq(SamplingParams())]
    out = Sampler()(logits, seqs)
    lp = out.logprobs[0]
    ref = logits[0].log_softmax(-1)
    assert lp.token_id == out.token_ids[0] == int(ref.argmax())
    assert lp.logprob == pytest.approx(float(ref.max()))
    assert lp.top_token_ids == ref.topk(3).indices.tolist()
    assert lp.top_logprobs == pytest.approx(ref.topk(3).values.tolist())
    assert out.logprobs[1] is None


def _hf_kept(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Tokens HF's warpers keep, applied in generate()'s order: top-k, then top-p, then min-p."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.clone()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores > float("-inf")


def test_filters_renormalise_after_top_k_like_hf():
    # p = .5/.3/.2, k=2 keeps .5/.3 → renormalised .625/.375; top_p .6 is reached by the first alone.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    kept = filter_logits(logits, torch.tensor([2]), torch.tensor([0.6]), torch.tensor([0.0])) > float("-inf")
    assert kept.tolist() == [[True, False, False]]
    assert kept.tolist() == _hf_kept(logits, 2, 0.6, 0.0).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_filters_match_hf_warpers_on_random_logits(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 200, generator=gen) * 3
    settings = [(k, p, m) for k in (0, 1, 7, 50) for p in (1.0, 0.3, 0.9) for m in (0.0, 0.05)]
    for k, p, m in settings:
        n = logits.shape[0]
        ours = filter_logits(logits, torch.full((n,), k), torch.full((n,), p), torch.full((n,), m)) > float(
            "-inf"
        )
        assert torch.equal(ours, _hf_kept(logits, k, p, m)), (k, p, m)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_noise_is_drawn_on_the_logits_device_with_the_rows_generator(monkeypatch, device):
    drawn = []
    real = torch.Tensor.exponential_

    def spy(self, *args, generator=None, **kw):
        drawn.append((self.device, generator, self.numel()))
        return real(self, *args, generator=generator, **kw)

    monkeypatch.setattr(torch.Tensor, "exponential_", spy)
    logits = torch.randn(2, 30, device=device)
    seqs = [seq(SamplingParams(temperature=1.0, seed=5)), seq(SamplingParams(temperature=1.0))]
    Sampler()(logits, seqs)
    gens = [s.generator(logits.device) for s in seqs]
    assert drawn == [(logits.device, gens[0], 30), (logits.device, gens[1], 30)]
    assert all(g.device == logits.device for g in gens)


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_whatever_the_batch_on_each_device(device):
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(5, 300, generator=gen).to(device)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=77)

    def run(logits, seqs, row):
        return [Sampler()(logits, seqs).token_ids[row] for _ in range(10)]

    alone = run(rows[2:3], [seq(params)], 0)
    others = [seq(SamplingParams(temperature=1.0, seed=i)) for i in range(4)]
    assert run(rows, others[:2] + [seq(params)] + others[2:], 2) == alone


def test_seeded_generator_is_made_lazily_from_the_seed():
    a, b = seq(SamplingParams(temperature=1.0, seed=11)), seq(SamplingParams(temperature=1.0, seed=11))
    assert a.generator(torch.device("cpu")).initial_seed() == 11
    assert a.generator(torch.device("cpu")) is a.generator(torch.device("cpu"))
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(0))
    assert [Sampler()(logits, [a]).token_ids[0] for _ in range(5)] == [
        Sampler()(logits, [b]).token_ids[0] for _ in range(5)
    ]
