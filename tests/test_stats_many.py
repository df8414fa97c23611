"""zeroscan.stats_many: one call for many tensors, equal to one stats() each."""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import numpy
import pytest
import torch

import zeroscan
from zeroscan.mapped_reads import maybe_mapped
from dispatch_probes import FunctionsSeen, LoggedTensor, OpsSeen
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


def test_one_native_call_per_device() -> None:
    g = fresh_generator()
    tensors = [torch.randn(int(torch.randint(1, 5000, (), generator=g)), generator=g) for _ in range(200)]
    with OpsSeen() as seen:
        batch = zeroscan.stats_many(tensors)
    assert seen.ops == ["zeroscan.stats_many.default"], seen.ops
    assert batch[0]._readout.buffer.shape[0] == 200  # that one call's rows
    assert batch[17].numel == tensors[17].numel()


@pytest.mark.parametrize("histogram", [False, True])
@pytest.mark.parametrize("tol", [None, 0.25])
def test_plain_cpu_tensors_call_the_operator_from_cpp(histogram: bool, tol: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A list of plain CPU tensors (Parameters among them) reaches the operator
    # through zeroscan.ops.stats_many_call, not torch.ops: once, the rows and
    # fields torch.ops gives, and still the dispatcher's call, which dispatch
    # modes see.
    answered = []
    native = zeroscan.ops.stats_many_call

    def counting(*args: object) -> object:
        out = native(*args)
        answered.append(out is not None)
        return out

    monkeypatch.setattr(zeroscan.ops, "stats_many_call", counting)
    g = fresh_generator()
    tensors = [make_values(int(torch.randint(1, 9000, (), generator=g)), ALL_DTYPES[i % len(ALL_DTYPES)], g) for i in range(40)]
    tensors[3] = torch.nn.Parameter(make_values(777, torch.float32, g))
    tensors[5] = tensors[5][::3]
    name = "stats_many_hist" if histogram else "stats_many"
    with OpsSeen() as seen:
        batch = zeroscan.stats_many(tensors, tol=tol, histogram=histogram)
    assert answered == [True]
    assert seen.ops == [f"zeroscan.{name}.default"], seen.ops
    direct = getattr(torch.ops.zeroscan, name).default(tensors, tol)
    readout = batch[0]._readout
    assert torch.equal(readout.buffer, direct[0] if histogram else direct)
    if histogram:
        assert torch.equal(readout.fields, direct[1])
    for x, s in zip(tensors, batch):
        assert_matches_reference(s, x.detach(), tol=tol)


def test_other_lists_still_take_torch_ops() -> None:
    # The C++ call skips __torch_function__: a list holding a tensor subclass
    # that defines it, and any list under a TorchFunctionMode, go through
    # torch.ops, which calls it. A meta tensor does too (the C++ call takes
    # CPU tensors only), and still reaches the fake kernel.
    g = fresh_generator()
    xs = [make_values(300, torch.float32, g), make_values(500, torch.bfloat16, g)]
    for logged in (0, 1):  # the first item or the last
        LoggedTensor.calls = []
        items = [x.as_subclass(LoggedTensor) if i == logged else x for i, x in enumerate(xs)]
        batch = zeroscan.stats_many(items)
        assert "zeroscan.stats_many.default" in LoggedTensor.calls, LoggedTensor.calls
        for s, x in zip(batch, xs):
            assert_matches_reference(s, x)
    with FunctionsSeen() as mode:
        batch = zeroscan.stats_many(xs)
    assert "zeroscan.stats_many.default" in mode.funcs, mode.funcs
    for s, x in zip(batch, xs):
        assert_matches_reference(s, x)
    assert zeroscan._C.stats_many_call([xs[0], torch.empty(3, device="meta")], None, False) is None
    assert zeroscan._C.stats_many_call([xs[0], None], None, False) is None


def test_refusals_name_the_tensor_by_either_route() -> None:
    # Errors the kernel raises through the C++ call are the RuntimeErrors of
    # torch.ops, which stats_many turns into its one-line refusal.
    with pytest.raises(RuntimeError, match=r"zeroscan.stats_many: tensors\[1\] is complex"):
        zeroscan.stats_many([torch.ones(3), torch.ones(3, dtype=torch.complex64)])
    with pytest.raises(RuntimeError, match=r"xs\[1\]"):
        zeroscan._C.stats_many_call([torch.ones(3), torch.ones(3, dtype=torch.complex64)], None, False)
    with pytest.raises(TypeError, match="stats_many_call: takes"):
        zeroscan._C.stats_many_call((torch.ones(3),), None, False)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("histogram", [False, True])
def test_the_batch_keeps_no_tensor_and_reports_each_as_it_was_called(device: str, histogram: bool) -> None:
    # A batch kept in a log must not keep a model's gradients alive, and a
    # tensor changed in place after the call keeps the dtype and shape it was
    # scanned with.
    shapes = [(3, 2), (), (0,), (2, 1, 5), (1, 1, 1, 1, 7), (4,)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.int8, torch.float32]
    xs = [torch.randn(shape).to(device, dtype) for shape, dtype in zip(shapes, dtypes)]
    xs[-1] = torch.nn.Parameter(xs[-1])  # a tensor subclass
    xs.append(torch.randn(4, 6, device=device).t())  # a strided view
    want = [(x.dtype, x.shape, x.device) for x in xs]
    references = [zeroscan.reference_stats(x) for x in xs]
    batch = zeroscan.stats_many(xs, histogram=histogram)
    kept = [weakref.ref(x) for x in xs]
    xs[0].resize_(7)  # changed in place before its Stats is made
    xs.clear()
    gc.collect()
    assert [ref() for ref in kept] == [None] * len(kept)
    assert [(s.dtype, s.shape, s.device) for s in batch] == want
    assert [s.numel for s in batch] == [r["numel"] for r in references]
    assert [s.negative for s in batch] == [r["negative"] for r in references]


def test_the_native_metadata_reader_declines_what_it_cannot_read() -> None:
    # The native reader declines anything but plain tensors; the Python
    # reader then takes the metadata, with the same results.
    import zeroscan._C

    xs = [torch.randn(3), torch.randn(2, 2)]
    assert zeroscan._C.tensor_metas([xs[0], object()]) is None
    dtypes, words, foreign = zeroscan._C.tensor_metas(xs)
    assert dtypes == [torch.float32, torch.float32]
    assert len(words) == 8 * (3 + 3)  # 3 offsets, then 3, 2, 2
    assert foreign is False
    # A CPU tensor of memory torch did not allocate (a numpy array here; a
    # file mapping in earnest) is flagged, as mapped_reads.maybe_mapped does.
    borrowed = torch.from_numpy(numpy.ones(4, dtype=numpy.float32))
    assert maybe_mapped(borrowed)
    assert zeroscan._C.tensor_metas([*xs, borrowed])[2] is True
    assert zeroscan._C.tensor_metas([borrowed[1:], *xs])[2] is True
    with pytest.raises(TypeError, match="xs must be a list, got tuple"):
        zeroscan._C.tensor_metas(tuple(xs))
