"""What Monitor.report() costs on a model of many small parameters.

A model of `--params` small parameters (an nn.ParameterList of tensors of 3
to 64 values) is trained for `--steps` monitored steps (SGD, every=1, the
default history of 64 steps), then report() is called once. Printed: its
time (wall and process CPU), the Python memory it allocates at its peak
(tracemalloc, in a separate run: tracing slows Python down), and the growth
of the process's peak resident memory over the call (VmHWM of
/proc/self/status, reset just before it), and the training step's time with
and without the Monitor. Each figure is the best of `--repeat` runs; run on a
quiet machine, or read them as upper bounds.

    python benchmarks/monitor_report.py                      # 10k parameters x 64 steps
    python benchmarks/monitor_report.py --params 1000 --repeat 1
    python benchmarks/monitor_report.py --zero-half        # every other gradient exactly zero

--zero-half gives every other parameter an exactly zero gradient at every
step (its slice of the input is 0): the worst case for report(), which then
looks for why each of them is zero (hooks, the loss's wiring, Functions on
the way: one walk of the autograd graph) and gathers them into one finding.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable

import torch
from torch import nn

import zeroscan
from zeroscan.words import count_noun
from timing import describe_machine, progress

SIZES = (3, 8, 17, 64)  # values per parameter, in turn


class ManyParams(nn.Module):
    """`n` small parameters; the loss is the sum of squares of all of them
    times the input (times 0 for every other parameter with zero_half)."""

    def __init__(self, n: int, zero_half: bool = False) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(SIZES[k % len(SIZES)])) for k in range(n))
        self.width = sum(p.numel() for p in self.params)
        mask = [float(not (zero_half and k % 2)) for k, p in enumerate(self.params) for _ in range(p.numel())]
        self.register_buffer("mask", torch.tensor(mask))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([p.reshape(-1) for p in self.params])
        return (flat * x * self.mask).square().sum()


def peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current resident size (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trained(n: int, steps: int, monitored: bool, zero_half: bool = False) -> tuple[zeroscan.Monitor | None, float]:
    """A model trained `steps` steps (under a Monitor when `monitored`) and
    the best process CPU seconds of one of its steps after the first."""
    torch.manual_seed(0)
    model = ManyParams(n, zero_half)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = zeroscan.Monitor(model, opt) if monitored else None
    best = float("inf")
    for k in range(steps):
        x = torch.randn(model.width)
        start = time.process_time()
        opt.zero_grad()
        model(x).backward()
        opt.step()
        if k:
            best = min(best, time.process_time() - start)
    return monitor, best


def measure(fn: Callable[[], object]) -> tuple[float, float, int]:
    """Wall seconds, process CPU seconds, and the peak-RSS growth (KiB, -1 if unknown) of one call."""
    can_reset = reset_peak_rss()
    before = peak_rss_kib()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, peak_rss_kib() - before if can_reset else -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable timings)")
    parser.add_argument("--zero-half", action="store_true", help="every other gradient exactly zero (see the doc)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    walls, cpus, rss, traced, step_plain, step_monitored = [], [], [], [], [], []
    findings = detailed = 0
    for r in range(args.repeat):
        progress(f"run {r + 1}/{args.repeat}: training {args.params} parameters for {args.steps} steps")
        _, plain = trained(args.params, args.steps, monitored=False, zero_half=args.zero_half)
        monitor, with_monitor = trained(args.params, args.steps, monitored=True, zero_half=args.zero_half)
        assert monitor is not None
        step_plain.append(plain)
        step_monitored.append(with_monitor)
        wall, cpu, grown = measure(monitor.report)
        walls.append(wall)
        cpus.append(cpu)
        rss.append(grown)
        monitor.close()
        del monitor
        progress(f"run {r + 1}/{args.repeat}: report() {wall:.3f} s; a second run under tracemalloc")
        monitor, _ = trained(args.params, args.steps, monitored=True, zero_half=args.zero_half)
        assert monitor is not None
        tracemalloc.start()
        report = monitor.report()
        traced.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        findings, detailed = len(report.findings), len(report.detailed)
        monitor.close()
        del monitor, report

    print(f"machine: {describe_machine()}")
    print(f"model: {args.params} parameters of {'/'.join(map(str, SIZES))} values, {args.steps} monitored steps, "
          f"{count_noun(findings, 'finding')} ({detailed} about one tensor each, grouped by root cause); "
          f"best of {args.repeat} runs")
    print()
    print("| measure | value |")
    print("|---|---|")
    print(f"| report() wall time | {min(walls):.3f} s |")
    print(f"| report() process CPU time | {min(cpus):.3f} s |")
    print(f"| report() peak Python memory (tracemalloc) | {min(traced) / 2**20:.1f} MiB |")
    grown = "n/a (cannot reset VmHWM)" if min(rss) < 0 else f"{min(rss) / 1024:.1f} MiB"
    print(f"| report() peak-RSS growth | {grown} |")
    print(f"| training step, no Monitor (CPU time) | {1e3 * min(step_plain):.1f} ms |")
    print(f"| training step, Monitor every=1 (CPU time) | {1e3 * min(step_monitored):.1f} ms |")


if __name__ == "__main__":
    main()
