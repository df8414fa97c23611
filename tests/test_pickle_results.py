"""Every public result type survives pickle and copy.deepcopy with equal values.

A result is made by the public call that makes it (never assembled by
hand), then compared field by field with its pickled and its deep-copied
copy. Every public class (tests/public_api.py) is either made here
(RESULTS, or DISTRIBUTED_RESULTS in a one-rank process group) or listed in
NOT_RESULTS with why it is not a value to store.

The issue named stats_many's result (a lazy StatsBatch, whose maker was a
closure); the unnamed members of the family tested here are the batches
stats_many makes otherwise (with histograms, of memory torch did not
allocate, empty), a Stats indexed out of a batch, the Diagnosis that rests
on one, and the distributed results.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import math
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import zeroscan
import zeroscan.checkpoint
import zeroscan.distributed
from helpers import ended, fresh_generator, make_values, run_python
from public_api import public_classes
from zeroscan.monitor import Slot


def comparable(value: Any) -> Any:
    """`value` as plain data that == compares in full: tensors and arrays by
    their values, NaN as a string, a Stats by every field."""
    if isinstance(value, zeroscan.Stats):
        extra = tuple(getattr(value, name, None) for name in ("mode", "ranks"))  # a GlobalStats' own
        return (type(value).__name__, comparable(value.to_dict()), value.tol, extra)
    if isinstance(value, zeroscan.StatsBatch):
        return ("StatsBatch", [comparable(s) for s in value])
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), comparable(value.tolist()))
    if isinstance(value, numpy.ndarray):
        return ("ndarray", str(value.dtype), comparable(value.tolist()))
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, enum.Enum):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: comparable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return (type(value).__name__, fields)
    if isinstance(value, tuple):  # NamedTuples (Bound, Slot) too
        return (type(value).__name__, tuple(comparable(v) for v in value))
    if isinstance(value, list):
        return [comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if hasattr(value, "to_dict") and not isinstance(value, type):  # Report: its documented schema
        return (type(value).__name__, comparable(value.to_dict()))
    if isinstance(value, BaseException):
        return (type(value).__name__, value.args)
    assert isinstance(value, (str, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)), type(value)
    return value


def assert_round_trips(value: object) -> None:
    for how, copied in (("pickle", pickle.loads(pickle.dumps(value))), ("deepcopy", copy.deepcopy(value))):
        assert type(copied) is type(value), how
        assert comparable(copied) == comparable(value), how


def _tensors() -> tuple[torch.Tensor, torch.Tensor]:
    g = fresh_generator()
    return make_values(500, torch.float32, g), make_values(300, torch.bfloat16, g)


def _numpy_memory() -> torch.Tensor:
    """A tensor of memory torch did not allocate: scanned under the SIGBUS guard."""
    return torch.from_numpy(numpy.linspace(-1.0, 1.0, 64, dtype=numpy.float32))


def _report(histogram: bool) -> zeroscan.Report:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[2].weight[0, 0] = math.nan  # a NaN weight: the report has findings
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with zeroscan.Monitor(model, opt, histogram=histogram) as monitor:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(16, 4, generator=fresh_generator())).square().mean().backward()
            opt.step()
    report = monitor.report()
    assert report.findings, "a report with no finding would leave Finding untested"
    return report


def _guard_report() -> zeroscan.GuardReport:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with zeroscan.guard(opt, names=model) as guarded:
        for poison in (False, True):
            opt.zero_grad()
            model(torch.full((2, 3), math.nan if poison else 1.0)).sum().backward()
            opt.step()
    report = guarded.report()
    assert report.skipped_steps, "a report with no skipped step would leave SkippedStep untested"
    return report


def _checkpoint(tmp_path: Path) -> Path:
    x, y = _tensors()
    path = tmp_path / "model.safetensors"
    save_file({"w": x, "b": y, "zero": torch.zeros(4)}, str(path))
    return path


def _checkpoint_error() -> zeroscan.CheckpointError:
    try:
        zeroscan.open_checkpoint("/nonexistent/model.safetensors")
    except zeroscan.CheckpointError as e:
        return e
    raise AssertionError("a missing file was opened")


def _replica_report() -> Any:
    """replica_report of two ranks' rows that disagree on tensor 1 (no collective)."""
    x, y = _tensors()
    rows = zeroscan.scan_buffers([x, y.float()])[0]
    other = zeroscan.scan_buffers([x, y.float() * 2])[0]
    return zeroscan.distributed.replica_report(torch.stack([rows, other]), (0, 1), ["x", "y"])


# label: what makes the result (given tmp_path)
RESULTS: dict[str, Callable[[Path], object]] = {
    "Stats": lambda _: zeroscan.stats(_tensors()[0]),
    "Stats with a histogram": lambda _: zeroscan.stats(_tensors()[1], histogram=True),
    "stats_many's batch": lambda _: zeroscan.stats_many(list(_tensors())),
    "stats_many's batch with histograms": lambda _: zeroscan.stats_many(list(_tensors()), histogram=True),
    "stats_many's batch of memory torch did not allocate": lambda _: zeroscan.stats_many([_numpy_memory()]),
    "stats_many's empty batch": lambda _: zeroscan.stats_many([]),
    "a Stats indexed out of a batch": lambda _: zeroscan.stats_many(list(_tensors()))[1],
    "Histogram": lambda _: zeroscan.stats(_tensors()[0], histogram=True).histogram,
    "reference_histogram": lambda _: zeroscan.reference_histogram(_tensors()[1]),
    "headroom_of": lambda _: zeroscan.headroom_of(_tensors()[0], "e4m3"),
    "mx_headroom": lambda _: zeroscan.mx_headroom(_tensors()[0], "e2m1"),
    "Bound": lambda _: zeroscan.headroom_of(_tensors()[0], "e5m2", scaling="amax_pow2").to_subnormal,
    "diagnose": lambda _: zeroscan.diagnose(_tensors()[0]),
    "diagnose_many": lambda _: zeroscan.diagnose_many(list(_tensors())),
    "diagnose_stats of a batch's Stats": lambda _: zeroscan.diagnose_stats(zeroscan.stats_many(list(_tensors()))[0]),
    "Verdict, Severity and Cause": lambda _: [zeroscan.diagnose(torch.zeros(3)).verdict, zeroscan.Severity.ERROR,
                                              next(iter(zeroscan.Cause))],
    "Report": lambda _: _report(histogram=False),
    "Report with histograms": lambda _: _report(histogram=True),
    "Finding": lambda _: _report(histogram=False).findings[0],
    "Thresholds": lambda _: zeroscan.Thresholds(mostly_zero=0.5),
    "Slot": lambda _: Slot.grad(3),
    "GuardReport": lambda _: _guard_report(),
    "SkippedStep": lambda _: _guard_report().skipped_steps[0],
    "scan_checkpoint": lambda tmp: zeroscan.scan_checkpoint(_checkpoint(tmp)),
    "scan_checkpoint with histograms": lambda tmp: zeroscan.scan_checkpoint(_checkpoint(tmp), histogram=True),
    "diff_checkpoints": lambda tmp: zeroscan.checkpoint.diff_checkpoints(_checkpoint(tmp), _checkpoint(tmp)),
    "TensorEntry": lambda tmp: zeroscan.open_checkpoint(_checkpoint(tmp)).entries[0],
    "CheckpointError": lambda _: _checkpoint_error(),
    "UsageError": lambda _: zeroscan.cli.UsageError("a bad combination of arguments"),
    "LocalPart": lambda _: zeroscan.distributed.local_part(_tensors()[0]),
    "GatheredRows": lambda _: zeroscan.distributed.GatheredRows(zeroscan.scan_buffers([_tensors()[0]])[0][None], (0,)),
    "ReplicaReport": lambda _: _replica_report(),
    "ReplicaMismatch": lambda _: _replica_report().mismatches[0],
}

# Made by the collective calls, in a one-rank gloo process group of their own (DISTRIBUTED below).
DISTRIBUTED_RESULTS = {
    "zeroscan.distributed.GlobalStats": "zeroscan.distributed.stats(x), and each of stats_many's",
}

NOT_RESULTS: dict[str, str] = {
    "zeroscan.Monitor": "a live monitor: hooks on a model",
    "zeroscan.StepGuard": "a live guard: hooks on an optimizer",
    "zeroscan.checkpoint.TensorTable": "an open checkpoint: open files and their mappings",
    "zeroscan.distributed.PendingMerge": "a collective in flight",
    "zeroscan.integrations.lightning.ZeroscanCallback": "a live callback holding its Monitor",
}


@pytest.mark.parametrize("label", RESULTS)
def test_result_round_trips_through_pickle_and_deepcopy(label: str, tmp_path: Path) -> None:
    result = RESULTS[label](tmp_path)
    assert_round_trips(result)


def test_every_public_class_is_covered(tmp_path: Path) -> None:
    made: set[type] = set()
    for make in RESULTS.values():
        result = make(tmp_path)
        for item in result if isinstance(result, list) else [result]:
            made.add(type(item))
    names = {obj: name for name, obj in public_classes().items()}
    covered = {names[t] for t in made if t in names} | set(DISTRIBUTED_RESULTS) | set(NOT_RESULTS)
    missing = set(public_classes()) - covered
    # A public class that is only a callable's name (a function's class) does not count: these are all types.
    assert not missing, f"public classes neither made by RESULTS nor listed in NOT_RESULTS: {sorted(missing)}"


DISTRIBUTED = """
    import copy, json, pickle, sys
    import torch, torch.distributed as dist
    import zeroscan, zeroscan.distributed as zd

    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    x = torch.linspace(-2, 2, 101)
    results = {"stats": zd.stats(x), "stats_many": zd.stats_many([x, x * 0]), "a stats_many item": zd.stats_many([x, x])[1]}
    out = {}
    for label, result in results.items():
        for how, copied in (("pickle", pickle.loads(pickle.dumps(result))), ("deepcopy", copy.deepcopy(result))):
            items = list(result) if isinstance(result, zeroscan.StatsBatch) else [result]
            back = list(copied) if isinstance(copied, zeroscan.StatsBatch) else [copied]
            out[f"{label} {how}"] = [
                [type(a).__name__, type(b).__name__, repr(a.to_dict()) == repr(b.to_dict()),
                 (a.mode, a.ranks) == (b.mode, b.ranks)]
                for a, b in zip(items, back, strict=True)
            ]
    dist.destroy_process_group()
    print(json.dumps(out))
"""


@pytest.mark.slow  # a process of its own, with a process group
def test_distributed_results_round_trip(tmp_path: Path) -> None:
    done = run_python(DISTRIBUTED, str(tmp_path / "store"), timeout=240)
    assert done.returncode == 0, ended(done)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(out) == 6
    for label, items in out.items():
        assert items, label
        for made, copied, same_fields, same_merge in items:
            assert made == copied == "GlobalStats", (label, made, copied)
            assert same_fields and same_merge, label
