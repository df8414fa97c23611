"""Every public callable refuses bad input with one line naming itself.

The walk covers every module of zeroscan that declares `__all__` (found by
reading the sources, so a new public module is walked too) and, for
zeroscan.integrations, the framework modules its `__all__` names. Each
public callable has an entry in CALLS saying how the bad input reaches its
first argument that takes a tensor (or, for one that takes none, its first
argument), or in NOT_CALLED why it is not called on user input (a result
type, an enum, an exception). A public callable with neither fails
test_every_public_callable_has_an_entry.

The bad inputs the issue named are a list, an ndarray, None, a str, and
sparse, jagged (nested), meta and quantized tensors; the unnamed members of
the family tested here are a float, a sparse CSR tensor, a strided nested
tensor and a lazy (uninitialized) parameter, and for the calls that take a
list of tensors, the bad input given as the list itself.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import numpy
import pytest
import torch
from torch import nn

import zeroscan
from checklist import Checklist
from public_api import public_callables

def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch
        return torch.quantize_per_tensor(torch.randn(6), 0.1, 0, torch.qint8)


def _nested(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the strided layout's prototype warning
        return torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=layout)


BAD_INPUTS: dict[str, Callable[[], object]] = {
    "list": lambda: [1.0, 2.0],
    "ndarray": lambda: numpy.ones(3, dtype=numpy.float32),
    "None": lambda: None,
    "str": lambda: "x",
    "sparse": lambda: torch.eye(3).to_sparse(),
    "jagged": lambda: _nested(torch.jagged),
    "meta": lambda: torch.empty(3, device="meta"),
    "quantized": _quantized,
    # unnamed members of the family
    "float": lambda: 3.0,
    "sparse csr": lambda: torch.eye(3).to_sparse_csr(),
    "nested strided": lambda: _nested(torch.strided),
    "lazy parameter": lambda: nn.UninitializedParameter(),
}


@dataclass(frozen=True)
class Takes:
    """How bad input reaches the callable: each of `calls` is given it.
    `valid`: inputs that are values of the argument's own type (a str is a
    path), which the call may accept."""

    calls: tuple[Callable[[object], object], ...]
    valid: frozenset[str] = field(default_factory=frozenset)


def takes(*calls: Callable[[object], object], valid: tuple[str, ...] = ()) -> Takes:
    return Takes(calls, frozenset(valid))


def _ok() -> torch.Tensor:
    return torch.ones(2)


def _accelerate() -> ModuleType:
    return importlib.import_module("zeroscan.integrations.accelerate")


def _deepspeed() -> ModuleType:
    return importlib.import_module("zeroscan.integrations.deepspeed")


def _lightning() -> ModuleType:
    return importlib.import_module("zeroscan.integrations.lightning")


def _distributed() -> ModuleType:
    return importlib.import_module("zeroscan.distributed")


def _checkpoint() -> ModuleType:
    return importlib.import_module("zeroscan.checkpoint")


def _cli() -> ModuleType:
    return importlib.import_module("zeroscan.cli")


# A list-taking call gets the bad input both as an item and as the list itself.
CALLS: dict[str, Takes] = {
    "zeroscan.stats": takes(lambda b: zeroscan.stats(b), lambda b: zeroscan.stats(b, histogram=True)),
    "zeroscan.stats_many": takes(lambda b: zeroscan.stats_many([_ok(), b]), lambda b: zeroscan.stats_many(b)),
    "zeroscan.scan_buffers": takes(lambda b: zeroscan.scan_buffers([_ok(), b]), lambda b: zeroscan.scan_buffers(b)),
    "zeroscan.diagnose": takes(lambda b: zeroscan.diagnose(b)),
    "zeroscan.diagnose_many": takes(lambda b: zeroscan.diagnose_many([_ok(), b]), lambda b: zeroscan.diagnose_many(b)),
    "zeroscan.diagnose_stats": takes(lambda b: zeroscan.diagnose_stats(b)),  # takes a Stats
    "zeroscan.reference_stats": takes(lambda b: zeroscan.reference_stats(b)),
    "zeroscan.reference_histogram": takes(lambda b: zeroscan.reference_histogram(b)),
    "zeroscan.headroom": takes(lambda b: zeroscan.headroom(b, "e4m3")),  # takes a Histogram
    "zeroscan.headroom_of": takes(lambda b: zeroscan.headroom_of(b, "e4m3")),
    "zeroscan.mx_headroom": takes(lambda b: zeroscan.mx_headroom(b, "e4m3")),
    "zeroscan.guard": takes(lambda b: zeroscan.guard(b)),  # takes an optimizer
    "zeroscan.StepGuard": takes(lambda b: zeroscan.StepGuard(b)),
    "zeroscan.Monitor": takes(lambda b: zeroscan.Monitor(b)),  # takes a model
    "zeroscan.Thresholds": takes(lambda b: zeroscan.Thresholds(b)),  # takes a fraction
    # Paths: a str is one, and a missing file is a CheckpointError naming the file.
    "zeroscan.open_checkpoint": takes(lambda b: zeroscan.open_checkpoint(b), valid=("str",)),
    "zeroscan.scan_checkpoint": takes(lambda b: zeroscan.scan_checkpoint(b), valid=("str",)),
    "zeroscan.checkpoint.diff_checkpoints": takes(lambda b: _checkpoint().diff_checkpoints(b, "b.pt"), valid=("str",)),
    "zeroscan.checkpoint.dtype_name": takes(lambda b: _checkpoint().dtype_name(b)),  # takes a dtype
    "zeroscan.checkpoint.scannable": takes(lambda b: _checkpoint().scannable(b)),
    "zeroscan.checkpoint.dtype_skip_reason": takes(lambda b: _checkpoint().dtype_skip_reason(b), valid=("str",)),
    "zeroscan.distributed.stats": takes(lambda b: _distributed().stats(b)),
    "zeroscan.distributed.stats_many": takes(
        lambda b: _distributed().stats_many([_ok(), b]), lambda b: _distributed().stats_many(b)
    ),
    "zeroscan.distributed.combine_rows": takes(lambda b: _distributed().combine_rows(b)),
    "zeroscan.distributed.compare_replicas": takes(lambda b: _distributed().compare_replicas(b)),
    "zeroscan.distributed.drop_uncounted": takes(lambda b: _distributed().drop_uncounted(b, [])),
    "zeroscan.distributed.gather_rows": takes(lambda b: _distributed().gather_rows(b)),
    "zeroscan.distributed.local_part": takes(lambda b: _distributed().local_part(b)),
    "zeroscan.distributed.merge_stats": takes(lambda b: _distributed().merge_stats(b)),
    "zeroscan.integrations.accelerate.monitor": takes(lambda b: _accelerate().monitor(b, nn.Linear(2, 2))),
    "zeroscan.integrations.accelerate.log": takes(lambda b: _accelerate().log(b, {})),
    "zeroscan.integrations.deepspeed.monitor": takes(lambda b: _deepspeed().monitor(b)),
    "zeroscan.integrations.lightning.ZeroscanCallback": takes(lambda b: _lightning().ZeroscanCallback(every=b)),
    # None is the process's own command line (sys.argv).
    "zeroscan.cli.main": takes(lambda b: _cli().main(b), valid=("None",)),
}

RESULT = "a result zeroscan makes and returns; its constructor is not called on user input"
ENUM = "an enum: calling it looks a member up by value"
ERROR = "an exception class"
NOT_CALLED: dict[str, str] = {
    **{f"zeroscan.{n}": RESULT for n in (
        "Bound", "Diagnosis", "Finding", "GuardReport", "Headroom", "Histogram", "Report", "SkippedStep", "Stats",
        "StatsBatch",
    )},
    **{f"zeroscan.{n}": ENUM for n in ("Cause", "Severity", "Verdict")},
    "zeroscan.CheckpointError": ERROR,
    "zeroscan.checkpoint.CheckpointScan": RESULT,
    "zeroscan.checkpoint.TensorEntry": RESULT,
    "zeroscan.checkpoint.TensorTable": "the base class of an opened checkpoint (open_checkpoint makes them)",
    "zeroscan.checkpoint.ProgressFn": "a type: the signature of a progress callback",
    "zeroscan.monitor.Slot": RESULT,
    **{f"zeroscan.distributed.{n}": RESULT for n in (
        "GatheredRows", "GlobalStats", "LocalPart", "PendingMerge", "ReplicaMismatch", "ReplicaReport",
    )},
    "zeroscan.cli.UsageError": ERROR,
    "zeroscan.cli.build_parser": "takes no argument",
}

def test_every_public_callable_has_an_entry() -> None:
    public = set(public_callables())
    listed = set(CALLS) | set(NOT_CALLED)
    assert not public - listed, f"public callables without an entry in CALLS or NOT_CALLED: {sorted(public - listed)}"
    assert not listed - public, f"entries for names that are no public callable: {sorted(listed - public)}"


@pytest.mark.parametrize("name", list(CALLS))
def test_bad_input_is_refused_in_one_line_naming_the_call(name: str) -> None:
    entry = CALLS[name]
    with Checklist() as checks:
        for kind, make in BAD_INPUTS.items():
            if kind in entry.valid:
                continue
            for k, call in enumerate(entry.calls):
                with checks.case(f"{kind} (call {k})"):
                    message = refusal(call, make())
                    assert message.startswith(f"{name}: "), message
                    assert "\n" not in message.strip(), message


def refusal(call: Callable[[object], object], bad: object) -> str:
    """The message of the TypeError or ValueError that call(bad) raises; any
    other error goes on to the test."""
    try:
        call(bad)
    except (TypeError, ValueError) as e:
        return str(e)
    raise AssertionError(f"not refused: {type(bad).__name__} was accepted")


def _replica_report(**options: object) -> object:
    """GatheredRows.replica_report(**options) of two ranks' rows for the
    same two tensors, as gather_rows gives them (no collective)."""
    rows = zeroscan.scan_buffers([torch.ones(3), torch.arange(4.0)])[0]
    return _distributed().GatheredRows(torch.stack([rows, rows]), (0, 1)).replica_report(**options)


def _rows(n: int) -> torch.Tensor:
    return zeroscan.scan_buffers([torch.ones(2)] * n)[0]


# Bad values of the arguments after the first, and of a public method the
# walk above does not call: the unnamed members of the family. report_every,
# and a 2-D ndarray (whose repr spans lines) as `every`, stand beside the
# tensor the issue named; the replica comparison's names, rtol and indices
# reach the rows only through GatheredRows.replica_report and
# compare_replicas; then drop_uncounted's parts, local_part's grouped, and
# rows of three dimensions where gather_rows takes [N, 16].
LIGHTNING = "zeroscan.integrations.lightning.ZeroscanCallback"
REPORT = "zeroscan.distributed.GatheredRows.replica_report"
COMPARE = "zeroscan.distributed.compare_replicas"
DROP = "zeroscan.distributed.drop_uncounted"
OTHER_ARGUMENTS: dict[str, tuple[str, Callable[[], object]]] = {
    "report_every: a tensor": (LIGHTNING, lambda: _lightning().ZeroscanCallback(report_every=torch.arange(1000))),
    "every: a 2-D ndarray": (LIGHTNING, lambda: _lightning().ZeroscanCallback(every=numpy.ones((4, 4)))),
    "replica_report names: a str": (REPORT, lambda: _replica_report(names="ab")),
    "replica_report names: too few": (REPORT, lambda: _replica_report(names=["a"])),
    "replica_report rtol: a str": (REPORT, lambda: _replica_report(rtol="x")),
    "replica_report rtol: negative": (REPORT, lambda: _replica_report(rtol=-1.0)),
    "replica_report indices: out of range": (REPORT, lambda: _replica_report(indices=[5])),
    "replica_report indices: not ints": (REPORT, lambda: _replica_report(indices=["a"])),
    "compare_replicas names: too many": (
        COMPARE, lambda: _distributed().compare_replicas([torch.ones(2)], names=["a", "b"])
    ),
    "compare_replicas rtol: None": (COMPARE, lambda: _distributed().compare_replicas([torch.ones(2)], rtol=None)),
    "drop_uncounted parts: None": (DROP, lambda: _distributed().drop_uncounted(_rows(1), None)),
    "drop_uncounted parts: not LocalParts": (DROP, lambda: _distributed().drop_uncounted(_rows(1), [torch.ones(2)])),
    "drop_uncounted parts: too few": (DROP, lambda: _distributed().drop_uncounted(_rows(2), [])),
    "local_part grouped: a str": (
        "zeroscan.distributed.local_part", lambda: _distributed().local_part(torch.ones(2), grouped="yes")
    ),
    "gather_rows rows: three dimensions": (
        "zeroscan.distributed.gather_rows", lambda: _distributed().gather_rows(_rows(2).unsqueeze(0))
    ),
}


@pytest.mark.parametrize("case", list(OTHER_ARGUMENTS))
def test_other_bad_arguments_are_refused_in_one_line_naming_the_call(case: str) -> None:
    name, call = OTHER_ARGUMENTS[case]
    message = refusal(lambda _: call(), None)
    assert message.startswith(f"{name}: "), message
    assert "\n" not in message.strip(), message


@pytest.mark.parametrize("argument", ["every", "history", "trace_nonfinite"])
def test_the_monitor_describes_a_tensor_argument_in_one_line(argument: str) -> None:
    """A tensor passed where the Monitor wants an int or a bool (not named by
    the issue): described by kind, dtype and shape, not by its many-line repr."""
    with pytest.raises((TypeError, ValueError)) as info:
        zeroscan.Monitor(torch.nn.Linear(2, 2), None, **{argument: torch.zeros(40, 40)})
    message = str(info.value)
    assert message.startswith(f"zeroscan.Monitor: {argument} must be ") and "\n" not in message, message
    assert message.endswith("got a float32 tensor of shape [40, 40]"), message
