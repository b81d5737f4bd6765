"""SampledFeed: rank 0 samples straight into `target(plan)`, which `share` then has nothing to copy;
tokens made elsewhere (rows drawn at random replace theirs out of place) are copied in; under TP
the other ranks receive rank 0's ids into the same buffer. The engine samples a shared step's
greedy ids into the feed's buffer, and its outputs stay those of the synchronous engine."""

from __future__ import annotations

import torch
from omnistage.services.thinker.engine.sampled_feed import SampledFeed
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.models.layers.parallel import TPGroup
from omnistage.services.thinker.tp.plan import StepPlan

from tests.services.thinker.engine.test_async_scheduling import drive, make, prompts


def _plan(rows: int) -> StepPlan:
    return StepPlan(sample_rows=torch.arange(rows))


def _copies(monkeypatch) -> list[torch.Tensor]:
    """Every Tensor.copy_ destination from now on."""
    seen, copy = [], torch.Tensor.copy_

    def recorded(self, src, *args, **kwargs):
        seen.append(self)
        return copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", recorded)
    return seen


def test_tokens_sampled_into_the_target_are_shared_without_a_copy(monkeypatch):
    feed = SampledFeed(torch.device("cpu"), TPGroup(), capacity=4)
    target = feed.target(_plan(3))
    assert target.data_ptr() == feed.buffer.data_ptr() and target.shape == (3,)
    target.copy_(torch.tensor([5, 6, 7]))
    copies = _copies(monkeypatch)
    feed.share(_plan(3), target)
    assert copies == [] and feed.ids.tolist() == [5, 6, 7]
    assert feed.fill(torch.tensor([-3, 9, -1])).tolist() == [7, 9, 5]


def test_tokens_made_elsewhere_are_copied_into_the_buffer(monkeypatch):
    feed = SampledFeed(torch.device("cpu"), TPGroup(), capacity=4)
    buffer = feed.buffer.data_ptr()
    copies = _copies(monkeypatch)
    feed.share(_plan(2), torch.tensor([[11], [13]]))
    feed.share(_plan(2), feed.buffer[1:3].clone().index_put((torch.tensor([0]),), torch.tensor(4)))
    assert len(copies) == 2 and feed.ids.tolist() == [4, 0] and feed.ids.data_ptr() == buffer


class _Receiver(TPGroup):
    """Rank 1 of two: the broadcast writes rank 0's ids into the buffer it is given."""

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        x.copy_(torch.arange(21, 21 + x.numel()))
        return x


def test_the_other_ranks_receive_rank_zeros_ids_into_their_buffer():
    feed = SampledFeed(torch.device("cpu"), _Receiver(rank=1, size=2), capacity=4)
    feed.share(_plan(3))
    assert feed.ids.data_ptr() == feed.buffer.data_ptr() and feed.buffer.tolist() == [21, 22, 23, 0]


def test_the_engine_samples_a_shared_steps_greedy_ids_into_the_feeds_buffer():
    """Greedy steps share the buffer itself; a step with a row drawn at random shares a copy; the
    outputs are the synchronous engine's (a sample's host ids never read the buffer a later step
    rewrites)."""
    arrivals = [
        (0, "greedy", prompts(1, seed=1)[0], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)),
        (
            2,
            "drawn",
            prompts(1, seed=2)[0],
            SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=3),
        ),
    ]
    want = drive(make(False), arrivals)
    engine = make(True)
    shared: list[bool] = []
    share = engine.runner.share_sampled

    def recorded(plan, tokens=None):
        shared.append(tokens.data_ptr() == engine.runner.feed.buffer.data_ptr())
        return share(plan, tokens)

    engine.runner.share_sampled = recorded
    got = drive(engine, arrivals)
    assert {r: s.summary() for r, s in got.items()} == {r: s.summary() for r, s in want.items()}
    assert True in shared and False in shared
