"""What Monitor(trace_nonfinite=True) costs per training step, against the
tools people use to find where a NaN was born.

A 12-layer GPT-2-small-shaped language model (width 768, 12 heads, 4x MLP,
vocabulary 50257, tied embeddings, dropout modules; about 124M parameters)
trains with AdamW in interleaved rounds (ABC CBA) under each configuration:

    plain                  no instrumentation
    trace                  Monitor(every=10**9, trace_nonfinite=True): the
                           trace at every step, the Monitor's scans at step 0 only
    monitor                Monitor(every=1)
    monitor+trace          Monitor(every=1, trace_nonfinite=True)
    detect_anomaly         torch.autograd.detect_anomaly() around forward and backward
    hf_hooks               a forward hook on every module that reads
                           isnan().any() and abs().max() of each output (the
                           kind Hugging Face's DebugUnderflowOverflow installs)

Each configuration's median step time is compared with plain's. On a
shared CPU the step time varies by a few % from step to step, more than the
trace costs, so the trace's own work is also timed where it happens: the
clock is read around every call of its hooks (forward pre-hook, forward
hook, gradient hooks) and its end-of-step bookkeeping, over the timed steps
of "trace", and summed per step. Then, on one forward pass's module inputs
and outputs, the ways of flagging them are timed alone: mark_nonfinite per
tensor (what the trace does), the torch composite torch.isfinite(t).all()
per tensor, stats_many per tensor, and holding every tensor until the
forward pass ends for one stats_many call (with the bytes that would hold).
The flag's own cost depends on the values (a tensor stops being read once
it has shown every kind of non-finite value its dtype holds), so
mark_nonfinite is also timed against x.sum() on every value distribution of
zeroscan.testing, float32, bfloat16, float16 and float64, and the worst
quoted. Last, memory: what the trace keeps per step (its flag buffers, and its
Python bookkeeping by tracemalloc) over `history` steps, and each
configuration's peak RSS over three steps, each in a fresh process.
Target: trace <= 3 % of the step on CPU, <= 2 % and no host sync on a GPU.

With --deep, a recurrent cell unrolled 1,000 to 20,000 times per forward
pass (a graph of up to 60,000 nodes): the trace's cost per module call at
each depth, the first traced step and the next ones, which must not grow
with the number of calls (CPU time per call, best of 3 steps, after one
untimed step of each).

    python benchmarks/bench_nonfinite_trace.py                  # CPU
    python benchmarks/bench_nonfinite_trace.py --device cuda    # a GPU
    python benchmarks/bench_nonfinite_trace.py --quick          # a smaller model, fewer rounds
    python benchmarks/bench_nonfinite_trace.py --deep           # cost per call of a 1k-20k call forward
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator

import torch
from torch import nn

import zeroscan
from timing import describe_machine, device_sync, seconds_per_call
from zeroscan.monitor import nonfinite_trace
from zeroscan.testing import distributions_for, make_distribution


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.resid_dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, 2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width), nn.Dropout(0.1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, length: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(length, width)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def hf_style_hooks(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """A forward hook per module reading isnan().any() and abs().max() of each output, as host numbers."""
    seen: list[tuple[bool, float]] = []

    def hook(module: nn.Module, args: object, output: object) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                seen.append((bool(torch.isnan(t).any()), float(t.detach().abs().max())))
        if len(seen) > 10_000:
            seen.clear()

    return [m.register_forward_hook(hook) for m in model.modules()]


def build(args: argparse.Namespace, device: torch.device) -> tuple[GPT, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(args.vocab, args.length, args.width, args.layers, args.heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, args.vocab, (args.batch, args.length + 1), device=device)
    return model, opt, data


def configurations(model: GPT, opt: torch.optim.Optimizer) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    @contextlib.contextmanager
    def monitor(**kwargs: object) -> Iterator[None]:
        mon = zeroscan.Monitor(model, opt, **kwargs)  # type: ignore[arg-type]
        try:
            yield
        finally:
            mon.close()

    @contextlib.contextmanager
    def hooks() -> Iterator[None]:
        handles = hf_style_hooks(model)
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    return {
        "plain": contextlib.nullcontext,
        "trace": lambda: monitor(every=10**9, trace_nonfinite=True),
        "monitor": lambda: monitor(every=1),
        "monitor+trace": lambda: monitor(every=1, trace_nonfinite=True),
        "detect_anomaly": contextlib.nullcontext,  # entered around each step, below
        "hf_hooks": hooks,
    }


def make_step(model: GPT, opt: torch.optim.Optimizer, data: torch.Tensor, vocab: int) -> Callable[[bool], None]:
    def step(anomaly: bool) -> None:
        with torch.autograd.detect_anomaly() if anomaly else contextlib.nullcontext():
            logits = model(data[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()

    return step


def flagging_choices(model: GPT, data: torch.Tensor, sync: Callable[[], None] | None) -> list[str]:
    """The ways of flagging one forward pass's module inputs and outputs, timed alone."""
    tensors: list[torch.Tensor] = []
    ids: set[int] = set()

    def keep(module: nn.Module, args: tuple, output: object) -> None:
        for t in (*args, *(output if isinstance(output, tuple) else (output,))):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and id(t) not in ids:
                ids.add(id(t))  # the tensor is kept, so its id is not reused
                tensors.append(t)

    handles = [m.register_forward_hook(keep) for m in model.modules()]
    with torch.no_grad():
        model(data[:, :-1])
    for h in handles:
        h.remove()
    flags = torch.zeros(len(tensors), dtype=torch.int32, device=data.device)
    mark = torch.ops.zeroscan.mark_nonfinite.default
    many = torch.ops.zeroscan.stats_many.default
    choices = {
        "mark_nonfinite per tensor (the trace)": lambda: [mark([t], flags, [k]) for k, t in enumerate(tensors)],
        "torch.isfinite(t).all() per tensor": lambda: [torch.isfinite(t).all() for t in tensors],
        "stats_many([t]) per tensor": lambda: [many([t], None) for t in tensors],
        "one stats_many(all) at forward end": lambda: many(tensors, None),
    }
    total = sum(t.numel() * t.element_size() for t in tensors)
    lines = [f"flagging one forward pass's {len(tensors)} distinct module inputs and outputs ({total / 2**20:.0f} MiB):"]
    base = None
    for name, fn in choices.items():
        fn()
        seconds = min(seconds_per_call(fn, 1, sync=sync) for _ in range(5))
        base = base or seconds
        lines.append(f"  {name:<40} {1e3 * seconds:8.2f} ms  ({seconds / base:.2f}x)")
    lines.append(f"  holding them to the end of forward keeps up to {total / 2**20:.0f} MiB alive that autograd may not "
                 "(all of it under activation checkpointing)")
    return lines


def flag_by_distribution(device: torch.device, sync: Callable[[], None] | None, numel: int) -> list[str]:
    """mark_nonfinite / x.sum() per dtype and value distribution (best of 5), and the worst."""
    mark = torch.ops.zeroscan.mark_nonfinite.default
    flags = torch.zeros(1, dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(0)
    lines = [f"mark_nonfinite / x.sum() on {numel / 2**20:.0f}M elements, best of 5 each:"]
    worst = (0.0, "")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        cells = []
        for name in distributions_for(dtype):
            x = make_distribution(name, numel, dtype, g).to(device)
            floor = min(seconds_per_call(lambda: x.sum(), 3, sync=sync) for _ in range(5))
            ours = min(seconds_per_call(lambda: mark([x], flags, [0]), 3, sync=sync) for _ in range(5))
            cells.append(f"{name} {ours / floor:.2f}")
            worst = max(worst, (ours / floor, f"{name}, {str(dtype).removeprefix('torch.')}"))
        lines.append(f"  {str(dtype).removeprefix('torch.'):>8}: " + ", ".join(cells))
    lines.append(f"  worst: {worst[0]:.2f}x x.sum() ({worst[1]})")
    return lines


@contextlib.contextmanager
def hook_clock(clock: Callable[[], float]) -> Iterator[list[float]]:
    """Sums the time spent in the trace's hooks and bookkeeping (yields [seconds])."""
    spent = [0.0]
    patched = [(nonfinite_trace.NonfiniteTrace, name) for name in ("_began", "_returned", "_param_grad", "close")]
    patched.append((nonfinite_trace.GradArrived, "__call__"))
    originals = [(cls, name, getattr(cls, name)) for cls, name in patched]

    def timed(fn: Callable[..., object]) -> Callable[..., object]:
        def wrapper(*args: object, **kwargs: object) -> object:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += clock() - start
        return wrapper

    for cls, name, fn in originals:
        setattr(cls, name, timed(fn))
    try:
        yield spent
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


def kept_memory(model: GPT, opt: torch.optim.Optimizer, step: Callable[[bool], None], steps: int) -> tuple[int, int]:
    """Bytes the trace keeps per step: its flag buffers, and the growth of its
    Python bookkeeping (tracemalloc) from step `steps` to step 2 * `steps`
    (the hooks themselves are made once, before)."""
    mon = zeroscan.Monitor(model, opt, every=10**9, trace_nonfinite=True, history=2 * steps)
    for _ in range(steps):
        step(False)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(steps):
        step(False)
    python_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    trace = mon._trace
    assert trace is not None
    flag_bytes = sum(b.numel() * b.element_size() for t in trace.steps for s in t.segments for b in s.flags.buffers.values())
    mon.close()
    return flag_bytes // (2 * steps), python_bytes // steps


def peak_rss(config: str, args: argparse.Namespace) -> float:
    """Peak RSS (MiB) of three steps of `config` in a fresh process."""
    argv = [sys.executable, __file__, "--rss-of", config, "--device", args.device, "--threads", str(args.threads)]
    if args.quick:
        argv.append("--quick")
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.splitlines()[-1])["peak_rss_mib"])


def rss_of(config: str, args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    model, opt, data = build(args, device)
    step = make_step(model, opt, data, args.vocab)
    with configurations(model, opt)[config]():
        for _ in range(3):
            step(config == "detect_anomaly")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    print(json.dumps({"peak_rss_mib": peak}))


class Unrolled(nn.Module):
    """One cell called `calls` times per forward pass."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls = calls
        self.cell = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.calls):
            x = torch.tanh(self.cell(x))
        return self.head(x)


def deep_costs(depths: tuple[int, ...]) -> list[str]:
    """The trace's extra CPU time per module call, per depth: the first traced
    step, and the best of the next three, against the best plain step."""
    lines = ["trace on a cell unrolled N times (process CPU time per step; extra per call):",
             f"{'calls':>7}  {'plain ms':>9}  {'traced, first':>14}  {'traced, best':>13}  {'us/call first':>14}  "
             f"{'us/call best':>13}"]
    for calls in depths:
        model = Unrolled(calls)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(2, 8)

        def step() -> None:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

        step()
        plain = min(seconds_per_call(step, 1, clock=time.process_time) for _ in range(3))
        monitor = zeroscan.Monitor(model, opt, every=10**9, trace_nonfinite=True)
        step()  # the Monitor's step 0: its scans and probe run here, not the trace alone
        first = seconds_per_call(step, 1, clock=time.process_time)
        best = min(seconds_per_call(step, 1, clock=time.process_time) for _ in range(3))
        monitor.close()
        lines.append(f"{calls:>7}  {1e3 * plain:9.1f}  {1e3 * first:14.1f}  {1e3 * best:13.1f}  "
                     f"{1e6 * (first - plain) / calls:14.1f}  {1e6 * (best - plain) / calls:13.1f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable timings)")
    parser.add_argument("--quick", action="store_true", help="4 layers, width 256, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round and configuration")
    parser.add_argument("--rss-of", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--flags-only", action="store_true", help="only the per-distribution timing of the flag")
    parser.add_argument("--deep", action="store_true", help="only the cost per call of a 1k-20k call forward pass")
    args = parser.parse_args()
    args.vocab, args.length, args.batch = 50257, 128, 2
    args.width, args.layers, args.heads = (256, 4, 4) if args.quick else (768, 12, 12)
    args.rounds = args.rounds or (4 if args.quick else 8)
    torch.set_num_threads(args.threads)
    if args.rss_of:
        rss_of(args.rss_of, args)
        return
    if args.deep:
        print(describe_machine(torch.device("cpu")))
        print("\n".join(deep_costs((1000, 4000, 20000))))
        return
    if args.flags_only:
        device = torch.device(args.device)
        print(describe_machine(device))
        print("\n".join(flag_by_distribution(device, device_sync(device), 1 << 22 if args.quick else 1 << 24)))
        return

    device = torch.device(args.device)
    model, opt, data = build(args, device)
    step = make_step(model, opt, data, args.vocab)
    sync = device_sync(device)
    # On CPU the clock is this process's CPU time, so other processes sharing
    # the cores do not count; on GPU it is wall time around synchronisation.
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    configs = configurations(model, opt)
    times: dict[str, list[float]] = {name: [] for name in configs}
    syncs: dict[str, str] = {}
    step(False)
    for name, make in configs.items():  # warm every path once
        with make():
            step(name == "detect_anomaly")
    hook_seconds: list[float] = []
    for r in range(args.rounds):
        order = list(configs.items())
        for name, make in order if r % 2 == 0 else reversed(order):
            with make(), hook_clock(clock) as spent:
                times[name].append(seconds_per_call(lambda: step(name == "detect_anomaly"), args.steps,
                                                    clock=clock, sync=sync))
            if name == "trace":
                hook_seconds.append(spent[0] / args.steps)
    if device.type == "cuda":
        for name in ("trace", "monitor+trace"):
            with configs[name]():
                step(False)
                torch.cuda.synchronize(device)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step(False)
                    syncs[name] = "0 host syncs"
                except RuntimeError as err:
                    syncs[name] = f"synced: {str(err).splitlines()[0][:80]}"
                finally:
                    torch.cuda.set_sync_debug_mode("default")

    n_params = sum(p.numel() for p in model.parameters())
    clock_name = "wall time" if device.type == "cuda" else "process CPU time"
    print(f"{describe_machine(device)}; clock={clock_name}; {n_params / 1e6:.1f}M parameters, {args.layers} layers, "
          f"width {args.width}; {args.batch}x{args.length} tokens/step; {args.rounds} rounds x {args.steps} steps")
    base = statistics.median(times["plain"])
    print(f"{'configuration':>16}  {'ms/step':>9}  {'best':>9}  {'vs plain (medians)':>19}  {'paired rounds':>14}")
    for name, ts in times.items():
        med = statistics.median(ts)
        paired = statistics.median(t / p for t, p in zip(ts, times["plain"]))
        print(f"{name:>16}  {1e3 * med:9.1f}  {1e3 * min(ts):9.1f}  {100 * (med / base - 1):+18.2f}%  "
              f"{100 * (paired - 1):+13.2f}%  {syncs.get(name, '')}")
    spread = (max(times["plain"]) - min(times["plain"])) / base
    own = statistics.median(hook_seconds)
    print(f"plain's step times spread over {100 * spread:.1f} % of its median: the step comparison above cannot "
          "resolve a cost below that")
    print(f"the trace's own work (its hooks and bookkeeping, timed inside): {1e3 * own:.1f} ms/step = "
          f"{100 * own / base:.2f} % of the median plain step (median of {len(hook_seconds)} rounds; "
          f"range {1e3 * min(hook_seconds):.1f}-{1e3 * max(hook_seconds):.1f} ms)")
    print()
    print("\n".join(flagging_choices(model, data, sync)))
    print()
    print("\n".join(flag_by_distribution(device, sync, 1 << 22 if args.quick else 1 << 24)))
    print()
    flag_bytes, python_bytes = kept_memory(model, opt, step, 8)
    print(f"kept by the trace per step: flags {flag_bytes / 1024:.1f} KiB, bookkeeping {python_bytes / 1024:.1f} KiB "
          f"({64 * (flag_bytes + python_bytes) / 2**20:.2f} MiB for the default history of 64 steps); "
          "no activation is held")
    plain_rss = peak_rss("plain", args)
    kind = "peak allocated" if device.type == "cuda" else "peak RSS"
    print(f"{kind} over 3 steps, fresh process each: plain {plain_rss:.0f} MiB")
    for name in ("trace", "monitor+trace", "detect_anomaly", "hf_hooks"):
        rss = peak_rss(name, args)
        print(f"  {name:>16}: {rss:8.0f} MiB ({rss - plain_rss:+.0f} MiB, {100 * (rss / plain_rss - 1):+.1f} %)")


if __name__ == "__main__":
    main()
