"""The Monitor's cost per training step under DeepSpeed (ZeRO 0-3, one CPU
rank, gloo), where it reads each gradient from DeepSpeed's partitions
(zeroscan/monitor/grad_source.py), as a share of the same step without a
Monitor, measured in the same run; beside it, plain torch (AdamW, .grad) as
the baseline the Monitor's cost is usually quoted against.

    python benchmarks/bench_frameworks.py [--layers 48] [--width 512] [--steps 30]

Each configuration alternates timed blocks with and without the Monitor
(three of each) and keeps each side's median, so drift in the machine's
speed falls on both. Needs DeepSpeed (the [deepspeed] extra).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599", "RANK": "0", "WORLD_SIZE": "1",
                   "LOCAL_RANK": "0"}.items():
    os.environ.setdefault(key, value)

import zeroscan  # noqa: E402


def model_of(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks)


def timed(step: Callable[[], None], steps: int) -> float:
    """Seconds per step over `steps` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def compare(make: Callable[[bool], Callable[[], None]], steps: int) -> tuple[float, float]:
    """Median seconds per step without and with the Monitor."""
    runs: dict[bool, list[float]] = {False: [], True: []}
    loops = {monitored: make(monitored) for monitored in (False, True)}
    for loop in loops.values():
        timed(loop, 3)  # warm-up
    for _ in range(3):
        for monitored in (False, True):
            runs[monitored].append(timed(loops[monitored], steps))
    return statistics.median(runs[False]), statistics.median(runs[True])


def deepspeed_loop(stage: int, layers: int, width: int) -> Callable[[bool], Callable[[], None]]:
    import deepspeed

    import zeroscan.integrations.deepspeed as zs_deepspeed

    def make(monitored: bool) -> Callable[[], None]:
        model = model_of(layers, width)
        config = {
            "train_micro_batch_size_per_gpu": 32,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
        }
        with contextlib.redirect_stdout(io.StringIO()):
            engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        monitor = zs_deepspeed.monitor(engine) if monitored else None
        x = torch.randn(32, width)

        def step() -> None:
            engine.backward(engine(x).square().mean())
            engine.step()

        step.monitor = monitor  # type: ignore[attr-defined]  # kept alive with the loop
        return step

    return make


def torch_loop(layers: int, width: int) -> Callable[[bool], Callable[[], None]]:
    def make(monitored: bool) -> Callable[[], None]:
        model = model_of(layers, width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        monitor = zeroscan.Monitor(model, opt) if monitored else None
        x = torch.randn(32, width)

        def step() -> None:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        step.monitor = monitor  # type: ignore[attr-defined]
        return step

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    numel = sum(p.numel() for p in model_of(args.layers, args.width).parameters())
    print(f"{2 * args.layers} parameters, {numel:,} elements, batch 32, fp32, {torch.get_num_threads()} threads, "
          f"median of 3 blocks of {args.steps} steps")
    print("| setup | step without | step with | Monitor | Monitor / step |")
    print("|---|---|---|---|---|")
    setups: list[tuple[str, Callable[[bool], Callable[[], None]]]] = [("torch AdamW (.grad)", torch_loop(args.layers, args.width))]
    setups += [(f"DeepSpeed ZeRO-{s}", deepspeed_loop(s, args.layers, args.width)) for s in (0, 1, 2, 3)]
    for name, make in setups:
        without, with_monitor = compare(make, args.steps)
        print(f"| {name} | {without * 1e3:.1f} ms | {with_monitor * 1e3:.1f} ms | "
              f"{(with_monitor - without) * 1e3:+.1f} ms | {100 * (with_monitor - without) / without:+.1f} % |")


if __name__ == "__main__":
    main()
