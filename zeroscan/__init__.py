"""zeroscan: is this tensor truly zero, underflowed, non-finite, or healthy?

One fused pass over a tensor's memory counts exact zeros, subnormals,
near-zero values, NaN/Inf and negatives, and takes min/max |x| and the
mean/std/norm of the finite values, leaving the numbers on the device until
they are read; optionally, in the same pass, a log2-magnitude histogram
(`stats(x, histogram=True)`), from which `headroom` counts what an fp8/fp4
cast would flush or saturate. `guard(optimizer)` skips, on the device, a step
whose gradients hold NaN/Inf. `zeroscan.integrations` runs the Monitor inside
transformers' Trainer, Lightning and Accelerate (each imported only when used).

`import zeroscan` loads what a training loop calls (stats, diagnose,
Monitor with its merge across ranks, guard) and nothing more: the checkpoint
reader, the loggers, the plots and the CLI are submodules loaded on first use
(`zeroscan.loggers.log_tensorboard(...)` works after a bare `import
zeroscan`), and no torch._dynamo, matplotlib or framework is imported until
something needs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from zeroscan.guard import GuardReport, SkippedStep, StepGuard, guard
from zeroscan.headroom import Bound, Headroom, headroom, headroom_of, mx_headroom
from zeroscan.histogram import Histogram, reference_histogram
from zeroscan.diagnosis import Diagnosis, Severity, Verdict, diagnose, diagnose_many, diagnose_stats
from zeroscan.monitor import Finding, Monitor, Report, Thresholds
from zeroscan.verdicts import Cause
from zeroscan.reference import reference_stats
from zeroscan.result_row import FIELDS, NUM_FIELDS
from zeroscan.stats import Stats, StatsBatch, scan_buffers, stats, stats_many

__all__ = [
    "Cause",
    "CheckpointError",
    "open_checkpoint",
    "scan_checkpoint",
    "FIELDS",
    "NUM_FIELDS",
    "Diagnosis",
    "Finding",
    "GuardReport",
    "Bound",
    "Headroom",
    "Histogram",
    "SkippedStep",
    "StepGuard",
    "guard",
    "headroom",
    "integrations",
    "headroom_of",
    "mx_headroom",
    "reference_histogram",
    "Monitor",
    "Report",
    "Severity",
    "Thresholds",
    "Verdict",
    "diagnose",
    "diagnose_many",
    "diagnose_stats",
    "Stats",
    "StatsBatch",
    "reference_stats",
    "scan_buffers",
    "stats",
    "stats_many",
]
__version__ = "0.1.0"

# Submodules loaded on first attribute access (PEP 562): each costs start-up
# time that a training loop calling stats() or Monitor should not pay.
_LAZY_SUBMODULES = frozenset({
    "checkpoint",
    "cli",
    "demo",
    "distributed",
    "integrations",
    "loggers",
    "plot",
    "histogram_plot",
    "report_data",
    "testing",
})
# Names of the public API that live in a lazily loaded submodule.
_LAZY_NAMES = {
    "CheckpointError": "checkpoint",
    "open_checkpoint": "checkpoint",
    "scan_checkpoint": "checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY_NAMES:
        module: ModuleType = importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY_SUBMODULES | set(_LAZY_NAMES))
