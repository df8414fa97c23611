"""Shared test helpers: devices, dtypes, seeds, input makers and the one
check that statistics agree (with the float64 reference or another record)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroscan
from zeroscan.monitor import Finding, Monitor, Report, Thresholds
from zeroscan.ops import FLOAT_DTYPES, INT_DTYPES
from zeroscan.checkpoint.safetensors_file import SAFETENSORS_DTYPES
from zeroscan.stats import Readout, meta_of
from zeroscan.verdicts import Severity

# The CUDA cases are collected everywhere and skipped without a GPU, so that a
# CPU-only run still shows them (as skipped) rather than silently having none.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]

ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES

COUNT_FIELDS = ("numel", "zeros", "subnormal", "near_zero", "nan", "posinf", "neginf", "negative", "finite")
EXACT_FLOAT_FIELDS = ("min_abs", "min_abs_nonzero", "max_abs")
MOMENT_FIELDS = ("mean", "std", "norm", "sum")

# A record of statistics: a Stats, its to_dict(), or reference_stats' dict.
StatsRecord = zeroscan.Stats | Mapping[str, Any]


def fresh_seed(below: int = 2**63) -> int:
    """A new seed each call, printed (pytest shows the output of a failing
    test); ZEROSCAN_TEST_SEED replays one."""
    seed = int(os.environ.get("ZEROSCAN_TEST_SEED", random.SystemRandom().randrange(below))) % below
    print(f"seed={seed}")
    return seed


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed())


def stats_of_row(buffer: torch.Tensor, x: torch.Tensor, index: int = 0) -> zeroscan.Stats:
    """The Stats that row `index` of a raw result buffer ([16] or [N, 16])
    holds for the tensor x."""
    return zeroscan.Stats(Readout(buffer), index, meta_of(x), None)


def rtol_for(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-6


def make_values(
    n: int, dtype: torch.dtype, g: torch.Generator, *, specials: bool = True, every: int = 50
) -> torch.Tensor:
    """n random values of `dtype` (CPU), with zeros, subnormals, tiny and
    non-finite values planted (about one of each per `every` values) where the
    dtype can hold them. A large `every` leaves most SIMD blocks free of them,
    so both the fast and the exact path of a kernel are exercised."""
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        hi = min(info.max, 1000)
        lo = max(info.min, -1000)
        return torch.randint(lo, hi + 1, (n,), generator=g).to(dtype)
    scale = float(torch.empty(()).exponential_(generator=g)) * 10 ** float(torch.randint(-2, 3, (), generator=g))
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    if specials and n > 0:
        info = torch.finfo(dtype)
        k = max(1, n // every)
        pos = torch.randint(0, n, (6, k), generator=g)
        x[pos[0]] = 0.0
        x[pos[1]] = -0.0
        x[pos[2]] = float(info.tiny) * torch.rand(k, generator=g, dtype=torch.float64)  # subnormal or 0
        x[pos[3]] = float(info.eps) * torch.rand(k, generator=g, dtype=torch.float64)  # near zero
        x[pos[4][: max(1, k // 4)]] = math.nan
        x[pos[5][: max(1, k // 8)]] = math.inf
        x[pos[5][k // 8 : k // 4 + 1]] = -math.inf
    return x.to(dtype)


def close(got: float, want: float, rtol: float, scale: float, floor: float = 1e-12) -> bool:
    """Relative agreement, with an absolute floor at floor * scale for values
    that are themselves cancellations (the mean of zero-centred data): a sum
    of n float64 terms is only known to ~sqrt(n) ulps of the data's scale."""
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    if math.isinf(want) or math.isinf(got):
        return want == got
    return abs(got - want) <= rtol * abs(want) + floor * scale


# CUDA sums float32, bfloat16 and float16 moments in float32 (README, "The
# API": float32's values with Kahan's compensation, the 16-bit types'
# deviations in short runs): their mean is within rtol plus 2e-7 of the mean
# |x| plus 1e-6 of the standard deviation, where the exact paths promise
# 1e-12 of the mean |x|.
CUDA_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def mean_floor(got: StatsRecord, want: dict[str, float], scale: float) -> tuple[float, float]:
    """(floor, scale) for close() on the mean of `got` against `want`, scale
    being the data's scale (assert_same_stats: the root mean square, which is
    at least the mean |x|): the CUDA fast path's bound (CUDA_FAST_DTYPES) or
    1e-12 * scale."""
    if isinstance(got, zeroscan.Stats) and got.device.type == "cuda" and got.dtype in CUDA_FAST_DTYPES:
        std = float(want["std"]) if math.isfinite(float(want["std"])) else 0.0
        return 1.0, 2e-7 * scale + 1e-6 * std
    return 1e-12, scale


def assert_same_stats(
    got: StatsRecord,
    want: StatsRecord,
    rtol: float,
    *,
    scale: float | None = None,
    moments: tuple[str, ...] = MOMENT_FIELDS,
    what: str = "",
) -> None:
    """Counts and min/max |x| exactly equal (NaN to NaN); each of `moments`
    within `rtol` of want's, with the absolute floor of `close` at `scale`
    (times the finite count for the sum). The scale defaults to want's root
    mean square; scale=0 holds the moments strictly relative."""
    g = got.to_dict() if isinstance(got, zeroscan.Stats) else got
    w = want.to_dict() if isinstance(want, zeroscan.Stats) else want
    label = f"{what} " if what else ""
    for field in COUNT_FIELDS:
        assert g[field] == w[field], f"{label}{field}: got {g[field]}, want {w[field]}"
    for field in EXACT_FLOAT_FIELDS:
        assert (math.isnan(g[field]) and math.isnan(w[field])) or g[field] == w[field], (
            f"{label}{field}: got {g[field]!r}, want {w[field]!r}"
        )
    finite = max(1, int(w["finite"]))
    if scale is None:
        scale = float(w["norm"]) / math.sqrt(finite)
    mean_factor, mean_scale = mean_floor(got, w, scale)
    for field in moments:
        floor, field_scale = (mean_factor, mean_scale) if field in ("mean", "sum") else (1e-12, scale)
        if field == "sum":
            field_scale *= finite
        assert close(float(g[field]), float(w[field]), rtol, field_scale, floor), (
            f"{label}{field}: got {g[field]!r}, want {w[field]!r} (rtol {rtol})"
        )


def assert_matches_reference(
    s: StatsRecord,
    x: torch.Tensor,
    tol: float | None = None,
    rtol: float | None = None,
    *,
    same_as_cpu: bool = False,
) -> None:
    """s agrees with zeroscan.reference_stats(x) by assert_same_stats, the
    moments' floor at the mean |x| of x's finite values. With same_as_cpu and
    x on another device, s agrees as closely with zeroscan.stats of x on the
    CPU: the two kernels count alike and sum to the dtype's accuracy."""
    rtol = rtol_for(x.dtype) if rtol is None else rtol
    finite = x.detach().cpu().reshape(-1).to(torch.float64)
    finite = finite[finite.isfinite()]
    scale = float(finite.abs().mean()) if finite.numel() else 0.0
    moments = MOMENT_FIELDS
    if finite.numel() and float(finite.abs().max()) < 1e-150:
        # Squares of these float64 values underflow: std and norm lose them
        # in the kernel and in the torch reference alike, differently (README).
        moments = ("mean", "sum")
    reference = zeroscan.reference_stats(x.cpu(), tol=tol)
    assert_same_stats(s, reference, rtol, scale=scale, moments=moments, what="vs reference:")
    if same_as_cpu and x.device.type != "cpu":
        cpu = zeroscan.stats(x.cpu(), tol=tol)
        assert_same_stats(s, cpu, rtol, scale=scale, what=f"{x.device.type} vs cpu:")


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> types.ModuleType:
    """examples/<name>.py, loaded as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"zeroscan_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serious(report: Report) -> list[Finding]:
    """The findings of a Monitor report at WARNING or above."""
    return [f for f in report.findings if f.severity >= Severity.WARNING]


def train_monitored(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    g: torch.Generator,
    *,
    steps: int,
    batch: int = 16,
    thresholds: Thresholds | None = None,
) -> Report:
    """`steps` optimizer steps of `model` under a Monitor, on batches of
    randn(batch, 4) in the dtype of its first parameter with the mean squared
    output as the loss; the Monitor's report."""
    dtype = next(model.parameters()).dtype
    with Monitor(model, opt, thresholds=thresholds) as monitor:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(batch, 4, generator=g).to(dtype)).float().square().mean().backward()
            opt.step()
    return monitor.report()


class RecordingSink:
    """A user-written zeroscan.loggers.Sink: any object with log(scalars, step).
    Keeps each call as (step, scalars)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.calls.append((step, dict(scalars)))


def safetensors_bytes(header: dict[str, object], data: bytes) -> bytes:
    """A .safetensors file's bytes: the 8-byte header length, `header` as JSON
    (padded with spaces to a multiple of 8 bytes, as the package pads it), then `data`."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def save_file_in_order(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors.torch.save_file, but with the tensors in the file in the dict's
    order (save_file sorts them by dtype, then name), for tests that check that
    a file's tensors are listed in file order."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    blobs = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values()]
    offset = 0
    for (name, t), blob in zip(tensors.items(), blobs):
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    path.write_bytes(safetensors_bytes(header, b"".join(blobs)))


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`zeroscan ARGV` in this process: (exit status, stdout, stderr)."""
    from zeroscan.cli import main

    capsys.readouterr()  # drop what came before (the printed test seed)
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def run_cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    """`zeroscan ARGV --json` in this process: (exit status, the JSON), nothing on stderr."""
    rc, out, err = run_cli(capsys, *argv, "--json")
    assert err == "", err
    return rc, json.loads(out)


def run_python(
    script: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`script` (dedented) in a fresh interpreter, `args` its sys.argv[1:] and
    `env` its whole environment (default: this one), writing no core file: a
    crash there (SIGSEGV, SIGBUS, an abort) ends that process, not pytest.
    `ended` says how it ended."""
    prelude = "import resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(env),
    )


def ended(proc: subprocess.CompletedProcess[str]) -> str:
    """How a process of run_python ended, for an assertion's message: its exit
    status, or the signal that killed it, with the end of what it wrote to stderr."""
    how = f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    return f"{how}; stderr ends:\n{proc.stderr[-2000:]}"
