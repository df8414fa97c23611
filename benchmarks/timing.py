"""The one timer and the shared printing helpers of the benchmark scripts.

Every script imports this module as a sibling (`import timing`): Python puts a
script's own directory first on sys.path, so `python benchmarks/bench_X.py`
finds it from any working directory.

Timing is done in batches of back-to-back calls: a batch is timed as a whole
and divided by its number of calls, so the clock's resolution and the cost of
reading it (and of a device synchronisation) are spread over many calls. Each
script then reduces the batches the way its method asks: the best of them for
CPU ratios measured in the same run (the least disturbed by other processes),
the median for GPU bandwidth and for per-step times across ranks. The clock is
a parameter: bench_monitor reads process CPU time on CPU, so that other
processes sharing the cores do not count.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence

import torch

Clock = Callable[[], float]
Sync = Callable[[], None]


def seconds_per_call(
    fn: Callable[[], object], calls: int = 1, *, clock: Clock = time.perf_counter, sync: Sync | None = None
) -> float:
    """One batch: `calls` back-to-back calls of fn, timed together.

    `sync` runs before the clock is read at both ends, so that work queued
    asynchronously (CUDA kernels) is inside the batch and nothing before it is.
    """
    if sync is not None:
        sync()
    start = clock()
    for _ in range(calls):
        fn()
    if sync is not None:
        sync()
    return (clock() - start) / calls


def time_batches(
    fn: Callable[[], object],
    batches: int,
    *,
    batch_seconds: float | None = None,
    clock: Clock = time.perf_counter,
    sync: Sync | None = None,
    before_batch: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds per call of each of `batches` batches, after one untimed warm-up call.

    A batch is one call, or with `batch_seconds` as many calls as last about
    that long, counted from one timed call after the warm-up. `before_batch`
    runs outside the clock before each batch (a barrier, so that all ranks
    start together).
    """
    fn()  # first-call costs (allocation, dispatch caches, lazy init) are not what is measured
    calls = 1
    if batch_seconds is not None:
        once = max(seconds_per_call(fn, clock=clock, sync=sync), 1e-7)
        calls = max(1, int(batch_seconds / once))
    times = []
    for _ in range(batches):
        if before_batch is not None:
            before_batch()
        times.append(seconds_per_call(fn, calls, clock=clock, sync=sync))
    return times


def best_per_call(fn: Callable[[], object], budget: float, batches: int = 5, *, sync: Sync | None = None) -> float:
    """Best seconds per call over `batches` batches that together last about `budget` seconds."""
    return min(time_batches(fn, batches, batch_seconds=budget / batches, sync=sync))


def best_in_turn(fns: Sequence[Callable[[], object]], budget: float, min_rounds: int = 5) -> list[float]:
    """Best seconds per call of each of `fns`, their batches timed in turn.

    Each round times one batch of every function, one after another, so that
    a ratio between them is taken over the same moments of a machine whose
    speed drifts (other tenants of a VM, the clock frequency). Calls of a
    millisecond or more are batches of one: each then reads its tensor after
    the others have read theirs, so a tensor that the last-level cache could
    hold is read from memory by every call, where back-to-back calls of one
    function would find much of it still cached (a cache of hundreds of MB
    holds a 64M-element float32 tensor). `budget` seconds in all.
    """
    for fn in fns:
        fn()  # first-call costs are not what is measured
    once = [max(seconds_per_call(fn), 1e-7) for fn in fns]
    calls = [1 if t >= 1e-3 else max(1, int(budget / min_rounds / len(fns) / t)) for t in once]
    round_s = sum(c * t for c, t in zip(calls, once))
    rounds = max(min_rounds, min(50, int(budget / round_s)))
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], seconds_per_call(fn, calls[i]))
    return best


def device_sync(device: torch.device) -> Sync | None:
    """What makes a timing of work on `device` complete: None where calls are synchronous."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


def describe_machine(device: torch.device | str = "cpu") -> str:
    """The processor (or GPU) the numbers were taken on, and the torch version."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        gib = props.total_memory / (1 << 30)
        return f"{props.name}, {props.multi_processor_count} SMs, {gib:.0f} GiB, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"{cpu}, {threads} thread{'' if threads == 1 else 's'}, torch {torch.__version__}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms"


def write_json(path: str | None, results: dict[str, object]) -> None:
    """The results of a run as JSON at `path` (the --json option), where one is given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


_START = time.perf_counter()


def progress(text: str) -> None:
    """A line on stderr, stamped with the script and the seconds since it started; stdout keeps only tables."""
    script = os.path.splitext(os.path.basename(sys.argv[0]))[0] or "bench"
    sys.stderr.write(f"[{script} {time.perf_counter() - _START:5.0f} s] {text}\n")
    sys.stderr.flush()


def free_memory() -> None:
    """Drops unreachable objects (hooks and Monitors form reference cycles with
    their models) and hands the CUDA allocator's cached blocks back, so that the
    next section's large tensors fit."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def count_syncs(fn: Callable[[], object]) -> int:
    """Host synchronisations fn() makes on the current CUDA device, counted
    from the warnings of torch.cuda.set_sync_debug_mode("warn"), one per sync."""
    import warnings

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)
