"""GPU benchmark of zeroscan.stats and zeroscan.stats_many against what memory allows.

Everything is timed in ONE run, on the same device: the median of 7 batches
of back-to-back calls, each batch timed between two torch.cuda.synchronize()
and long enough (1/10 of the budget) that the synchronisation is noise:

1. stats(x) for float32 and bfloat16 tensors of 1 MB .. 4 GB, as read GB/s,
   against
     copy    y.copy_(x), a device-to-device copy: its GB/s counts the bytes
             read and written, the bandwidth the device sustains
     sum     x.sum(), a one-read reduction (torch's reduction kernel)
   Targets: stats >= 90 % of the copy's GB/s from 256 MB up, and never slower
   than x.sum(). Sizes under the L2 cache (~50 MB on an H100) are served
   mostly from L2, for all three alike.
2. stats_many over the parameter list of a transformer (Llama-style shapes;
   by default 7B parameters in bfloat16, 13.5 GB) against
     flat      stats() of one tensor of the same dtype and bytes
     loop      [stats(p) for p in params], one launch per tensor
     foreach   torch._foreach_norm(params), PyTorch's multi-tensor reduction
   Target: stats_many <= 1.15 x flat.
3. Host syncs per call of stats() and stats_many(), under
   torch.cuda.set_sync_debug_mode("error"). Target: 0.

    python benchmarks/bench_cuda.py                 # everything (needs ~30 GB of GPU memory)
    python benchmarks/bench_cuda.py --quick         # up to 256 MB, a 1B model in bfloat16
    python benchmarks/bench_cuda.py --model 1b --model-dtype float32 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

import zeroscan
from timing import describe_machine, dtype_name, fmt_time, time_batches, write_json

MB = 1 << 20

# Llama-style decoder shapes: hidden size, layers, MLP width, vocabulary.
MODELS = {
    "1b": (2048, 22, 5632, 32000),
    "3b": (3200, 26, 8640, 32000),
    "7b": (4096, 32, 11008, 32000),
}


def gpu_seconds(fn: Callable[[], object], budget: float) -> float:
    """Median seconds per call over 7 batches of back-to-back calls, each
    lasting about budget / 10 and synchronised with the device at both ends."""
    return statistics.median(time_batches(fn, 7, batch_seconds=budget / 10, sync=torch.cuda.synchronize))


def fmt_bytes(n: int) -> str:
    return f"{n / (1 << 30):.0f} GB" if n >= 1 << 30 else f"{n / MB:.0f} MB"


def bandwidth_table(sizes: list[int], budget: float) -> list[dict[str, object]]:
    rows = []
    print("| dtype | size | copy GB/s | sum GB/s | stats GB/s | stats / copy | sum time / stats time |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for size in sizes:
            n = size // torch.empty((), dtype=dtype).element_size()
            x = torch.randn(n, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            t_copy = gpu_seconds(lambda: y.copy_(x), budget)
            t_sum = gpu_seconds(lambda: x.sum(), budget)
            t_stats = gpu_seconds(lambda: zeroscan.stats(x), budget)
            row = {
                "dtype": dtype_name(dtype),
                "bytes": size,
                "copy_GBps": 2 * size / t_copy / 1e9,
                "sum_GBps": size / t_sum / 1e9,
                "stats_GBps": size / t_stats / 1e9,
                "copy_s": t_copy,
                "sum_s": t_sum,
                "stats_s": t_stats,
            }
            rows.append(row)
            print(
                f"| {row['dtype']} | {fmt_bytes(size)} | {row['copy_GBps']:.0f} | {row['sum_GBps']:.0f} | "
                f"{row['stats_GBps']:.0f} | {row['stats_GBps'] / row['copy_GBps']:.0%} | {t_sum / t_stats:.2f}× |",
                flush=True,
            )
            del x, y
            torch.cuda.empty_cache()
    return rows


def transformer_params(model: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """The parameter tensors of a Llama-style decoder, filled with randn."""
    hidden, layers, mlp, vocab = MODELS[model]
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4  # q, k, v, o
        shapes += [(mlp, hidden), (mlp, hidden), (hidden, mlp)]  # gate, up, down
        shapes += [(hidden,), (hidden,)]  # the two norms
    shapes += [(hidden,), (vocab, hidden)]  # final norm, lm_head
    return [torch.randn(shape, device="cuda", dtype=dtype) for shape in shapes]


def model_table(model: str, dtype: torch.dtype, budget: float) -> dict[str, object]:
    params = transformer_params(model, dtype)
    numel = sum(p.numel() for p in params)
    size = numel * params[0].element_size()
    flat = torch.randn(numel, device="cuda", dtype=dtype)
    t_flat = gpu_seconds(lambda: zeroscan.stats(flat), budget)
    t_many = gpu_seconds(lambda: zeroscan.stats_many(params), budget)
    t_op = gpu_seconds(lambda: torch.ops.zeroscan.stats_many.default(params, None), budget)
    t_loop = gpu_seconds(lambda: [zeroscan.stats(p) for p in params], budget)
    t_foreach = gpu_seconds(lambda: torch._foreach_norm(params), budget)
    name = f"{model} model: {len(params)} tensors, {numel / 1e9:.2f}B × {dtype_name(dtype)} = {fmt_bytes(size)}"
    print(f"| {name} | time | GB/s | / flat |")
    print("|---|---|---|---|")
    for label, t in [
        ("stats(flat): one tensor, same bytes", t_flat),
        ("stats_many(params)", t_many),
        ("torch.ops.zeroscan.stats_many (op only)", t_op),
        ("[stats(p) for p in params]", t_loop),
        ("torch._foreach_norm(params)", t_foreach),
    ]:
        print(f"| {label} | {fmt_time(t)} | {size / t / 1e9:.0f} | {t / t_flat:.2f}× |", flush=True)
    result = {
        "model": model,
        "dtype": dtype_name(dtype),
        "tensors": len(params),
        "bytes": size,
        "flat_s": t_flat,
        "many_s": t_many,
        "many_op_s": t_op,
        "loop_s": t_loop,
        "foreach_norm_s": t_foreach,
    }
    del params, flat
    torch.cuda.empty_cache()
    return result


def host_syncs() -> dict[str, str]:
    """'0' for each call that ran under sync debug mode "error", else the error."""
    xs = [torch.randn(n, device="cuda") for n in (4099, 3_000_017)] + [torch.randn(1000, device="cuda")[::2]]
    torch.cuda.synchronize()
    calls: dict[str, Callable[[], object]] = {
        "stats": lambda: zeroscan.stats(xs[1]),
        "stats_many": lambda: zeroscan.stats_many(xs),
    }
    out = {}
    previous = torch.cuda.get_sync_debug_mode()
    for name, fn in calls.items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            out[name] = "0"
        except RuntimeError as e:
            out[name] = f"synchronised: {e}"
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return out


def run(quick: bool, model: str, model_dtype: torch.dtype) -> dict[str, object]:
    machine = describe_machine("cuda")
    print(f"# zeroscan CUDA benchmark — {machine}")
    print()
    top = 256 * MB if quick else 4096 * MB
    sizes = [s for s in (MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB, 1024 * MB, 4096 * MB) if s <= top]
    budget = 0.5 if quick else 2.0
    rows = bandwidth_table(sizes, budget)
    print()
    many = model_table(model, model_dtype, budget)
    print()
    syncs = host_syncs()
    print("| host syncs per call | count |")
    print("|---|---|")
    for name, count in syncs.items():
        print(f"| {name} | {count} |")
    return {"machine": machine, "bandwidth": rows, "stats_many": many, "host_syncs": syncs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes up to 256 MB, a 1B model in bfloat16, shorter timing")
    parser.add_argument("--model", choices=sorted(MODELS), default=None, help="transformer shapes (default 7b; 1b with --quick)")
    parser.add_argument(
        "--model-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="dtype of the parameters"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda.py needs a CUDA device (torch.cuda.is_available() is False)")
    model = args.model or ("1b" if args.quick else "7b")
    results = run(args.quick, model, getattr(torch, args.model_dtype))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
