"""The CUDA kernels: the same statistics as the CPU path and the float64
reference, on the caller's stream, with no host sync, inside CUDA graphs and
on every visible GPU. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

import zeroscan
from helpers import (
    ALL_DTYPES,
    COUNT_FIELDS,
    EXACT_FLOAT_FIELDS,
    FLOAT_DTYPES,
    assert_matches_reference,
    close,
    fresh_generator,
    make_values,
    rtol_for,
)
from test_stats import LAYOUTS, in_layout
from zeroscan.stats import Readout, Stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Layouts only a GPU test needs on top of test_stats.LAYOUTS.
GPU_LAYOUTS = ["misaligned", "six_dims", "eight_dims"]


def gpu_layout(values: torch.Tensor, layout: str) -> torch.Tensor:
    """`values` (already on the GPU) viewed in `layout`, never copied.
    (Tensor.to(device) would make non-dense views contiguous, so layouts are
    built on the device.)"""
    n = values.numel()
    if layout == "misaligned":  # the data pointer is off a 16-byte boundary
        return values[1:] if n >= 2 else values
    if layout in ("six_dims", "eight_dims"):
        # Every dimension sliced ::2, so none merge: six are walked in place,
        # eight exceed what the kernels walk and are scanned from a copy.
        dims = 6 if layout == "six_dims" else 8
        inner = max(2, n // (2 * 4 ** (dims - 1)))
        shape = [4] * (dims - 1) + [2 * inner]
        if math.prod(shape) > n:
            return values
        view = values[: math.prod(shape)].reshape(shape)
        return view[tuple(slice(None, None, 2) for _ in range(dims))]
    return in_layout(values, layout)


def assert_same_as_cpu(s: zeroscan.Stats, x: torch.Tensor, tol: float | None = None) -> None:
    """Counts and min/max |x| equal the CPU path's exactly; the moments agree
    to the dtype's accuracy."""
    got = s.to_dict()
    want = zeroscan.stats(x.cpu(), tol=tol).to_dict()
    for field in COUNT_FIELDS:
        assert got[field] == want[field], f"{field}: cuda {got[field]}, cpu {want[field]}"
    for field in EXACT_FLOAT_FIELDS:
        g, w = got[field], want[field]
        assert (math.isnan(g) and math.isnan(w)) or g == w, f"{field}: cuda {g!r}, cpu {w!r}"
    finite = x.detach().cpu().reshape(-1).to(torch.float64)
    finite = finite[finite.isfinite()]
    scale = float(finite.abs().mean()) if finite.numel() else 0.0
    rtol = rtol_for(x.dtype)
    for field in ("mean", "std", "norm", "sum"):
        field_scale = scale * max(1, want["finite"]) if field == "sum" else scale
        assert close(got[field], want[field], rtol, field_scale), f"{field}: cuda {got[field]!r}, cpu {want[field]!r}"


def stats_of_buffer(buffer: torch.Tensor, x: torch.Tensor) -> zeroscan.Stats:
    return Stats(Readout(buffer), 0, x.dtype, x.shape, x.device, None)


@pytest.mark.parametrize("layout", LAYOUTS + GPU_LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("specials", ["dense", "sparse", "none"])
@pytest.mark.parametrize("n", [300, 70_001])
def test_matches_cpu_and_reference(n: int, specials: str, dtype: torch.dtype, layout: str) -> None:
    g = fresh_generator()
    every = {"dense": 50, "sparse": 20_000, "none": 1}[specials]
    values = make_values(n, dtype, g, specials=specials != "none", every=every).cuda()
    x = gpu_layout(values, layout)
    if layout in ("transposed", "sliced", "short_rows", "six_dims", "eight_dims") and n >= 70_000:
        assert not x.is_contiguous()  # the layout under test really is strided on the GPU
    s = zeroscan.stats(x)
    assert s.buffer.device == x.device and s.buffer.dtype == torch.int64
    assert_matches_reference(s, x)
    assert_same_as_cpu(s, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float64, torch.int8])
@pytest.mark.parametrize("n", [65_535, 65_536, 65_537, 3_000_017, (1 << 24) + 5])
def test_multi_tile_sizes(n: int, dtype: torch.dtype) -> None:
    # Around and well above the smallest tile: several blocks per tensor and
    # the last-block combine.
    g = fresh_generator()
    x = make_values(n, dtype, g, every=5_000).cuda()
    s = zeroscan.stats(x)
    assert_matches_reference(s, x)
    assert_same_as_cpu(s, x)
    assert torch.equal(zeroscan.stats(x).buffer, s.buffer)  # bitwise repeatable


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_large_mean_tiny_spread(dtype: torch.dtype) -> None:
    g = fresh_generator()
    x = (1000 + 1e-3 * torch.randn(3_000_017, generator=g, dtype=torch.float64)).to(dtype).cuda()
    assert_matches_reference(zeroscan.stats(x), x)


def test_empty_scalar_and_tol() -> None:
    g = fresh_generator()
    for dtype in ALL_DTYPES:
        for shape in [(0,), (3, 0)]:
            e = torch.empty(shape, dtype=dtype, device="cuda")
            s = zeroscan.stats(e)
            assert_matches_reference(s, e)
            assert s.numel == 0 and s.min_abs_nonzero == math.inf
        scalar = make_values(1, dtype, g, specials=False).reshape(()).cuda()
        assert_matches_reference(zeroscan.stats(scalar), scalar)
    x = make_values(5000, torch.float32, g).cuda()
    for tol in [0.0, 1e-3, 1 / 3, math.inf]:
        s = zeroscan.stats(x, tol=tol)
        assert_matches_reference(s, x, tol=tol)
        assert_same_as_cpu(s, x, tol=tol)


def test_stats_many_rows_equal_single_calls_bitwise() -> None:
    # More tensors than one launch carries (contiguous and strided), mixed
    # dtypes and sizes from empty to several tiles.
    g = fresh_generator()
    tensors = []
    for i in range(300):
        dtype = ALL_DTYPES[i % len(ALL_DTYPES)]
        n = int(torch.randint(0, 20_000, (), generator=g)) if i % 11 else 0
        if i % 37 == 5:
            n = 1_000_003
        x = make_values(n, dtype, g, every=500).cuda()
        if i % 3 == 1 and n >= 4:
            x = x[::2]
        elif i % 5 == 2 and n >= 8:
            x = x[: n // 4 * 4].reshape(-1, 4)[:, 1:3]
        tensors.append(x)
    batch = zeroscan.stats_many(tensors)
    for x, s in zip(tensors, batch):
        assert torch.equal(s.buffer, zeroscan.stats(x).buffer)
        assert_matches_reference(s, x)
    again = zeroscan.stats_many(tensors)
    assert torch.equal(batch[0]._readout.buffer, again[0]._readout.buffer)


def test_runs_on_the_current_stream() -> None:
    # The fill is queued behind a long sleep on a side stream; a scan on any
    # other stream would race it and see the old values.
    g = fresh_generator()
    x = make_values(1 << 22, torch.float32, g, specials=False).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.fill_(-2.5)
        s = zeroscan.stats(x)
        batch = zeroscan.stats_many([x, x[::3]])
        assert s.buffer.device == x.device
    side.synchronize()
    for result in (s, batch[0], batch[1]):
        assert result.negative == result.numel and result.min_abs == 2.5 and result.max_abs == 2.5
        assert result.mean == -2.5 and result.std == 0.0


def test_no_host_sync() -> None:
    g = fresh_generator()
    xs = [make_values(n, dtype, g).cuda() for n, dtype in [(4099, torch.float32), (3_000_017, torch.bfloat16), (7, torch.int32)]]
    xs.append(xs[0][::2])
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        single = zeroscan.stats(xs[1])
        batch = zeroscan.stats_many(xs)
        raw = torch.ops.zeroscan.stats_many.default(xs, 0.5)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert_matches_reference(single, xs[1])
    for s, x in zip(batch, xs):
        assert_matches_reference(s, x)
    assert raw.shape == (len(xs), 16) and raw.device == xs[0].device


def test_cuda_graph_capture_and_replay_with_new_data() -> None:
    g = fresh_generator()
    big = make_values(3_000_017, torch.float32, g).cuda()  # several tiles
    small = make_values(4099, torch.bfloat16, g).cuda()
    strided = make_values(20_000, torch.float16, g).cuda()[::2]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        zeroscan.stats(big)
        zeroscan.stats_many([big, small, strided])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one = torch.ops.zeroscan.stats.default(big, None)
        many = torch.ops.zeroscan.stats_many.default([big, small, strided], None)
    for _ in range(2):
        big.copy_(make_values(big.numel(), torch.float32, g).cuda())
        small.copy_(make_values(small.numel(), torch.bfloat16, g).cuda())
        strided.copy_(make_values(strided.numel(), torch.float16, g).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(stats_of_buffer(one, big), big)
        for row, x in enumerate([big, small, strided]):
            assert_matches_reference(stats_of_buffer(many[row], x), x)
        assert torch.equal(one, zeroscan.stats(big).buffer)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_every_device() -> None:
    g = fresh_generator()
    with torch.cuda.device(0):  # the current device is not the tensors' one
        for index in range(torch.cuda.device_count()):
            device = torch.device("cuda", index)
            x = make_values(1_000_003, torch.float32, g).to(device)
            s = zeroscan.stats(x)
            assert s.buffer.device == device
            assert_matches_reference(s, x)
        xs = [make_values(5000, torch.bfloat16, g).to(f"cuda:{i % 2}") for i in range(6)]
        batch = zeroscan.stats_many(xs)
        for x, s in zip(xs, batch):
            assert s.buffer.device == x.device
            assert_matches_reference(s, x)
    with pytest.raises(RuntimeError, match="same device"):
        torch.ops.zeroscan.stats_many.default([xs[0], xs[1]], None)


def test_mixed_devices_in_one_native_call() -> None:
    x = torch.ones(10, device="cuda")
    with pytest.raises(RuntimeError, match=r"same device; xs\[0\] is on cuda:\d but xs\[1\] is on cpu"):
        torch.ops.zeroscan.stats_many.default([x, torch.ones(3)], None)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_never_writes_into_the_input(dtype: torch.dtype) -> None:
    g = fresh_generator()
    x = make_values(200_000, dtype, g).cuda()
    before = x.view(torch.uint8).clone()
    zeroscan.stats(x)
    zeroscan.stats_many([x, x[::3], x[1:]])
    assert torch.equal(before, x.view(torch.uint8))


@pytest.mark.slow
def test_more_than_2_pow_31_elements() -> None:
    # int64 positions: a real 2**31 + 4099-element int8 tensor (2 GiB).
    n = (1 << 31) + 4099
    try:
        x = torch.randint(-100, 101, (n,), dtype=torch.int8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 2 GiB tensor")
    x[-1] = 127
    x[-2] = 0
    s = zeroscan.stats(x)
    assert s.numel == n
    assert s.zeros == int((x == 0).sum())
    assert s.negative == int((x < 0).sum())
    assert s.max_abs == 127.0 and s.min_abs == 0.0
    total = float(x.sum(dtype=torch.float64))
    assert math.isclose(s.sum, total, rel_tol=1e-12, abs_tol=1e-6 * n)
    # An expanded view: 2**33 positions read from a 2**23-element base.
    base = torch.randn(1 << 23, device="cuda")
    e = base.expand(1 << 10, -1)
    se = zeroscan.stats(e)
    sb = zeroscan.stats(base)
    assert se.numel == (1 << 33) and se.negative == sb.negative << 10
    assert math.isclose(se.std, sb.std, rel_tol=1e-6) and se.max_abs == sb.max_abs
