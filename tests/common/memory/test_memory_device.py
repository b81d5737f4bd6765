"""SimulatedDeviceMemory meters real CPU tensors the way the CUDA caching allocator would count them."""

from __future__ import annotations

import gc

import pytest
import torch
from omnistage.common.memory.device import MiB, SimulatedDeviceMemory, device_memory_for, host_memory_bytes

FOUR_MIB = 1024 * 1024 * 4  # a [1024, 1024] float32 tensor


def test_factory_tensor_counts_its_storage_and_frees_when_it_dies():
    mem = SimulatedDeviceMemory(64 * MiB)
    with mem.meter():
        a = torch.empty(1024, 1024)
        assert mem.allocated() == FOUR_MIB
        assert mem.reserved() == FOUR_MIB  # two 2 MiB segments
        del a
        gc.collect()
    assert mem.allocated() == 0
    assert mem.reserved() == FOUR_MIB  # the cache keeps it
    assert mem.peak_allocated() == FOUR_MIB


def test_views_and_in_place_ops_add_nothing_op_outputs_do():
    mem = SimulatedDeviceMemory(64 * MiB)
    with mem.meter():
        a = torch.zeros(1024, 1024)
        v = a.view(-1)
        row = a[3]
        t = a.t()
        a.add_(1.0)
        v.mul_(2.0)
        assert mem.allocated() == FOUR_MIB
        b = a + 1  # a new storage
        h = torch.ones(1024, 512, dtype=torch.float16)  # 1 MiB
        assert mem.allocated() == 2 * FOUR_MIB + MiB
        del a, t, b
        gc.collect()
        # `v` and `row` keep a's storage alive; b's 4 MiB are back.
        assert mem.allocated() == FOUR_MIB + MiB
        del v, row, h
        gc.collect()
    assert mem.allocated() == 0


def test_small_tensors_round_to_512_bytes_and_modules_are_counted():
    mem = SimulatedDeviceMemory(64 * MiB)
    with mem.meter():
        x = torch.zeros(3)  # 12 bytes -> one 512-byte block
        assert mem.allocated() == 512
        lin = torch.nn.Linear(256, 256)  # weight 256 KiB + bias 1 KiB
        assert mem.allocated() == 512 + 256 * 256 * 4 + 1024
        del x, lin
        gc.collect()
    assert mem.allocated() == 0


def test_tensors_made_outside_meter_are_not_counted_unless_tracked():
    w = torch.empty(1024, 1024)
    mem = SimulatedDeviceMemory(64 * MiB)
    with mem.meter():
        w.view(-1).add_(1)
        assert mem.allocated() == 0
        assert mem.track(w) == FOUR_MIB
        assert mem.track(w) == 0  # counted once
        w2 = w * 2
        assert mem.allocated() == 2 * FOUR_MIB
        del w2
    del w
    gc.collect()
    assert mem.allocated() == 0


def test_oom_at_capacity_is_a_torch_oom_and_leaves_the_counts_unchanged():
    mem = SimulatedDeviceMemory(10 * MiB)
    with mem.meter():
        a = torch.empty(1024, 1024)  # 4 MiB
        b = torch.empty(1024, 1024)  # 8 MiB
        with pytest.raises(torch.OutOfMemoryError, match="out of memory") as exc:
            torch.empty(1024, 1024)  # would need 12 MiB reserved
        assert isinstance(exc.value, RuntimeError)  # caught like a CUDA OOM
        assert mem.allocated() == 2 * FOUR_MIB
        assert mem.reserved() == 2 * FOUR_MIB
        small = torch.empty(256, 1024)  # 1 MiB fits in the last 2 MiB segment
        assert mem.reserved() == 10 * MiB
        del a, b, small
        gc.collect()
    assert mem.allocated() == 0


def test_reserved_shrinks_only_on_empty_cache_and_peak_resets_to_now():
    mem = SimulatedDeviceMemory(64 * MiB)
    with mem.meter():
        keep = torch.empty(256, 1024)  # 1 MiB
        tmp = torch.empty(4096, 1024)  # 16 MiB
        del tmp
        gc.collect()
        assert (mem.allocated(), mem.reserved()) == (MiB, 18 * MiB)
        # Freed cache is reused before reserved grows again.
        again = torch.empty(4096, 1024)
        assert mem.reserved() == 18 * MiB
        del again
        gc.collect()
    mem.empty_cache()
    assert mem.reserved() == 2 * MiB  # one segment for the live 1 MiB
    assert mem.peak_reserved() == 18 * MiB
    mem.reset_peak()
    assert mem.peak_reserved() == 2 * MiB
    assert mem.peak_allocated() == MiB
    del keep


def test_synthetic_allocations_and_reservations_share_the_capacity():
    mem = SimulatedDeviceMemory(32 * MiB)
    peer = mem.reserve(20 * MiB, "peer:vit")
    assert mem.free() == 12 * MiB
    assert mem.reserved() == 0  # not this process's caching allocator
    block = mem.allocate_bytes(8 * MiB)
    assert (mem.allocated(), mem.reserved(), mem.free()) == (8 * MiB, 8 * MiB, 4 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match="peer:vit|held elsewhere"):
        mem.allocate_bytes(6 * MiB)
    with pytest.raises(torch.OutOfMemoryError):
        mem.reserve(6 * MiB, "canary")
    block.free()
    assert mem.allocated() == 0
    peer.release()
    assert mem.free() == 32 * MiB - mem.reserved()
    assert mem.reservations() == {}


def test_set_limit_caps_below_capacity():
    mem = SimulatedDeviceMemory(64 * MiB)
    mem.set_limit(6 * MiB)
    mem.allocate_bytes(4 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match="limit 6.00 MiB"):
        mem.allocate_bytes(4 * MiB)


def test_a_failed_multi_output_op_releases_what_it_counted():
    mem = SimulatedDeviceMemory(6 * MiB)
    x = torch.randn(1024, 1024)
    with mem.meter():
        with pytest.raises(torch.OutOfMemoryError):
            torch.sort(x)  # values (4 MiB) fit, indices (8 MiB int64) do not
        gc.collect()
        assert mem.allocated() == 0


def test_device_memory_for_cpu_is_simulated():
    mem = device_memory_for("cpu", simulated_capacity=128 * MiB)
    assert isinstance(mem, SimulatedDeviceMemory)
    assert mem.total() == 128 * MiB
    assert device_memory_for("cpu").total() == host_memory_bytes()
    stats = mem.stats()
    assert stats.total == 128 * MiB and stats.free == 128 * MiB
    with pytest.raises(ValueError, match="expected 'cpu' or 'cuda"):
        device_memory_for("meta")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_memory_reads_the_allocator():
    mem = device_memory_for("cuda:0")
    mem.empty_cache()
    mem.reset_peak()
    before = mem.allocated()
    a = torch.empty(1024, 1024, device="cuda:0")
    assert mem.allocated() - before == FOUR_MIB
    assert mem.peak_reserved() >= mem.reserved() >= mem.allocated()
    assert 0 < mem.free() < mem.total()
    del a
