"""The greedy argmax launch (kernels/argmax.py) picks torch.argmax's ids, bit for bit: the largest
value with ties to the lowest index across chunks, -0.0 equal to 0.0, the first NaN above all;
every launch leaves the row slots and tickets ready for the next; the sampler's greedy ids go
through it into the caller's `out` (the sampled feed's buffer) where it takes the rows."""

from __future__ import annotations

import struct

import pytest
import torch
from omnistage.services.thinker.engine import sampler
from omnistage.services.thinker.engine.sampler import Sampler, greedy_ids
from omnistage.services.thinker.engine.sequence import SamplingParams, Sequence
from omnistage.services.thinker.kernels import argmax
from omnistage.services.thinker.kernels.tickets import tickets_for

NAN, INF = float("nan"), float("inf")


def _float(bits: int) -> float:
    """The fp32 of these bits."""
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _check(rows: torch.Tensor) -> torch.Tensor:
    got = argmax.argmax(rows)
    assert got.dtype == torch.int64 and torch.equal(got, rows.argmax(dim=-1)), (got, rows.argmax(dim=-1))
    return got


@pytest.mark.parametrize("r,v", [(1, 1), (1, 5), (2, 2047), (3, 2048), (4, 2049), (16, 5000), (1, 157_184)])
def test_random_rows_with_and_without_ties_pick_torchs_ids(r, v):
    gen = torch.Generator().manual_seed(r * 100_003 + v)
    _check(torch.randn(r, v, generator=gen))
    _check(torch.randint(-3, 4, (r, v), generator=gen).float())  # many ties at the max


def test_ties_go_to_the_lowest_index_across_chunks_and_signed_zeros_are_equal():
    v = 3 * argmax.BLOCK + 5
    rows = torch.full((10, v), -1.0)
    rows[0, [4100, 2048, v - 1]] = 7.0  # the tie's lowest in the second chunk
    rows[1] = 3.0  # all equal
    rows[2] = -INF
    rows[3] = INF
    rows[4, v - 1] = 2.0  # the last column, in the short last chunk
    rows[5, 3000], rows[5, 100] = 0.0, -0.0  # -0.0 == 0.0: the lower index
    rows[6, 3000], rows[6, 100] = -0.0, 0.0
    rows[7] = -0.0
    rows[7, 5000] = 0.0
    rows[8] = torch.linspace(-5, -1e-30, v).flip(0)  # negatives: the one nearest zero, first
    rows[9, :] = _float(1)  # subnormals: the smallest, and twice it
    rows[9, 6000] = _float(2)
    assert _check(rows).tolist() == [2048, 0, 0, 0, v - 1, 100, 100, 0, 0, 6000]


def test_a_nan_is_above_everything_and_the_first_nan_wins():
    v = 2 * argmax.BLOCK + 300
    rows = torch.randn(5, v, generator=torch.Generator().manual_seed(3))
    rows[0, [4000, 2100]] = NAN  # two chunks: the first NaN
    rows[1, 10] = INF
    rows[1, 3000] = _float(0xFFC00000)  # a negative NaN still beats +inf
    rows[2, 0] = _float(0x7F800001)  # a signalling payload, at the first column
    rows[2, 7] = NAN
    rows[3] = -INF
    rows[3, v - 1] = _float(0xFFFFFFFF)
    rows[4] = NAN
    assert _check(rows).tolist() == [2100, 3000, 0, v - 1, 0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_rows_pick_torchs_ids(dtype):
    gen = torch.Generator().manual_seed(5)
    rows = torch.randint(-50, 50, (3, 4500), generator=gen).to(dtype) / 8
    rows[2, 4400] = NAN
    _check(rows)


def test_rows_of_a_wider_tensor_into_a_view_of_a_buffer():
    wide = torch.randn(3, 5000, generator=torch.Generator().manual_seed(7))
    rows = wide[:, 3:4900]
    buffer = torch.full((8,), -7, dtype=torch.int64)
    got = argmax.argmax(rows, out=buffer[2:5])
    assert got.data_ptr() == buffer[2:].data_ptr()
    assert buffer.tolist() == [-7, -7, *rows.argmax(dim=-1).tolist(), -7, -7, -7]


def test_every_launch_leaves_the_slots_and_tickets_ready_for_the_next():
    first = torch.zeros(4, 3000)
    first[:, 7] = 100.0  # a max the next launch's rows are all below: a stale slot would win
    second = torch.randn(4, 3000, generator=torch.Generator().manual_seed(9))
    for rows in (first, second, second[:1]):
        _check(rows)
        assert (argmax._slots_for(rows.device) == -(2**63)).all()
        assert not tickets_for(rows.device, argmax.MAX_ROWS).any()


def test_supported_takes_a_few_contiguous_float_rows_where_triton_runs(monkeypatch):
    rows = torch.zeros(2, 100)
    ok_out = torch.zeros(2, dtype=torch.int64)
    assert argmax.supported(rows) and argmax.supported(rows, ok_out)
    assert argmax.supported(torch.zeros(argmax.MAX_ROWS, 100))
    refused = [
        (torch.zeros(argmax.MAX_ROWS + 1, 100), None),
        (torch.zeros(0, 100), None),
        (torch.zeros(100), None),
        (torch.zeros(100, 2).t(), None),  # a column stride of 2
        (torch.zeros(2, 100, dtype=torch.float64), None),
        (torch.zeros(2, 100, dtype=torch.int64), None),
        (rows, torch.zeros(2, dtype=torch.int32)),
        (rows, torch.zeros(3, dtype=torch.int64)),
        (rows, torch.zeros(4, dtype=torch.int64)[::2]),
    ]
    for bad, out in refused:
        assert not argmax.supported(bad, out), (bad.shape, bad.stride(), bad.dtype, out)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU off the interpreter: torch's argmax
    assert not argmax.supported(rows)


def _seq(params: SamplingParams) -> Sequence:
    return Sequence("r", [1, 2], params, max_tokens=16)


def test_the_samplers_greedy_ids_go_through_the_launch_into_out(launches, monkeypatch):
    monkeypatch.setattr(sampler, "fast_argmax", lambda device: True)  # as on a CUDA device
    launches.watch(argmax, "_argmax_kernel")
    logits = torch.randn(3, 2500, generator=torch.Generator().manual_seed(11))
    buffer = torch.zeros(4, dtype=torch.int64)
    sample = Sampler().sample(logits, [_seq(SamplingParams()) for _ in range(3)], out=buffer[:3])
    assert sample.tokens.data_ptr() == buffer.data_ptr()  # no copy to share them
    assert sample.to_host().token_ids == buffer[:3].tolist() == logits.argmax(dim=-1).tolist()
    assert launches.of("_argmax_kernel") == [((2, 3), None)]
    # A row drawn at random replaces its id out of place: the greedy rows keep torch's ids.
    seqs = [_seq(SamplingParams()), _seq(SamplingParams(temperature=1.0, seed=1)), _seq(SamplingParams())]
    sample = Sampler().sample(logits, seqs, out=buffer[:3])
    assert sample.tokens.data_ptr() != buffer.data_ptr()
    got = sample.to_host().token_ids
    assert [got[0], got[2]] == [int(logits[0].argmax()), int(logits[2].argmax())]


def test_beyond_the_launchs_rows_or_off_cuda_the_greedy_ids_are_torchs(launches, monkeypatch):
    launches.watch(argmax, "_argmax_kernel")
    assert not sampler.fast_argmax(torch.device("cpu"))  # the engine's CPU steps: torch's argmax
    few = torch.randn(2, 300, generator=torch.Generator().manual_seed(13))
    assert torch.equal(greedy_ids(few), few.argmax(dim=-1))
    monkeypatch.setattr(sampler, "fast_argmax", lambda device: True)
    many = torch.randn(argmax.MAX_ROWS + 1, 300, generator=torch.Generator().manual_seed(13))
    out = torch.zeros(argmax.MAX_ROWS + 1, dtype=torch.int64)
    assert greedy_ids(many, out) is out and torch.equal(out, many.argmax(dim=-1))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # off the interpreter a CPU tensor cannot launch
    assert torch.equal(greedy_ids(few), few.argmax(dim=-1))
    assert launches.names() == []


def test_the_samplers_greedy_ids_of_bf16_logits_launch_on_them_as_they_are(launches, monkeypatch):
    """The LM head's bf16 logits (a view that cuts the gather's padding columns) go to the launch
    with no fp32 copy, and their ids are their fp32 cast's: ties to the lowest index, across chunks."""
    monkeypatch.setattr(sampler, "fast_argmax", lambda device: True)  # as on a CUDA device
    launches.watch(argmax, "_argmax_kernel")
    gathered = torch.randint(-6, 7, (3, 4608), generator=torch.Generator().manual_seed(17)).bfloat16()
    logits = gathered[:, :4500]  # the padding past the vocabulary cut by a view
    logits[1, [4400, 2100, 3000]] = 9.0  # a tie in three chunks: the second chunk's
    logits[2, 4499] = NAN
    buffer = torch.zeros(3, dtype=torch.int64)
    sample = Sampler().sample(logits, [_seq(SamplingParams()) for _ in range(3)], out=buffer)
    (args,) = launches.arguments("_argmax_kernel")
    assert args[0] is logits and args[0].dtype == torch.bfloat16 and args[5] == 4608
    ids = sample.to_host().token_ids
    assert ids == buffer.tolist() == logits.float().argmax(dim=-1).tolist()
    assert ids[1:] == [2100, 4499]
