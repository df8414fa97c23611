"""Overhead of zeroscan.Monitor(every=1) on a real training step.

A small transformer language model (nn.TransformerEncoderLayer blocks, AdamW,
gradient clipping) is trained with and without a Monitor attached, in
interleaved rounds so that both see the same machine load; the median step
time of each is compared. Targets: <= 5 % on CPU, <= 2 % on GPU.

    python benchmarks/bench_monitor.py                 # CPU
    python benchmarks/bench_monitor.py --device cuda   # GPU, where one is at hand
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import zeroscan
from timing import device_sync, seconds_per_call
from zeroscan.monitor.deferred import witness_of


class SmallLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(0.02 * torch.randn(length, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation=nn.GELU(), batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable timings)")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and configuration")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = SmallLM(args.vocab, args.width, args.layers, args.heads, args.length).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, args.vocab, (args.batch, args.length + 1), device=device)
    n_params = sum(p.numel() for p in model.parameters())

    sync = device_sync(device)
    # On CPU the clock is this process's CPU time, so other processes sharing
    # the cores do not count; on GPU it is wall time around synchronisation.
    clock = time.perf_counter if device.type == "cuda" else time.process_time

    def step() -> None:
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), data[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def train(steps: int) -> float:
        return seconds_per_call(step, steps, clock=clock, sync=sync)

    configs = {
        "plain": lambda: None,
        "monitor": lambda: zeroscan.Monitor(model, opt, every=1),
        "monitor+activations": lambda: zeroscan.Monitor(model, opt, every=1, activations=True),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    train(3)  # warm-up
    for name, make in configs.items():  # warm each path once (the first Monitor step also probes)
        mon = make()
        train(2)
        if mon is not None:
            mon.close()
    report_ms = []
    for r in range(args.rounds):
        order = list(configs.items())
        for name, make in order if r % 2 == 0 else reversed(order):  # ABC CBA: no position bias
            mon = make()
            times[name].append(train(args.steps))
            if mon is not None:
                report_ms.append(1e3 * seconds_per_call(mon.report))
                mon.close()

    # The Monitor's own work per step, timed alone on the gradients of the last
    # step, without the noise of a whole training step around it: what it reads
    # when backward ends (the witness, a few gradients' first values, once the
    # Monitor has seen the loop let its gradients go: zeroscan/monitor/deferred.py)
    # and the scan of every gradient and weight that the optimizer hook runs.
    mon = zeroscan.Monitor(model, every=1)
    mon.step()  # the first monitored step also probes the forward pass
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    slots = [2 * k for k in range(len(grads))]
    backward_ms = 1e3 * seconds_per_call(lambda: witness_of(grads, slots), 50, clock=clock, sync=sync)
    scan_ms = backward_ms + 1e3 * seconds_per_call(mon.step, 50, clock=clock, sync=sync)
    mon.close()

    clock_name = "wall time" if device.type == "cuda" else "process CPU time"
    print(f"device={device} threads={torch.get_num_threads()} clock={clock_name} params={n_params / 1e6:.2f}M "
          f"tokens/step={args.batch * args.length} rounds={args.rounds} x {args.steps} steps")
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        med = statistics.median(ts)
        paired = statistics.median(t / p for t, p in zip(ts, times["plain"]))
        extra = "" if name == "plain" else (
            f"  overhead {100 * (med / base - 1):+.2f} % (medians), {100 * (paired - 1):+.2f} % (paired rounds), "
            f"{100 * (min(ts) / min(times['plain']) - 1):+.2f} % (bests)"
        )
        print(f"{name:>20}: {1e3 * med:8.2f} ms/step (best {1e3 * min(ts):.2f}){extra}")
    print(f"{'scans alone':>20}: {scan_ms:8.2f} ms/step = {100 * scan_ms / (1e3 * base):.2f} % of the median plain step "
          f"({backward_ms:.3f} ms when backward ends: the witness; the rest at the optimizer step)")
    print(f"{'report()':>20}: {statistics.median(report_ms):8.2f} ms (not part of a step; run when reading)")


if __name__ == "__main__":
    main()
