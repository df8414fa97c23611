"""What only the CUDA kernels have: layouts built on the GPU, tile sizes, the
caller's stream, no host sync, CUDA graphs and every visible GPU. Skipped
without CUDA. The tests that hold on every device (dtypes, layouts, sizes,
tol, stats_many) run on CUDA as the "cuda" case of their device
parametrization (helpers.DEVICES), in test_stats.py, test_stats_many.py and
test_distributions.py."""

from __future__ import annotations

import math

import pytest
import torch

import zeroscan
from checklist import Checklist
from helpers import ALL_DTYPES, assert_matches_reference, fresh_generator, make_values, stats_of_row

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
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", GPU_LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_gpu_layouts_match_cpu_and_reference(dtype: torch.dtype, layout: str) -> None:
    """Both sizes, with dense, sparse or no special values, in one case (checklist.py)."""
    g = fresh_generator()
    with Checklist() as checks:
        for specials, every in [("dense", 50), ("sparse", 20_000), ("none", 1)]:
            for n in [300, 70_001]:
                with checks.case(f"{specials} n={n}"):
                    values = make_values(n, dtype, g, specials=specials != "none", every=every).cuda()
                    x = gpu_layout(values, layout)
                    if layout in ("six_dims", "eight_dims") and n >= 70_000:
                        assert not x.is_contiguous()  # the layout under test really is strided on the GPU
                    s = zeroscan.stats(x)
                    assert s.buffer.device == x.device and s.buffer.dtype == torch.int64
                    assert_matches_reference(s, x, same_as_cpu=True)


TILE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float64, torch.int8]
# A tile is max(512 KiB, numel / 8192 positions), at most 2^20 positions
# (kMinTileBytes, kMaxTiles and kMaxTilePositions in csrc/cuda/stats_cuda.cuh).
ONE_TILE_BYTES = 512 << 10
# 2^24 + 5 elements: float64's 257 tiles are more than the 256 threads of the
# block that combines them take in one pass (float32 has 129). Its reference
# takes seconds of CPU time: two dtypes.
MANY_TILES = (1 << 24) + 5


def around_one_tile(dtype: torch.dtype) -> list[int]:
    """One position either side of the dtype's smallest tile, and well above it
    (3,000,017: several tiles in every dtype)."""
    tile = ONE_TILE_BYTES // dtype.itemsize
    return [tile - 1, tile, tile + 1, 3_000_017]


@pytest.mark.parametrize(
    ("sizes", "dtype"),
    [pytest.param(around_one_tile(dtype), dtype, id=f"{dtype}-around_one_tile") for dtype in TILE_DTYPES]
    + [pytest.param([MANY_TILES], dtype, id=f"{dtype}-{MANY_TILES}") for dtype in (torch.float32, torch.float64)],
)
def test_multi_tile_sizes(sizes: list[int], dtype: torch.dtype) -> None:
    # Several blocks per tensor and the last-block combine.
    g = fresh_generator()
    with Checklist() as checks:
        for n in sizes:
            with checks.case(f"n={n}"):
                x = make_values(n, dtype, g, every=5_000).cuda()
                s = zeroscan.stats(x)
                assert_matches_reference(s, x, same_as_cpu=True)
                assert torch.equal(zeroscan.stats(x).buffer, s.buffer)  # bitwise repeatable


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
        assert_matches_reference(stats_of_row(one, big), big)
        for row, x in enumerate([big, small, strided]):
            assert_matches_reference(stats_of_row(many[row], x), x)
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


def assert_same_reference(got: dict, want: dict, x: torch.Tensor) -> None:
    """Counts and extremes equal; the float64 moments, which the GPU sums in
    another order, equal to 1e-12 of the data's largest finite |x| (times
    numel for the sum; on an H200, std and norm differed in the last bit)."""
    xd = x.cpu().double()
    finite = xd[torch.isfinite(xd)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    assert got.keys() == want.keys()
    for field, value in want.items():
        if math.isnan(value):
            assert math.isnan(got[field]), field
        elif field in ("mean", "std"):
            assert math.isclose(got[field], value, rel_tol=1e-12, abs_tol=1e-12 * scale), field
        elif field in ("norm", "sum"):
            assert math.isclose(got[field], value, rel_tol=1e-12, abs_tol=1e-12 * scale * x.numel()), field
        else:
            assert got[field] == value, field


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_the_reference_takes_cuda_tensors(dtype: torch.dtype) -> None:
    # zeroscan.reference_stats is public: a CUDA tensor gets the float64
    # answer of its CPU copy, computed where it lives.
    x = make_values(4099, dtype, fresh_generator()).cuda()
    assert_same_reference(zeroscan.reference_stats(x), zeroscan.reference_stats(x.cpu()), x)
