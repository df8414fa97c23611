"""Hooks and fixtures shared by test modules (the rest of the shared harness is helpers.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker takes its share of the CPUs for torch's
    own threads (unless OMP_NUM_THREADS chose), before any test module is
    imported. Each worker would otherwise start as many threads as the machine
    has cores, and busy-waiting threads of several workers on the same cores
    make every parallel op wait for a descheduled thread: on 2 cores, the CPU
    twins of the CUDA tests took 104-111 s on 4 workers of 2 threads, 27-28 s
    on 4 workers of 1. (The GPU job runs 4 workers on 16 cores.)"""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        share = max(1, cpus // workers)
        torch.set_num_threads(min(torch.get_num_threads(), share))


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Small models train far faster on one thread on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
