"""zeroscan.stats_many: one call for many tensors, equal to one stats() each."""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import pytest
import torch

import zeroscan
from helpers import ALL_DTYPES, DEVICES, assert_matches_reference, fresh_generator, make_values


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_sizes_and_layouts_match_single_calls(device: str) -> None:
    # More tensors than one CUDA launch carries; sizes from empty to several
    # CUDA tiles; contiguous, strided and column-sliced; specials dense or sparse.
    g = fresh_generator()
    tensors = []
    for i in range(300):
        dtype = ALL_DTYPES[i % len(ALL_DTYPES)]
        n = int(torch.randint(0, 90_000, (), generator=g)) if i % 7 and i % 11 else 0
        if i % 37 == 5:
            n = 1_000_003
        x = make_values(n, dtype, g, every=50 if i % 2 else 500).to(device)
        if i % 3 == 1 and n >= 4:
            x = x[::2]
        elif i % 5 == 2 and n >= 8:
            x = x[: n // 4 * 4].reshape(-1, 4)[:, 1:3]
        tensors.append(x)
    batch = zeroscan.stats_many(tensors)
    assert len(batch) == len(tensors)
    for x, s in zip(tensors, batch):
        assert torch.equal(s.buffer, zeroscan.stats(x).buffer)  # bitwise the same row
        assert_matches_reference(s, x)
    again = zeroscan.stats_many(tensors)
    assert torch.equal(batch[0]._readout.buffer, again[0]._readout.buffer)  # every row, bitwise repeatable


@pytest.mark.parametrize("device", DEVICES)
def test_tol_applies_to_every_tensor(device: str) -> None:
    g = fresh_generator()
    tensors = [make_values(1000, dtype, g).to(device) for dtype in (torch.float32, torch.bfloat16, torch.int16)]
    for s, x in zip(zeroscan.stats_many(tensors, tol=0.5), tensors):
        assert_matches_reference(s, x, tol=0.5)


def test_one_native_call_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = torch.ops.zeroscan.stats_many.default

    def counting(xs, tol=None):
        calls.append(len(xs))
        return real(xs, tol)

    monkeypatch.setattr(torch.ops.zeroscan.stats_many, "default", counting)
    g = fresh_generator()
    tensors = [torch.randn(int(torch.randint(1, 5000, (), generator=g)), generator=g) for _ in range(200)]
    batch = zeroscan.stats_many(tensors)
    assert calls == [200]
    assert batch[17].numel == tensors[17].numel()


def test_batch_indexes_like_a_list() -> None:
    xs = [torch.zeros(3), torch.ones(4), torch.full((5,), -2.0)]
    batch = zeroscan.stats_many(x for x in xs)  # any iterable
    assert [s.numel for s in batch] == [3, 4, 5]
    assert [s.zeros for s in batch[1:]] == [0, 0]
    assert batch[-1].negative == 5 and batch[0].zeros == 3
    assert len(batch.to_dicts()) == 3
    assert len(zeroscan.stats_many([])) == 0


def python_blocks_kept(count: int) -> int:
    """Python memory blocks (tracemalloc) that stats_many of `count` small
    tensors leaves allocated while its result is held, none of its Stats made."""
    xs = [torch.randn(256) for _ in range(count)]
    zeroscan.stats_many(xs)  # first-call caches are not the call's own
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        batch = zeroscan.stats_many(xs)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert len(batch) == count
    return sum(d.count_diff for d in after.compare_to(before, "filename"))


def test_the_call_keeps_no_python_object_per_tensor() -> None:
    # The Python work of stats_many must not grow per tensor: that work is
    # what makes 2,000 small tensors cost several flat scans of the same
    # bytes on a GPU (benchmarks/bench_many_small.py). A per-tensor object
    # (a metadata tuple, a shape, a Stats) kept before anything is indexed
    # would add thousands of blocks here; a list of N slots is one block.
    few, many = python_blocks_kept(50), python_blocks_kept(2000)
    assert many - few <= 20, f"{few} blocks kept for 50 tensors, {many} for 2,000"


def test_each_stats_takes_its_tensors_metadata_and_the_batch_then_lets_go() -> None:
    xs = [torch.zeros(3, 2, dtype=torch.bfloat16), torch.ones(4, dtype=torch.int8).t(), torch.randn(2, 1, 5)]
    batch = zeroscan.stats_many(xs)
    kept = [weakref.ref(x) for x in xs]
    want = [(x.dtype, x.shape, x.device) for x in xs]
    xs.clear()  # the caller's list reused: the batch holds its own
    assert [(s.dtype, s.shape, s.device) for s in batch[:2]] == want[:2]
    assert (batch[2].dtype, batch[2].shape, batch[2].device) == want[2]
    gc.collect()
    assert [ref() for ref in kept] == [None] * 3  # every Stats made: the tensors are let go
    assert [s.numel for s in batch] == [6, 4, 10]
