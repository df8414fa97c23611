"""stats() allocates nothing proportional to numel and never copies its input."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import zeroscan

N = 1 << 22  # 16 MiB of float32


def allocated_bytes(fn) -> int:
    """Largest single CPU allocation made by torch while fn runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x,
        lambda x: x.reshape(1024, -1).t(),
        lambda x: x[::2],
        lambda x: x.reshape(2048, -1)[:, 3:-5],
        lambda x: x[: N // 64].reshape(1, -1).expand(64, -1),
    ],
    ids=["contiguous", "transposed", "sliced", "short_rows", "expanded"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32])
def test_no_allocation_proportional_to_numel(view, dtype: torch.dtype) -> None:
    x = view(torch.randn(N).to(dtype))
    assert x.numel() >= N // 2
    biggest = allocated_bytes(lambda: zeroscan.stats(x))
    assert 0 < biggest <= 4096, f"stats() allocated {biggest} bytes for a {x.numel()}-element input"


def test_copying_would_be_caught() -> None:
    # The measurement itself works: a copy of the input shows up.
    x = torch.randn(N).reshape(1024, -1).t()
    assert allocated_bytes(lambda: x.contiguous()) >= 4 * N


def test_stats_many_allocates_one_small_buffer() -> None:
    xs = [torch.randn(4096) for _ in range(200)]
    biggest = allocated_bytes(lambda: zeroscan.stats_many(xs))
    assert biggest <= 200 * 16 * 8
