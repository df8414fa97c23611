"""The training-step part of the GPU benchmark: zeroscan.Monitor on a decoder-LM step (forward,
backward, clip_grad_norm_, fused AdamW; bf16 autocast over fp32 master weights), as ratios in one run.

1. Monitor overhead, every=1: median step time with and without a Monitor, in interleaved rounds,
   and the Monitor's own stats_many calls timed alone (the witness of a few gradients' first values
   when backward ends; every gradient and weight, read once, at the optimizer's step pre-hook) as %
   of the step. Target: <= 1 % on the GPU.
2. Host syncs of one step with and without the Monitor, under torch.cuda.set_sync_debug_mode("warn"),
   and of report() (which reads the results, so may sync). Target: 0 for the step.
3. A CUDA graph of the whole step (PyTorch's whole-network recipe: static input, side-stream warm-up,
   AdamW(fused, capturable)) without and with the Monitor: does capture succeed, replay vs eager step
   time, do the weights after K replays with fresh data equal an eager twin's (same init and data;
   math attention keeps the step deterministic, and two eager twins give the baseline), and do the
   Monitor's rows after the last replay equal zeroscan.stats_many of what that replay scanned.
   Target: capture works and everything is equal.

Sections 2-3 need CUDA, and their failures become table cells, never an abort. Presets: "1b" (the
real run: 1.14 B parameters, ~40 GB), "small" (a few M, a quick GPU run), "smoke" (CPU, code paths).

    python benchmarks/cuda_training.py --device cuda --preset 1b --json out.json
    python benchmarks/cuda_training.py --device cpu --preset smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import zeroscan
from bench_monitor import SmallLM
from zeroscan.monitor.deferred import witness_of
from timing import (
    count_syncs, describe_machine, device_sync, fmt_time, free_memory, progress, seconds_per_call, time_batches, write_json,
)

GB = 1e9
SEED = 0
WARMUP_STEPS = 3  # side-stream steps before capture, as in PyTorch's recipe
CHECKED_REPLAYS = 6  # replays with fresh data before the weights are compared
ROW_FIELDS = ("numel", "nan", "inf", "zero_fraction", "norm", "mean", "std", "min_abs", "max_abs")
Optimizer = torch.optim.Optimizer


@dataclass(frozen=True)
class Preset:
    vocab: int
    width: int
    layers: int
    heads: int
    length: int
    batch: int  # sequences per step in sections 1-2
    capture_batch: int  # section 3 also holds a reference copy of the weights and a snapshot
    rounds: int  # section 1: interleaved rounds of ...
    steps: int  # ... this many timed steps per configuration
    replays: int  # section 3: timed steps per configuration


PRESETS = {
    # 20 layers x 12 x 2048^2 + 2 x 32000 x 2048 = 1.14 B; 8 x 1024 tokens: ~150-250 ms per step on an H100.
    "1b": Preset(32000, 2048, 20, 16, 1024, batch=8, capture_batch=2, rounds=8, steps=4, replays=10),
    "small": Preset(8192, 256, 4, 4, 256, batch=16, capture_batch=16, rounds=10, steps=10, replays=20),
    "smoke": Preset(256, 32, 2, 2, 16, batch=4, capture_batch=4, rounds=10, steps=5, replays=3),
}


def build_model(p: Preset, device: torch.device | str) -> SmallLM:
    """The preset's LM, initialised from SEED on the device: every build starts from the same weights."""
    torch.manual_seed(SEED)
    with torch.device(device):
        model = SmallLM(p.vocab, p.width, p.layers, p.heads, p.length)
    return model.to(device)  # the causal-mask buffer is made on the CPU


def count_params(p: Preset) -> int:
    """Parameters of the preset's model, counted on the meta device: nothing is allocated."""
    return sum(t.numel() for t in build_model(p, "meta").parameters())


def make_optimizer(model: nn.Module, *, capturable: bool = False) -> Optimizer:
    # Fused: one kernel for the whole update; capturable keeps its step count on the device, as capture needs.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=capturable)


def fresh_tokens(p: Preset, batch: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, p.vocab, (batch, p.length + 1), device=device)


def loss_of(model: nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    # No autocast weight cache: capture needs the casts inside the graph, and each weight is used once anyway.
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, cache_enabled=False):
        logits = model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))


def backward_and_update(model: nn.Module, opt: Optimizer, loss: torch.Tensor) -> None:
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def train_step(model: nn.Module, opt: Optimizer, tokens: torch.Tensor, vocab: int) -> None:
    opt.zero_grad(set_to_none=True)
    backward_and_update(model, opt, loss_of(model, tokens, vocab))


def memory_estimate(p: Preset, params: int, batch: int, *, math_attention: bool = False) -> tuple[int, int]:
    """(bytes of fp32 weights + grads + AdamW moments, bytes of one step's activations), estimated."""
    # Saved per token and layer under bf16 autocast over an fp32 residual stream: LayerNorm inputs (fp32),
    # q/k/v, the attention output, the 4x-wide MLP input and GELU output, ~40 x width bytes; 48 leaves room
    # for transients. The head adds bf16 logits, fp32 log-softmax and its gradient (~14 bytes per vocab entry).
    per_token = p.layers * 48 * p.width + 14 * p.vocab
    if math_attention:  # fp32 scores and probabilities plus a bf16 copy, per head and key position
        per_token += p.layers * p.heads * p.length * 12
    return 16 * params, batch * p.length * per_token


def capture_need(p: Preset, params: int) -> int:
    """Section 3's peak: a model and its optimizer, the graph's activations, a reference copy and a snapshot."""
    return sum(memory_estimate(p, params, p.capture_batch, math_attention=True)) + 8 * params


def fits(device: torch.device, need: int, what: str) -> bool:
    """Whether `need` bytes fit in the device's free memory with a 25 % margin (always, on CPU)."""
    if device.type != "cuda":
        return True
    free, total = torch.cuda.mem_get_info(device)
    ok = 1.25 * need <= free
    progress(f"{what}: ~{need / GB:.1f} GB needed, {free / GB:.1f} of {total / GB:.1f} GB free: "
             f"{'fits' if ok else 'does NOT fit'}")
    return ok


def first_line(err: BaseException | None) -> str:
    """The first line of an exception and of those it was raised while handling (a failed capture's
    capture_end error hides the error that broke the capture)."""
    lines = []
    while err is not None and len(lines) < 3:
        lines.append(f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}")
        err = err.__context__
    return " <- ".join(lines)


def print_table(title: str, rows: Iterable[tuple[str, object]]) -> None:
    print(f"| {title} | value |\n|---|---|")
    for label, value in rows:
        print(f"| {label} | {value} |")


def timed_steps(step: Callable[[torch.Tensor], object], batches: list[torch.Tensor], device: torch.device) -> float:
    """Seconds per step over `batches` (one step each), synchronised with the device at both ends."""
    feed = iter(batches)
    return seconds_per_call(lambda: step(next(feed)), len(batches), sync=device_sync(device))


def overhead_section(device: torch.device, p: Preset, model: nn.Module, opt: Optimizer) -> dict:
    sync = device_sync(device)
    # On CPU the clock is this process's CPU time, so that other processes on the cores do not count.
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    step = lambda: train_step(model, opt, fresh_tokens(p, p.batch, device), p.vocab)  # noqa: E731

    def round_of(monitored: bool, steps: int) -> float:
        mon = zeroscan.Monitor(model, opt, every=1) if monitored else None
        try:
            step()  # untimed: a new Monitor's first step also probes the forward pass
            return seconds_per_call(step, steps, clock=clock, sync=sync)
        finally:
            if mon is not None:
                mon.close()

    times: dict[bool, list[float]] = {False: [], True: []}
    round_of(False, 2)  # warm-up
    round_of(True, 2)
    for r in range(p.rounds):
        for monitored in (False, True) if r % 2 == 0 else (True, False):
            times[monitored].append(round_of(monitored, p.steps))
        progress(f"round {r + 1}/{p.rounds}: {1e3 * times[False][-1]:.1f} / {1e3 * times[True][-1]:.1f} ms "
                 "per step without / with Monitor")

    # What one monitored step scans, issued as the Monitor issues it (once it has seen the loop let its
    # gradients go: zeroscan/monitor/deferred.py), on the last step's gradients.
    params = list(model.parameters())
    grads = [q.grad for q in params if q.grad is not None]
    slots = [2 * k for k in range(len(grads))]
    grads_and_weights = [t for q in params for t in ((q.grad, q) if q.grad is not None else (q,))]

    def scan_seconds(fn: Callable[[], object]) -> float:
        with torch.no_grad():
            return statistics.median(time_batches(fn, 5, batch_seconds=0.05, clock=clock, sync=sync))

    base, with_mon = statistics.median(times[False]), statistics.median(times[True])
    out = {"step_without_s": base, "step_with_s": with_mon, "overhead_pct": 100 * (with_mon / base - 1),
           "overhead_paired_pct": 100 * (statistics.median(w / b for w, b in zip(times[True], times[False])) - 1),
           "scan_witness_s": scan_seconds(lambda: witness_of(grads, slots)),
           "scan_grads_weights_s": scan_seconds(lambda: torch.ops.zeroscan.stats_many.default(grads_and_weights, None))}
    scans = out["scan_witness_s"] + out["scan_grads_weights_s"]
    out["scan_pct"] = 100 * scans / base
    print_table(f"Monitor overhead, every=1 ({p.rounds} rounds x {p.steps} steps)", [
        ("parameters; tokens per step", f"{sum(q.numel() for q in params):,}; {p.batch * p.length:,}"),
        ("step without Monitor (median)", fmt_time(base)),
        ("step with Monitor (median)", fmt_time(with_mon)),
        ("overhead: medians; paired rounds (target <= 1 %)",
         f"{out['overhead_pct']:+.2f} %; {out['overhead_paired_pct']:+.2f} %"),
        ("scan alone: the witness when backward ends", f"{fmt_time(out['scan_witness_s'])} = "
         f"{100 * out['scan_witness_s'] / base:.2f} %"),
        ("scan alone: stats_many(grads + weights) at the optimizer step", f"{fmt_time(out['scan_grads_weights_s'])} "
         f"= {100 * out['scan_grads_weights_s'] / base:.2f} %"),
        ("scan alone, both, % of the step without Monitor (target <= 1 %)", f"{fmt_time(scans)} = {out['scan_pct']:.2f} %"),
    ])
    return out


def sync_counts(device: torch.device, p: Preset, model: nn.Module, opt: Optimizer) -> dict:
    out: dict[str, object] = {}
    step = lambda: train_step(model, opt, fresh_tokens(p, p.batch, device), p.vocab)  # noqa: E731
    try:
        step()
        torch.cuda.synchronize(device)
        out["step_without"] = count_syncs(step)
        monitor = zeroscan.Monitor(model, opt, every=1)
        try:
            step()  # the first monitored step also probes the forward pass
            step()
            torch.cuda.synchronize(device)
            out["step_with"] = count_syncs(step)
            out["monitor_step"] = out["step_with"] - out["step_without"]
            out["report"] = count_syncs(monitor.report)
        finally:
            monitor.close()
    except Exception as err:  # a number is missing; the rest of the run goes on
        out["error"] = first_line(err)
    return out


def sync_section(device: torch.device, p: Preset, model: nn.Module, opt: Optimizer) -> dict:
    out = sync_counts(device, p, model, opt) if device.type == "cuda" else {"error": "needs CUDA"}
    labels = {"step_without": "training step without Monitor", "step_with": "training step with Monitor",
              "monitor_step": "the Monitor's own, per step (target 0)", "report": "monitor.report()"}
    print_table('host syncs, set_sync_debug_mode("warn")',
                [(label, out.get(key, out.get("error", "not reached"))) for key, label in labels.items()])
    return out


def warm_up_on_side_stream(step: Callable[[], None], steps: int) -> None:
    """The recipe's warm-up: lazy state (optimizer moments, cuBLAS handles) is made outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            step()
    torch.cuda.current_stream().wait_stream(side)


def capture_step(step: Callable[[], None]) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def max_abs_diff(params: Iterable[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(float((q.detach() - r).abs().max()) for q, r in zip(params, reference))


def eager_run(p: Preset, device: torch.device, batches: list[torch.Tensor]) -> tuple[nn.Module, Optimizer]:
    model = build_model(p, device)
    opt = make_optimizer(model, capturable=True)  # as the graphed copies: the same kernels
    for tokens in batches:
        train_step(model, opt, tokens, p.vocab)
    return model, opt


def eager_twins(device: torch.device, p: Preset, batches: list[torch.Tensor], timing: list[torch.Tensor],
                out: dict) -> list[torch.Tensor] | None:
    """The weights after `batches` eagerly (the reference); into `out`, how far a second eager run
    lands from it (the baseline) and the eager step times."""
    try:
        model, opt = eager_run(p, device, batches)
        reference = [q.detach().clone() for q in model.parameters()]
        del model, opt
        free_memory()
        twin, opt = eager_run(p, device, batches)
        out["eager_twin_max_abs_diff"] = max_abs_diff(twin.parameters(), reference)
        for name in ("without", "with"):
            monitor = zeroscan.Monitor(twin, opt, every=1) if name == "with" else None
            train_step(twin, opt, timing[0], p.vocab)  # untimed: a new Monitor's first step also probes forward
            out[f"eager_{name}_s"] = timed_steps(lambda tokens: train_step(twin, opt, tokens, p.vocab), timing, device)
            if monitor is not None:
                monitor.close()
        return reference
    except Exception as err:
        out["eager_error"] = first_line(err)
        return None


def monitor_rows_check(monitor: zeroscan.Monitor, model: nn.Module, weights_scanned: list[torch.Tensor]) -> dict:
    """Whether report()'s rows (the scan at the optimizer step: gradients after clipping, weights before
    the update) equal zeroscan.stats_many of those tensors, field by field."""
    report = monitor.report()
    names = [name for name, _ in model.named_parameters()]
    expected = zeroscan.stats_many([q.grad for q in model.parameters()] + weights_scanned)
    got = {(t["name"], t["kind"]): t for t in report.tensors}
    equal = 0
    for k, s in enumerate(expected):
        row = got.get((names[k % len(names)], "grad" if k < len(names) else "weight"))
        want = {**{f: getattr(s, f) for f in ROW_FIELDS if f != "inf"}, "inf": s.posinf + s.neginf}
        equal += row is not None and all(row[f] == want[f] or row[f] != row[f] and want[f] != want[f]
                                         for f in ROW_FIELDS)  # NaN equals NaN here
    return {"equal": int(equal), "rows": len(expected), "report_step": report.step, "steps_seen": monitor.steps_seen}


def graphed_run(device: torch.device, p: Preset, batches: list[torch.Tensor], timing: list[torch.Tensor],
                reference: list[torch.Tensor] | None, monitored: bool) -> dict:
    out: dict[str, object] = {"capture": "not reached"}
    monitor = None
    try:
        model = build_model(p, device)
        opt = make_optimizer(model, capturable=True)
        monitor = zeroscan.Monitor(model, opt, every=1) if monitored else None
        static = batches[0].clone()
        warm = iter(batches[:WARMUP_STEPS])
        warm_up_on_side_stream(lambda: train_step(model, opt, static.copy_(next(warm)), p.vocab), WARMUP_STEPS)
        opt.zero_grad(set_to_none=True)  # the capture's backward allocates the grads in the graph's pool: static
        graph = capture_step(lambda: backward_and_update(model, opt, loss_of(model, static, p.vocab)))
        out["capture"] = "ok"
        checked = batches[WARMUP_STEPS:]
        for tokens in checked[:-1]:
            static.copy_(tokens)
            graph.replay()
        # The last replay's Monitor scan sees the weights before its update: kept to compare.
        weights_scanned = [q.detach().clone() for q in model.parameters()] if monitor is not None else []
        static.copy_(checked[-1])
        graph.replay()
        torch.cuda.synchronize(device)
        if reference is not None:
            out["max_abs_diff"] = max_abs_diff(model.parameters(), reference)
        if monitor is not None:
            out["monitor_rows"] = monitor_rows_check(monitor, model, weights_scanned)
        del weights_scanned
        out["replay_s"] = timed_steps(lambda tokens: (static.copy_(tokens), graph.replay()), timing, device)
    except Exception as err:  # a cell of the table: the numbers of the other sections are kept
        out["error"] = first_line(err)
    finally:
        if monitor is not None:
            monitor.close()
    return out


def capture_rows(device: torch.device, p: Preset) -> dict:
    if not fits(device, capture_need(p, count_params(p)), "section 3"):
        return {"error": "does not fit in free GPU memory"}
    batches = [fresh_tokens(p, p.capture_batch, device) for _ in range(WARMUP_STEPS + CHECKED_REPLAYS)]
    timing = [fresh_tokens(p, p.capture_batch, device) for _ in range(p.replays)]
    out: dict[str, object] = {"batch": p.capture_batch, "checked_replays": CHECKED_REPLAYS}
    with sdpa_kernel([SDPBackend.MATH]):  # deterministic: a twin can match bit for bit
        reference = eager_twins(device, p, batches, timing, out)
        free_memory()
        for name in ("without", "with"):
            progress(f"CUDA graph {name} Monitor")
            out[name] = graphed_run(device, p, batches, timing, reference, name == "with")
            free_memory()
    return out


def diff_words(diff: float | None) -> str:
    return "-" if diff is None else "equal" if diff == 0 else f"max abs diff {diff:.3g}"


def rows_words(rows: dict | None) -> str:
    if rows is None:
        return "-"
    return (f"{rows['equal']}/{rows['rows']} equal (report step {rows['report_step']}, "
            f"{rows['steps_seen']} steps seen by the Monitor)")


def capture_section(device: torch.device, p: Preset) -> dict:
    try:
        out = capture_rows(device, p) if device.type == "cuda" else {"error": "needs CUDA"}
    except Exception as err:  # outside the guarded runs: memory query, input batches
        out = {"error": first_line(err)}
    print(f"| CUDA graph of a step (batch {p.capture_batch}, math attention) | capture | eager step | replay step | "
          f"replay / eager | weights vs eager twin after {CHECKED_REPLAYS} replays | Monitor rows vs stats_many |")
    print("|---|---|---|---|---|---|---|")
    for name in ("without", "with"):
        row, eager = out.get(name, {}), out.get(f"eager_{name}_s")
        capture = "; ".join(str(c) for c in (row.get("capture"), row.get("error") or out.get("error")) if c)
        replay = row.get("replay_s")
        print(f"| {name} Monitor | {capture} | {fmt_time(eager) if eager else out.get('eager_error', '-')} | "
              f"{fmt_time(replay) if replay else '-'} | {f'{replay / eager:.2f}×' if replay and eager else '-'} | "
              f"{diff_words(row.get('max_abs_diff'))} | {rows_words(row.get('monitor_rows'))} |")
    print(f"| eager twin vs eager twin (baseline) | - | - | - | - | {diff_words(out.get('eager_twin_max_abs_diff'))} | - |")
    return out


def training_tables(device: torch.device, preset: str, *, batch: int | None = None) -> dict[str, object]:
    """Prints its markdown tables to stdout (progress lines to stderr via timing.progress) and returns the numbers for JSON."""
    p = PRESETS[preset] if batch is None else replace(PRESETS[preset], batch=batch)
    n = count_params(p)
    states, acts = memory_estimate(p, n, p.batch)
    free_memory()
    size = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
    print(f"## Training step, preset {preset}: {n:,} parameters ({size}), {p.layers} layers x width {p.width}, "
          f"vocab {p.vocab}, {p.batch} x {p.length} tokens per step, bf16 autocast, fused AdamW")
    print(f"Memory estimate: {states / GB:.1f} GB weights + grads + AdamW moments (16 B/param) + {acts / GB:.1f} GB "
          f"activations = {(states + acts) / GB:.1f} GB (sections 1-2); {capture_need(p, n) / GB:.1f} GB (section 3)")
    print()
    results: dict[str, object] = {"preset": preset, "device": describe_machine(device), "params": n,
                                  "tokens_per_step": p.batch * p.length,
                                  "memory_estimate_bytes": {"states": states, "activations": acts,
                                                            "cuda_graph_section": capture_need(p, n)}}
    model = opt = None
    if not fits(device, states + acts, "sections 1-2"):
        print("| sections 1-2 | skipped: the estimate does not fit in free GPU memory |\n")
    else:
        try:
            model = build_model(p, device)
            opt = make_optimizer(model)
            progress(f"section 1: Monitor overhead ({size} parameters)")
            results["overhead"] = overhead_section(device, p, model, opt)
        except Exception as err:  # reported; the other sections, and the caller's, still run
            results["overhead"] = {"error": first_line(err)}
            print(f"| section 1 | failed: {results['overhead']['error']} |")
        print()
    if model is not None and opt is not None:
        progress("section 2: host syncs")
        results["host_syncs"] = sync_section(device, p, model, opt)
        print()
    model = opt = None
    free_memory()
    progress("section 3: CUDA graph")
    results["cuda_graph"] = capture_section(device, p)
    free_memory()
    results.update(headline(results))
    return results


def headline(results: dict) -> dict[str, object]:
    """The figures bench_cuda.py's summary judges, where they were measured: the overhead as a fraction of
    the step, the Monitor's own host syncs per step, and whether the captured step with the Monitor
    replays bit for bit like eager with rows equal to stats_many."""
    out: dict[str, object] = {}
    overhead, syncs = results.get("overhead", {}), results.get("host_syncs", {})
    if "overhead_pct" in overhead:
        out["monitor_overhead"] = overhead["overhead_pct"] / 100
        out["monitor_scan_share"] = overhead["scan_pct"] / 100
    if "monitor_step" in syncs:
        out["monitor_step_syncs"] = syncs["monitor_step"]
    graphed = results.get("cuda_graph", {}).get("with", {})
    if "capture" in graphed:
        rows = graphed.get("monitor_rows") or {"equal": 0, "rows": -1}
        out["graph_step_equal"] = (graphed["capture"] == "ok" and "error" not in graphed
                                   and graphed.get("max_abs_diff") == 0 and rows["equal"] == rows["rows"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: 1b on CUDA, smoke on CPU")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step in sections 1-2")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops on shared cores: OpenMP threads waiting on each other dominate
    preset = args.preset or ("1b" if device.type == "cuda" else "smoke")
    print(f"# zeroscan training-step benchmark — {describe_machine(device)}")
    print()
    write_json(args.json, training_tables(device, preset, batch=args.batch))


if __name__ == "__main__":
    main()
