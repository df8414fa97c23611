"""zeroscan.Monitor: every gradient and weight of a model, every step, cheaply.

How a training loop uses it:

    with zeroscan.Monitor(model, optimizer) as monitor:
        for x, y in data:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()          # the Monitor scans here, just before the update
    print(monitor.report())

With an optimizer (and auto=True, the default) the Monitor scans from a step
pre-hook of the optimizer, so the loop needs no change. Without one (or with
auto=False), call `monitor.step()` once per optimizer step, after backward()
and any clipping, before zero_grad(); `monitor.step(loss)` also lets the
cause analysis start from the loss instead of the model's outputs.

What one monitored step costs: one zeroscan stats_many call per device over
every gradient and every weight. Its int64 result buffer stays on the device
in a bounded ring (`history` steps); nothing is read, so there is no host
sync, until `report()` copies the ring once per device and judges it.

Why a gradient is None (the cause analysis): a root forward hook keeps the
grad_fn of the model's outputs from the last forward pass of a monitored
step. When a parameter that requires grad has no gradient, the autograd graph
is walked from those outputs (and from the loss given to step()) through
`Node.next_functions` to the `AccumulateGrad` leaves; `AccumulateGrad.variable`
is the parameter, so the walk says which parameters the graph reaches
(reached but no grad: backward has not run). To tell a detached parameter from
an unused one, the Monitor then probes one forward pass: a TorchFunctionMode
records which parameters enter which torch function in which module, whether
under torch.no_grad(), and where forward calls .detach(), .data, .item(),
.tolist() or .numpy() on a tensor that requires grad. The probe runs on the
first monitored step and again only when an unexplained None gradient shows
up, so healthy training never pays for it. Activations passed through
torch.nn.functional calls are not seen by the activation hooks; only modules
(nn.ReLU, nn.ReLU6, nn.GELU, nn.Softmax) are.

Across ranks (`process_group=`): each monitored step scans exactly as above,
a DTensor parameter or gradient (FSDP2, tensor parallel) through its local
shard (a Partial placement is reduced first, a collective of its own) and a
plain tensor as one data-parallel replica (DDP), then packs the
rows into one int64 [2P + 1, 16] buffer (a gradient and a weight row for each
of the P parameters, and a header row: step, P, a checksum of the names) and
issues ONE asynchronous all_gather of it on the group (zeroscan.distributed).
The pending gather stays in the ring with its step; nothing is waited for
until report(), which then judges global rows:
  sharded tensors    the ranks' rows merged exactly (counts summed, min/max
                     reduced, moments by Chan's formula): the statistics of
                     the full tensor; a non-finite value is reported with the
                     ranks whose shards hold it.
  replicated tensors (plain tensors, all-Replicate DTensors) compared across
                     ranks: their common value when the ranks agree (rank 0's
                     bits), else a "replica_mismatch" finding naming the
                     ranks that differ (a NaN gradient on one rank only, a
                     diverged weight) and the majority's value.
report() issues no collective of its own: it only waits for the all_gathers
that the recorded steps issued, and each completes once every rank of the
group has run that step. Every rank that calls it gets the same global
findings; calling it on some ranks only (rank 0, to log) is safe, and such a
rank blocks until the others have passed the steps it reads. What stays
this rank's own: the cause analysis of a None gradient, activation findings
(this rank's batch) and notes on tensors that could not be scanned.
Every rank must build its Monitor on the same model (after wrapping it in DDP
or fully_shard), with the same `every`, and step it the same number of times:
the gathers pair up by order, and report() raises if the header rows disagree.
The ring keeps each step's gathered buffer, world_size x (2P + 1) x 128 bytes
on the device the group's backend uses, until report() has read it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from zeroscan import distributed as zdist
from zeroscan.diagnosis import Severity, check_fraction
from zeroscan.ops import NUM_FIELDS  # importing zeroscan.ops registers torch.ops.zeroscan
from zeroscan.stats import decode, is_dtensor

KINDS = ("grad", "weight", "activation", "param")
GLOBAL_NAME = "(all parameters)"
MAX_CALLS_PER_STEP = 8  # activation calls of one module scanned per step
RELU_FAMILY = (nn.ReLU, nn.ReLU6, nn.GELU)
_DATA_GETTER = torch._C.TensorBase.__dict__.get("data")
# Columns 13..15 of a result row are zero from the scan; across ranks the
# Monitor marks its packed rows there (the merge and the comparison read 0..12).
_SHARDED_COL = 14  # 1: a sharded DTensor's row (merged across ranks, not compared)
_PRESENT_COL = 15  # 1: this rank scanned the tensor (0: no gradient, or not scannable)
_CUT_METHODS = {
    torch.Tensor.detach: ".detach()",
    torch.Tensor.item: ".item()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.numpy: ".numpy()",
}


@dataclass(frozen=True)
class Finding:
    """One thing wrong (or worth knowing) about one tensor.

    kind: "grad", "weight", "activation" or "param" (the parameter as a whole).
    cause: a machine-readable code, for example "detached", "frozen",
    "not_in_optimizer", "plain_attribute", "unused", "no_backward",
    "exact_zero", "mostly_zero", "underflow", "vanishing", "exploding",
    "nonfinite", "not_updated", "frozen_in_time", "dead_units",
    "saturated_softmax", "norm_drift", "zero_fraction_rising", "not_scanned",
    and across ranks "replica_mismatch", "missing_on_ranks".
    ranks: with a process group, the (global) ranks the finding is about
    where that is known (the replicas that differ, the shards that hold a
    non-finite value); None otherwise.
    """

    name: str
    kind: str
    severity: Severity
    cause: str
    message: str
    ranks: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """name, kind, severity, cause, message; plus "ranks" (a list) only
        when the finding names ranks."""
        out: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "severity": self.severity.name.lower(),
            "cause": self.cause,
            "message": self.message,
        }
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
        return out


@dataclass(frozen=True)
class Thresholds:
    """What the Monitor calls a problem; every value has a documented default.

    mostly_zero: gradient exact-zero fraction reported as "mostly_zero" (INFO).
    underflow: fraction of a gradient's nonzero values that are subnormal from
        which it is reported as "underflow".
    vanishing / exploding: bounds on ||grad|| / ||weight|| (weights of norm 0
        are skipped). 1e-7 is about float32 eps: an SGD step with lr <= 1
        cannot move the weight. 1e3: one step with lr 1e-3 would move it by
        more than its own norm.
    dead_units: fraction of an activation's units that are exactly zero for
        the whole batch (WARNING; all of them is an ERROR).
    saturated: fraction of softmax rows whose largest probability is within
        the dtype's eps of 1 (their gradient is gone).
    drift_window, drift_factor: a gradient norm that fell by drift_factor or
        more over the last drift_window monitored steps, with at least 90 %
        of those steps falling, is "norm_drift"; a gradient zero fraction that
        rose by 0.25 or more to at least 0.5 over the window is
        "zero_fraction_rising".
    frozen_window: a weight unchanged for this many monitored steps although
        its gradient was nonzero is "frozen_in_time" (fewer: "not_updated").
    replica_rtol: across ranks, replicas agree when their counts and min/max
        |x| are equal and their mean and sum of squared deviations differ by
        at most this, relative to their scale (another reduction order); DDP
        gradients after the all-reduce are bitwise equal.
    """

    mostly_zero: float = 0.5
    underflow: float = 0.01
    vanishing: float = 1e-7
    exploding: float = 1e3
    dead_units: float = 0.5
    saturated: float = 0.5
    drift_window: int = 20
    drift_factor: float = 100.0
    frozen_window: int = 8
    replica_rtol: float = 1e-9

    def __post_init__(self) -> None:
        op = "zeroscan.Thresholds"
        for name in ("mostly_zero", "underflow", "dead_units", "saturated"):
            check_fraction(op, name, getattr(self, name))
        for name in ("vanishing", "exploding", "drift_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{op}: {name} must be a positive number, got {value!r}")
        rtol = self.replica_rtol
        if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 <= rtol < 1:
            raise ValueError(f"{op}: replica_rtol must be a number in [0, 1), got {rtol!r}")
        for name in ("drift_window", "frozen_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"{op}: {name} must be an int >= 2, got {value!r}")


class Report:
    """What the Monitor saw: findings ranked by severity, the latest scan of
    every tensor, and the per-step history (see to_dict for the schema)."""

    def __init__(
        self,
        step: int,
        findings: list[Finding],
        tensors: list[dict[str, Any]],
        history: dict[str, Any],
    ) -> None:
        self.step = step
        self.findings = findings
        self.tensors = tensors
        self.history = history

    @property
    def worst(self) -> Severity:
        return max((f.severity for f in self.findings), default=Severity.OK)

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    def to_dict(self) -> dict[str, Any]:
        """{"step", "findings": [Finding.to_dict(), with "ranks" where a finding
        names ranks], "tensors": [per tensor:
        name, kind, numel, zero_fraction, subnormal_fraction,
        near_zero_fraction, nan, inf, norm, mean, std, min_abs, max_abs],
        "history": {"steps", "names", "grad_norm", "zero_fraction",
        "underflow_fraction"}}; floats are Python floats, nan where unknown."""
        return {
            "step": self.step,
            "findings": [f.to_dict() for f in self.findings],
            "tensors": [dict(t) for t in self.tensors],
            "history": {
                "steps": list(self.history["steps"]),
                "names": list(self.history["names"]),
                "grad_norm": [list(r) for r in self.history["grad_norm"]],
                "zero_fraction": [list(r) for r in self.history["zero_fraction"]],
                "underflow_fraction": [list(r) for r in self.history["underflow_fraction"]],
            },
        }

    def to_json_lines(self) -> str:
        """One JSON object per line: each finding ("type": "finding") then each
        tensor ("type": "tensor"), all with "step". NaN and inf become null."""
        lines = []
        for f in self.findings:
            lines.append({"type": "finding", "step": self.step, **f.to_dict()})
        for t in self.tensors:
            lines.append({"type": "tensor", "step": self.step, **{k: _json_value(v) for k, v in t.items()}})
        return "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines)

    def plot(self, path: str) -> Any:
        """Draws the report with zeroscan.plot.plot_report (needs matplotlib)."""
        from zeroscan.plot import plot_report

        return plot_report(self.to_dict(), path)

    def __str__(self) -> str:
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in Severity}
        head = f"zeroscan report · step {self.step} · {len(self.tensors)} tensors scanned"
        if not self.findings:
            return head + " · no findings"
        summary = ", ".join(
            f"{counts[s]} {s.name.lower()}{'s' if counts[s] > 1 and s != Severity.INFO else ''}"
            for s in reversed(Severity)
            if counts[s]
        )
        rows = [("SEVERITY", "NAME", "KIND", "CAUSE", "MESSAGE")]
        rows += [(f.severity.name, f.name, f.kind, f.cause, f.message) for f in self.findings]
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        lines = [f"{head} · {summary}"]
        for r in rows:
            lines.append("  ".join(r[c].ljust(widths[c]) for c in range(4)) + "  " + r[4])
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Report(step={self.step}, findings={len(self.findings)}, worst={self.worst.name})"


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


_Row = tuple[dict[str, float | int], tuple[int, ...]]  # a decoded result row and its raw int64 values


@dataclass
class _Param:
    index: int
    name: str
    aliases: tuple[str, ...]
    tensor: torch.Tensor
    owner: str  # qualified name of the module holding it, "" for the root
    embedding: bool  # rows of tokens absent from a batch get zero gradient by design


class _Record:
    """One monitored step: raw result buffers (still on their devices) and
    what the Python side knew at that step."""

    __slots__ = (
        "step", "groups", "requires_grad", "none_causes", "activations", "notes", "rows", "acts",
        "gather", "rank_findings", "shard_ranks",
    )

    def __init__(self, step: int) -> None:
        self.step = step
        self.groups: list[tuple[list[int], torch.Tensor]] = []  # codes (2i grad, 2i+1 weight), [N,16]
        self.requires_grad: tuple[bool, ...] = ()
        self.none_causes: dict[int, tuple[str, str]] = {}
        self.activations: list[tuple[str, str, torch.Tensor]] = []  # name, "relu"|"softmax", [2,16]
        self.notes: list[tuple[str, str]] = []  # (name, why it was not scanned)
        self.rows: dict[int, tuple[dict[str, float | int], tuple[int, ...]]] | None = None
        self.acts: list[tuple[str, str, dict[str, float | int], dict[str, float | int]]] | None = None
        # Across ranks: the pending all_gather of this step's packed rows (dropped once
        # decoded), findings about ranks that disagree, and for codes whose merged
        # shards hold non-finite values the ranks whose shards hold them.
        self.gather: zdist.PendingMerge[zdist.GatheredRows] | None = None
        self.rank_findings: dict[int, Finding] = {}
        self.shard_ranks: dict[int, tuple[int, ...]] = {}


class _Probe(TorchFunctionMode):
    """Records, during one forward pass, how each parameter is used and where
    the autograd graph is cut (see the module doc)."""

    def __init__(self, pindex: dict[int, int]) -> None:
        super().__init__()
        self.pindex = pindex
        self.stack: list[str] = []
        self.ran: set[str] = set()
        self.no_grad_modules: set[str] = set()
        self.used: dict[int, str] = {}
        self.no_grad_use: dict[int, str] = {}
        self.detached: dict[int, str] = {}
        self.cuts: list[tuple[str, str]] = []
        self.handles: list[Any] = []
        self.active = False
        self.done = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            self._observe(func, args, kwargs)
        except Exception:  # observing must never break the forward pass
            pass
        return func(*args, **kwargs)

    def _observe(self, func: Any, args: tuple, kwargs: dict) -> None:
        where = self.stack[-1] if self.stack else ""
        cut = _CUT_METHODS.get(func)
        if cut is None and getattr(func, "__self__", None) is _DATA_GETTER and _DATA_GETTER is not None:
            cut = ".data"
        grad_on = torch.is_grad_enabled()
        for t in _tensors_in(args, kwargs):
            i = self.pindex.get(id(t))
            if i is not None:
                if cut in (".detach()", ".data"):
                    self.detached.setdefault(i, where)
                elif grad_on:
                    self.used.setdefault(i, where)
                else:
                    self.no_grad_use.setdefault(i, where)
        if cut is not None and args and isinstance(args[0], torch.Tensor):
            first = args[0]
            if first.requires_grad and id(first) not in self.pindex and len(self.cuts) < 16:
                self.cuts.append((cut, where))

    def enter_module(self, name: str, root_grad: bool) -> None:
        self.stack.append(name)
        self.ran.add(name)
        if root_grad and not torch.is_grad_enabled():
            self.no_grad_modules.add(name)

    def leave_module(self) -> None:
        if self.stack:
            self.stack.pop()


def _tensors_in(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _output_grad_fns(output: Any, found: list[Any], depth: int = 0) -> None:
    if isinstance(output, torch.Tensor):
        if output.grad_fn is not None:
            found.append(output.grad_fn)
    elif depth < 4 and isinstance(output, (list, tuple)):
        for o in output:
            _output_grad_fns(o, found, depth + 1)
    elif depth < 4 and isinstance(output, dict):
        for o in output.values():
            _output_grad_fns(o, found, depth + 1)


class Monitor:
    """Watches a model's gradients, weights and (optionally) activations.

    model: the nn.Module whose parameters are scanned (named as in
        model.named_parameters(); tied parameters are scanned once).
    optimizer: optional; enables the "not_in_optimizer" check, lr-0 hints,
        and (auto=True) scanning from the optimizer's step pre-hook.
    every: scan one step in `every` (steps are counted from 0; step 0 is scanned).
    history: how many monitored steps the on-device ring keeps.
    activations: hook nn.ReLU / nn.ReLU6 / nn.GELU (dead units) and
        nn.Softmax (saturated rows) modules.
    thresholds: a Thresholds (defaults documented there).
    process_group: a torch.distributed process group (dist.group.WORLD for
        all ranks): the report then shows global findings, sharded tensors
        merged and replicas compared across the group's ranks (see the module
        doc). Every DTensor parameter's device mesh must hold exactly the
        group's ranks. None (the default): this rank alone.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        every: int = 1,
        *,
        history: int = 64,
        activations: bool = False,
        auto: bool = True,
        thresholds: Thresholds | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        op = "zeroscan.Monitor"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{op}: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"{op}: every must be an int >= 1, got {every!r}")
        if isinstance(history, bool) or not isinstance(history, int) or history < 2:
            raise ValueError(f"{op}: history must be an int >= 2, got {history!r}")
        if thresholds is not None and not isinstance(thresholds, Thresholds):
            raise TypeError(f"{op}: thresholds must be a zeroscan.Thresholds, got {type(thresholds).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.thresholds = thresholds or Thresholds()
        self._params = _collect_params(model)
        self._pindex = {id(p.tensor): p.index for p in self._params}
        self._group = _check_group(op, process_group, self._params)
        self._names_crc = zlib.crc32("\n".join(p.name for p in self._params).encode())
        self._layouts: dict[tuple[Any, ...], tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]] = {}
        self._records: deque[_Record] = deque(maxlen=history)
        self._count = 0
        self._closed = False
        self._fast = True
        self._handles: list[Any] = []
        self._roots: list[Any] = []
        self._forward_seen = False
        self._forward_grad = True
        self._acts: list[tuple[str, str, torch.Tensor]] = []
        self._act_calls: dict[str, int] = {}
        self._act_notes: list[tuple[str, str]] = []
        self._probe: _Probe | None = None
        self._probe_next = False
        self._causes: dict[int, tuple[str, str]] = {}
        self._in_auto = False
        self._auto = bool(auto and optimizer is not None)
        self._handles.append(model.register_forward_pre_hook(self._root_pre))
        self._handles.append(model.register_forward_hook(self._root_post, always_call=True))
        if activations:
            for name, module in model.named_modules():
                tag = None
                if isinstance(module, nn.Softmax):
                    tag = "softmax"
                elif isinstance(module, RELU_FAMILY):
                    tag = "relu"
                if tag is not None:
                    self._handles.append(module.register_forward_hook(self._activation_hook(name or "(model)", tag)))
        if self._auto:
            assert optimizer is not None
            self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_step))
        self._arm_probe()  # the first monitored forward pass is probed

    # ---- lifecycle -------------------------------------------------------

    def __enter__(self) -> Monitor:
        self._check_open("__enter__")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Removes every hook this Monitor registered; safe to call twice.
        report() keeps working on what was recorded."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._drop_probe()
        self._roots = []
        self._acts = []

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def steps_seen(self) -> int:
        return self._count

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"zeroscan.Monitor.{what}: this Monitor is closed; create a new one")

    def _monitored(self) -> bool:
        return not self._closed and self._count % self.every == 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Monitor({type(self.model).__name__}, {len(self._params)} parameters, every={self.every}, {state})"

    # ---- hooks -----------------------------------------------------------

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if not self._monitored():
            return
        self._forward_seen = True
        self._forward_grad = torch.is_grad_enabled()
        probe = self._probe
        if probe is not None and not probe.active and not probe.done:
            probe.active = True
            probe.__enter__()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        probe = self._probe
        if probe is not None and probe.active:
            probe.__exit__(None, None, None)
            probe.active = False
            probe.done = True
        if not self._monitored() or not torch.is_grad_enabled():
            return
        roots: list[Any] = []
        _output_grad_fns(output, roots)
        self._roots = roots  # the latest forward pass of this step

    def _activation_hook(self, name: str, tag: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._monitored() or not isinstance(output, torch.Tensor):
                return
            if not output.is_floating_point() or output.layout != torch.strided:
                return
            calls = self._act_calls.get(name, 0)
            if calls >= MAX_CALLS_PER_STEP:
                return
            self._act_calls[name] = calls + 1
            key = name if calls == 0 else f"{name}#{calls}"
            try:
                with torch.no_grad():
                    if tag == "softmax":
                        unit = _softmax_gap(output, module)
                    else:
                        unit = _unit_peak(output, nonneg=isinstance(module, (nn.ReLU, nn.ReLU6)))
                    buffer = _native_many([output, unit])
                self._acts.append((key, tag, buffer))
            except Exception as err:  # report, never break the forward pass
                self._act_notes.append((key, f"not scanned: {err}"))

        return hook

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_auto = True
        try:
            self._advance(None)
        finally:
            self._in_auto = False

    # ---- stepping --------------------------------------------------------

    def step(self, loss: torch.Tensor | None = None) -> None:
        """Marks the end of one training step (call after backward, before
        zero_grad). Scans on monitored steps; never reads the results."""
        self._check_open("step")
        if self._auto and not self._in_auto:
            raise RuntimeError(
                "zeroscan.Monitor.step: this Monitor already scans at every optimizer.step() "
                "(it was given an optimizer with auto=True); drop the manual step() call, "
                "or create the Monitor with auto=False"
            )
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise TypeError(f"zeroscan.Monitor.step: loss must be a tensor or None, got {type(loss).__name__}")
        self._advance(loss)

    def _advance(self, loss: torch.Tensor | None) -> None:
        step = self._count
        monitored = self._monitored()
        self._count += 1
        if monitored:
            self._records.append(self._scan(step, loss))
            if self._probe is not None and self._probe.done:
                self._drop_probe()
            if self._probe_next:
                self._arm_probe()
        self._roots = []
        self._forward_seen = False
        self._acts = []
        self._act_calls = {}
        self._act_notes = []

    def _scan(self, step: int, loss: torch.Tensor | None) -> _Record:
        record = _Record(step)
        tensors: list[torch.Tensor] = []
        codes: list[int] = []
        requires_grad = []
        missing = []
        for p in self._params:
            t = p.tensor
            g = t.grad
            rg = t.requires_grad
            requires_grad.append(rg)
            if g is not None:
                tensors.append(g)
                codes.append(2 * p.index)
            elif rg:
                missing.append(p.index)
            tensors.append(t)
            codes.append(2 * p.index + 1)
        record.requires_grad = tuple(requires_grad)
        with torch.no_grad():
            if self._group is None:
                record.groups = self._run(tensors, codes, record.notes)
            else:
                record.groups, record.gather = self._scan_across_ranks(step, tensors, codes, record.notes)
        record.activations = self._acts
        record.notes.extend(self._act_notes)
        if missing:
            record.none_causes = self._explain(missing, loss)
        return record

    def _run(
        self, tensors: list[torch.Tensor], codes: list[int], notes: list[tuple[str, str]]
    ) -> list[tuple[list[int], torch.Tensor]]:
        if not tensors:
            return []
        if self._fast:
            try:
                return [(codes, _native_many(tensors))]
            except (RuntimeError, ValueError, TypeError):
                self._fast = False  # several devices, or a tensor that needs preparing
        by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
        for t, code in zip(tensors, codes):
            ready, why = _scannable(t)
            if ready is None:
                what = "grad" if code % 2 == 0 else "weight"
                notes.append((f"{self._params[code // 2].name}:{what}", why))
                continue
            entry = by_device.setdefault(ready.device, ([], []))
            entry[0].append(code)
            entry[1].append(ready)
        groups = []
        for group_codes, group in by_device.values():
            try:
                groups.append((group_codes, _native_many(group)))
            except (RuntimeError, ValueError, TypeError) as err:
                for code in group_codes:
                    what = "grad" if code % 2 == 0 else "weight"
                    notes.append((f"{self._params[code // 2].name}:{what}", f"not scanned: {err}"))
        return groups

    def _scan_across_ranks(
        self, step: int, tensors: list[torch.Tensor], codes: list[int], notes: list[tuple[str, str]]
    ) -> tuple[list[tuple[list[int], torch.Tensor]], zdist.PendingMerge[zdist.GatheredRows]]:
        """Scans this rank's parts and starts the one all_gather of the step."""
        # No DTensor can exist before torch.distributed.tensor is imported.
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        local = list(tensors)
        sharded: list[int] = []
        uncounted: list[int] = []
        if dtensor is not None:
            for k, (t, code) in enumerate(zip(tensors, codes)):
                if isinstance(t, dtensor):
                    part = zdist.local_part(t)
                    local[k] = part.tensor
                    if part.mode == zdist.MODE_SHARDED:
                        sharded.append(code)
                        if not part.counted:
                            uncounted.append(code)
        groups = self._run(local, codes, notes)
        device = zdist.comm_device(self._group, groups[0][1].device if groups else torch.device("cpu"))
        key = (device, tuple(tuple(c) for c, _ in groups), tuple(sharded), tuple(uncounted))
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 8:
                self._layouts.clear()
            layout = self._layouts[key] = self._layout(device, groups, sharded, uncounted)
        template, copies = layout
        packed = template.clone()
        for (dest, src), (_, buffer) in zip(copies, groups):
            rows = buffer.to(device)
            packed.index_copy_(0, dest, rows if src is None else rows.index_select(0, src))
        packed[:, _SHARDED_COL:].copy_(template[:, _SHARDED_COL:])  # the marks the copies overwrote
        packed[2 * len(self._params), 0] = step
        pending = zdist.gather_rows(packed, self._group, async_op=True)
        return groups, pending  # type: ignore[return-value]

    def _layout(
        self,
        device: torch.device,
        groups: list[tuple[list[int], torch.Tensor]],
        sharded: list[int],
        uncounted: list[int],
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]:
        """The packed buffer of a step before its rows are copied in (empty rows,
        the presence and sharded marks, the header) and, per device group, where
        its rows go. Built once per layout, so a step copies nothing from the host."""
        n = 2 * len(self._params)
        template = zdist.empty_rows(n + 1)
        present = [c for codes, _ in groups for c in codes]
        template[present, _PRESENT_COL] = 1
        template[sharded, _SHARDED_COL] = 1
        template[n, 1] = len(self._params)
        template[n, 2] = self._names_crc
        skip = set(uncounted)  # a replica of a shard that another rank contributes
        copies = []
        for codes, _ in groups:
            keep = [k for k, c in enumerate(codes) if c not in skip]
            dest = torch.tensor([codes[k] for k in keep], dtype=torch.int64, device=device)
            src = None if len(keep) == len(codes) else torch.tensor(keep, dtype=torch.int64, device=device)
            copies.append((dest, src))
        return template.to(device), copies

    # ---- why is a gradient None -----------------------------------------

    def _arm_probe(self) -> None:
        self._probe_next = False
        if self._probe is not None:  # still waiting for a monitored forward pass
            return
        probe = _Probe(self._pindex)
        monitor = self
        for name, module in self.model.named_modules():

            def pre(module: nn.Module, args: Any, label: str = name) -> None:
                if probe.active:
                    probe.enter_module(label, monitor._forward_grad)

            def post(module: nn.Module, args: Any, output: Any) -> None:
                if probe.active:
                    probe.leave_module()

            probe.handles.append(module.register_forward_pre_hook(pre))
            probe.handles.append(module.register_forward_hook(post, always_call=True))
        self._probe = probe

    def _drop_probe(self) -> None:
        probe = self._probe
        if probe is None:
            return
        if probe.active:
            probe.__exit__(None, None, None)
            probe.active = False
        for h in probe.handles:
            h.remove()
        probe.handles.clear()
        self._probe = None

    def _explain(self, missing: list[int], loss: torch.Tensor | None) -> dict[int, tuple[str, str]]:
        causes = {i: self._causes[i] for i in missing if i in self._causes}
        rest = [i for i in missing if i not in causes]
        if not rest:
            return causes
        roots = list(self._roots)
        reached = self._reachable(roots)
        from_loss = None
        if loss is not None and loss.grad_fn is not None:
            roots.append(loss.grad_fn)
            from_loss = self._reachable([loss.grad_fn])
        probe = self._probe if self._probe is not None and self._probe.done else None
        for i in rest:
            cause, message, stable = self._why_none(i, roots, reached, from_loss, probe, loss)
            causes[i] = (cause, message)
            if stable:
                self._causes[i] = (cause, message)
            elif probe is None:
                self._probe_next = True
        return causes

    def _reachable(self, roots: list[Any]) -> set[int]:
        found: set[int] = set()
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            var = getattr(node, "variable", None)
            if var is not None:
                i = self._pindex.get(id(var))
                if i is not None:
                    found.add(i)
            for nxt, _ in getattr(node, "next_functions", ()):
                if nxt is not None and id(nxt) not in seen:
                    stack.append(nxt)
        return found

    def _why_none(
        self,
        i: int,
        roots: list[Any],
        reached: set[int],
        from_loss: set[int] | None,
        probe: _Probe | None,
        loss: torch.Tensor | None,
    ) -> tuple[str, str, bool]:
        """(cause, message, stable): `reached` holds the parameters that the
        graph of the outputs reaches, `from_loss` those the loss reaches."""
        p = self._params[i]
        name = p.name
        if from_loss is not None and i in reached and i not in from_loss:
            return "unused", (
                f"{name} feeds the model's outputs, but the loss does not use the output it feeds "
                "(an auxiliary head or output left out of the loss)"
            ), False
        if i in reached or (from_loss is not None and i in from_loss):
            return "no_backward", (
                f"{name} is in the autograd graph of the outputs but has no gradient: backward() has not "
                "run since the forward pass, the loss does not use these outputs, the gradient was taken "
                "with torch.autograd.grad / backward(inputs=...), or zero_grad() ran before the scan"
            ), False
        if probe is not None:
            owner = self._module_label(p.owner)
            if i in probe.detached:
                where = self._module_label(probe.detached[i])
                return "detached", (
                    f"{name} is detached inside the forward of {where} (.detach() or .data on the parameter): "
                    "its use leaves nothing for backward; use the parameter itself"
                ), True
            if i in probe.used:
                where = self._module_label(probe.used[i])
                if probe.cuts:
                    cuts = ", ".join(dict.fromkeys(f"{c} in {self._module_label(m)}" for c, m in probe.cuts))
                    return "detached", (
                        f"{name} is used in forward (by {where}) but the path from it to the outputs is cut: "
                        f"{cuts}; a detached tensor (also after a .numpy()/.item()/.tolist() round trip) "
                        "carries no gradient back"
                    ), True
                return "unused", (
                    f"{name} is used in forward (by {where}) but its result never reaches the model's "
                    "outputs (computed, then discarded)"
                ), True
            if i in probe.no_grad_use:
                where = self._module_label(probe.no_grad_use[i])
                return "detached", (
                    f"{name} is used in {where} under torch.no_grad(), so nothing is recorded for backward"
                ), True
            if p.owner in probe.no_grad_modules:
                return "detached", f"{owner} ran under torch.no_grad(), so {name} gets no gradient", True
            if p.owner in probe.ran:
                return "unused", f"{owner} ran in forward but never used {name}", True
            if probe.ran:
                return "unused", (
                    f"{owner} never ran in forward, so {name} takes no part in the loss "
                    "(a module defined but not called, or a branch not taken)"
                ), True
        if not self._forward_seen and loss is None:
            return "no_backward", (
                f"{name} has no gradient and no forward pass of the model was seen this step "
                "(call Monitor.step() after forward and backward, or pass the loss: step(loss))"
            ), False
        if not self._forward_grad:
            return "detached", (
                f"the model's forward ran under torch.no_grad() or inference_mode, so {name} "
                "got no gradient"
            ), False
        where = "the loss" if loss is not None else "the model's outputs"
        return "not_reached", (
            f"backward from {where} does not reach {name}: it is unused in forward or detached on "
            "the way (.detach(), torch.no_grad(), a .numpy()/.item() round trip)"
            + ("" if roots else "; the outputs carry no autograd graph at all")
        ), False

    def _module_label(self, name: str) -> str:
        module = self.model.get_submodule(name) if name else self.model
        return f"{name} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"

    # ---- reporting -------------------------------------------------------

    def report(self) -> Report:
        """Reads the recorded history back (one copy per device) and judges it.
        With a process group it first waits for the recorded steps' gathers;
        it issues no collective itself (see the module doc)."""
        records = list(self._records)
        if self._group is None:
            _decode_records(records)
        else:
            self._decode_across_ranks(records)
        latest = records[-1] if records else None
        findings: list[tuple[int, Finding]] = []
        for order, f in self._static_findings(records):
            findings.append((order, f))
        if latest is not None:
            findings.extend(self._latest_findings(latest, records))
            findings.extend(self._history_findings(records))
        findings.sort(key=lambda of: (-int(of[1].severity), of[0]))
        return Report(
            latest.step if latest is not None else -1,
            [f for _, f in findings],
            self._tensor_rows(latest),
            self._history(records),
        )

    def _decode_across_ranks(self, records: list[_Record]) -> None:
        """Waits for the gathers of the records not decoded yet and gives them
        global rows (see the module doc); activations stay this rank's own."""
        todo = [r for r in records if r.rows is None]
        if not todo:
            return
        n = 2 * len(self._params)
        rtol = self.thresholds.replica_rtol
        gathered = []
        for r in todo:
            if r.gather is None:
                raise RuntimeError(f"zeroscan.Monitor.report: monitored step {r.step} has no gather to read")
            gathered.append(r.gather.wait())
        hosts = _to_host([_summarize(g.rows, n, rtol) for g in gathered])
        results = [self._global_rows(r, g, host) for r, g, host in zip(todo, gathered, hosts)]
        _decode_records(todo, own_rows=False)  # this rank's activations
        for r, (rows, rank_findings, shard_ranks) in zip(todo, results):
            r.rows = rows
            r.rank_findings = rank_findings
            r.shard_ranks = shard_ranks
            r.gather = None  # the global rows are all that later reports need

    def _global_rows(
        self, rec: _Record, gathered: zdist.GatheredRows, host: torch.Tensor
    ) -> tuple[dict[int, _Row], dict[int, Finding], dict[int, tuple[int, ...]]]:
        """The global rows of one step from its host summary (see _summarize),
        the findings about ranks that disagree, and the ranks whose shards hold
        non-finite values."""
        n = 2 * len(self._params)
        ranks = gathered.ranks
        glob = host[: NUM_FIELDS * n].view(n, NUM_FIELDS)
        flags = host[NUM_FIELDS * n : (NUM_FIELDS + _NUM_FLAGS) * n].view(n, _NUM_FLAGS).tolist()
        header = host[(NUM_FIELDS + _NUM_FLAGS) * n :].view(len(ranks), 3).tolist()
        want = [rec.step, len(self._params), self._names_crc]
        for rank, head in zip(ranks, header):
            if head != want:
                raise RuntimeError(
                    f"zeroscan.Monitor.report: rank {rank} recorded monitored step {head[0]} over {head[1]} "
                    f"parameters where this rank recorded step {rec.step} over {len(self._params)}"
                    f"{' with other parameter names' if head[:2] == want[:2] else ''}: every rank of the "
                    "process group must monitor the same model with the same `every` and step it as often"
                )
        if not all(f[_SAME_KIND] for f in flags):
            bad = [self._slot_name(c) for c, f in enumerate(flags) if not f[_SAME_KIND]]
            raise RuntimeError(
                f"zeroscan.Monitor.report: {', '.join(bad[:4])} is a sharded DTensor on some ranks and a "
                "plain tensor on others; every rank must wrap the model the same way"
            )
        fields = decode(glob)
        raw = glob.tolist()
        rows: dict[int, _Row] = {}
        for c, f in enumerate(flags):
            if (f[_ANY_PRESENT] if f[_IS_SHARDED] else raw[c][_PRESENT_COL]):
                rows[c] = (fields[c], tuple(raw[c]))
        differ = [c for c, f in enumerate(flags) if not f[_IS_SHARDED] and not f[_AGREE]]
        missing = [c for c, f in enumerate(flags) if f[_IS_SHARDED] and f[_ALL_PRESENT] != f[_ANY_PRESENT]]
        poisoned = [c for c, f in enumerate(flags) if f[_IS_SHARDED] and f[_NONFINITE]]
        rank_findings: dict[int, Finding] = {}
        shard_ranks: dict[int, tuple[int, ...]] = {}
        picked = sorted(set(differ + missing + poisoned))
        if not picked:
            return rows, rank_findings, shard_ranks
        per_rank = gathered.rows[:, picked].cpu()  # [W, k, 16]: only the tensors in question
        column = {c: k for k, c in enumerate(picked)}
        if differ:
            replicas = zdist.replica_report(gathered, rtol=self.thresholds.replica_rtol, indices=differ)
            for m in replicas.mismatches:
                block = per_rank[:, column[m.index]]
                reference = block[ranks.index(m.reference_ranks[0])]
                if int(reference[_PRESENT_COL]):
                    rows[m.index] = (decode(reference.unsqueeze(0))[0], tuple(reference.tolist()))
                else:
                    rows.pop(m.index, None)
                rank_findings[m.index] = self._mismatch_finding(m, block, ranks)
        for c in missing:
            lacking = tuple(r for k, r in enumerate(ranks) if not int(per_rank[k, column[c], _PRESENT_COL]))
            p = self._params[c // 2]
            kind = "grad" if c % 2 == 0 else "weight"
            what = "a gradient" if kind == "grad" else "a scan of its shard"
            rank_findings[c] = Finding(p.name, kind, Severity.ERROR, "missing_on_ranks", (
                f"{p.name} is sharded across the process group, but rank(s) {list(lacking)} hold no {what} "
                "(None there, or not scannable): its statistics merge the other ranks' shards only"
            ), lacking)
        for c in poisoned:
            block = decode(per_rank[:, column[c]])
            shard_ranks[c] = tuple(r for r, f in zip(ranks, block) if f["nan"] + f["posinf"] + f["neginf"])
        return rows, rank_findings, shard_ranks

    def _mismatch_finding(self, m: zdist.ReplicaMismatch, block: torch.Tensor, ranks: tuple[int, ...]) -> Finding:
        """A "replica_mismatch" finding; block: int64 [W, 16], every rank's row."""
        p = self._params[m.index // 2]
        grad = m.index % 2 == 0
        per_rank = decode(block)
        details = []
        for k, rank in enumerate(ranks):
            if rank not in m.ranks:
                continue
            if not int(block[k, _PRESENT_COL]):
                details.append(f"rank {rank} has no {'gradient' if grad else 'scan of it'}")
            elif per_rank[k]["nan"] + per_rank[k]["posinf"] + per_rank[k]["neginf"]:
                details.append(f"rank {rank} holds {_nonfinite_words(per_rank[k])}")
        absent = any(not int(block[k, _PRESENT_COL]) for k, rank in enumerate(ranks) if rank in m.ranks)
        shown = [] if absent else [(f, m.fields[f]) for f in _SHOWN_FIELDS if f in m.fields][:3]
        details.append("; ".join(
            f"{field} " + ", ".join(f"{_short(v)} on rank {r}" for r, v in zip(ranks, values))
            for field, values in shown
        ))
        tie = " (no majority: as many ranks on each side, so either side may be the wrong one)" if m.ambiguous else ""
        if grad:
            what = f"the gradient of {p.name}"
            hint = (
                "data-parallel replicas hold the same gradient after DDP's all-reduce, so it changed on those "
                "ranks afterwards (a hook, per-rank clipping or unscaling, a write to .grad) or was never "
                "all-reduced there (no_sync, a parameter outside DDP)"
            )
        else:
            what = p.name
            hint = (
                "the replicas have diverged: different initial weights (no broadcast from rank 0), different "
                "updates (optimizer state, learning rate or a step skipped on some ranks) or a write to the "
                "weights outside the optimizer"
            )
        return Finding(p.name, "grad" if grad else "weight", Severity.ERROR, "replica_mismatch", (
            f"{what} differs across data-parallel ranks: rank(s) {list(m.ranks)} disagree with rank(s) "
            f"{list(m.reference_ranks)}{tie}: {'; '.join(d for d in details if d)}; {hint}. "
            f"Its statistics in this report are those of rank(s) {list(m.reference_ranks)}"
        ), tuple(m.ranks))

    def _slot_name(self, code: int) -> str:
        return f"{self._params[code // 2].name}:{'grad' if code % 2 == 0 else 'weight'}"

    def _static_findings(self, records: list[_Record]) -> list[tuple[int, Finding]]:
        out: list[tuple[int, Finding]] = []
        order = len(self._params)
        for mod_name, module in self.model.named_modules():
            for attr, value in vars(module).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.requires_grad:
                    name = f"{mod_name}.{attr}" if mod_name else attr
                    out.append((order, Finding(name, "param", Severity.WARNING, "plain_attribute", (
                        f"{name} requires grad but is a plain tensor attribute of {self._module_label(mod_name)}, "
                        "not an nn.Parameter: model.parameters(), the optimizer and state_dict() never see it, "
                        f"so it is never trained; wrap it: self.{attr} = nn.Parameter(...)"
                    ))))
            for attr, value in module._buffers.items():
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    name = f"{mod_name}.{attr}" if mod_name else attr
                    out.append((order, Finding(name, "param", Severity.WARNING, "plain_attribute", (
                        f"{name} requires grad but is registered as a buffer, not an nn.Parameter: "
                        "the optimizer never sees it; use nn.Parameter"
                    ))))
        if self.optimizer is not None:
            in_opt = {id(t) for g in self.optimizer.param_groups for t in g["params"]}
            for p in self._params:
                if p.tensor.requires_grad and id(p.tensor) not in in_opt:
                    unchanged = _unchanged_for(records, p.index)
                    since = f"; its value has not changed for {unchanged} monitored steps" if unchanged > 1 else ""
                    out.append((p.index, Finding(p.name, "param", Severity.WARNING, "not_in_optimizer", (
                        f"{p.name} requires grad but is in none of the optimizer's param groups, so "
                        f"optimizer.step() never updates it{since}; pass it to the optimizer "
                        "(or set requires_grad_(False) if it is meant to stay fixed)"
                    ))))
        return out

    def _latest_findings(self, rec: _Record, records: list[_Record]) -> list[tuple[int, Finding]]:
        rows = rec.rows or {}
        out: list[tuple[int, Finding]] = []
        dead = [
            name for name, tag, _, unit in rec.acts or []
            if tag == "relu" and unit["numel"] and unit["zeros"] == unit["numel"]
        ]
        underflowing = any(
            int(rows[2 * p.index][0]["subnormal"]) > 0 for p in self._params if 2 * p.index in rows
        )
        in_opt = None if self.optimizer is None else {id(t) for g in self.optimizer.param_groups for t in g["params"]}
        for p in self._params:
            i, name = p.index, p.name
            grad = rows.get(2 * i)
            weight = rows.get(2 * i + 1)
            w = weight[0] if weight is not None else None
            for code in (2 * i, 2 * i + 1):
                if code in rec.rank_findings:
                    out.append((i, rec.rank_findings[code]))
            if w is not None and w["nan"] + w["posinf"] + w["neginf"]:
                out.append((i, _in_shards(Finding(name, "weight", Severity.ERROR, "nonfinite", (
                    f"{name} holds {_nonfinite_words(w)}: the weights are already poisoned; "
                    "look for the first step where the gradient went non-finite"
                )), rec.shard_ranks.get(2 * i + 1))))
            if i >= len(rec.requires_grad):
                continue
            if not rec.requires_grad[i]:
                out.append((i, Finding(name, "param", Severity.INFO, "frozen", (
                    f"{name} has requires_grad=False (frozen), so it gets no gradient; "
                    "if it should train, call requires_grad_(True) and give it to the optimizer"
                ))))
                continue
            if grad is None:
                cause, message = rec.none_causes.get(i, ("not_reached", f"{name} has no gradient"))
                severity = Severity.ERROR if cause == "detached" else Severity.WARNING
                out.append((i, Finding(name, "grad", severity, cause, message)))
                continue
            finding = self._grad_finding(p, grad[0], w, dead, records, underflowing)
            if finding is not None:
                if finding.cause == "nonfinite":
                    finding = _in_shards(finding, rec.shard_ranks.get(2 * i))
                out.append((i, finding))
            elif in_opt is None or id(p.tensor) in in_opt:
                finding = self._update_finding(p, records)
                if finding is not None:
                    out.append((i, finding))
        base = len(self._params)
        for k, (name, tag, act, unit) in enumerate(rec.acts or []):
            finding = self._activation_finding(name, tag, act, unit)
            if finding is not None:
                out.append((base + k, finding))
        for k, (name, why) in enumerate(rec.notes):
            out.append((base + k, Finding(name, "param", Severity.INFO, "not_scanned", why)))
        return out

    def _grad_finding(
        self,
        p: _Param,
        g: dict[str, float | int],
        w: dict[str, float | int] | None,
        dead: list[str],
        records: list[_Record],
        underflowing: bool,
    ) -> Finding | None:
        th = self.thresholds
        name = p.name
        n = int(g["numel"])
        if n == 0:
            return None
        if g["nan"] + g["posinf"] + g["neginf"]:
            return Finding(name, "grad", Severity.ERROR, "nonfinite", (
                f"the gradient of {name} holds {_nonfinite_words(g)}: an overflow, a division by zero, "
                "log/sqrt of a non-positive value, or a torch.where whose unselected branch is NaN; "
                "the optimizer step will poison the weights (use GradScaler / anomaly mode to find it)"
            ))
        zeros = int(g["zeros"])
        if zeros == n:
            if underflowing and p.tensor.dtype in (torch.float16, torch.bfloat16):
                return Finding(name, "grad", Severity.WARNING, "underflow", (
                    f"every entry of the gradient of {name} is exactly zero while other {_dtype_name(p.tensor.dtype)} "
                    "gradients of this step are subnormal: it most likely underflowed to zero. Scale the "
                    "loss (torch.amp.GradScaler), use bfloat16, or keep float32 master gradients"
                ))
            if dead:
                why = (
                    f"the activation{'s' if len(dead) > 1 else ''} {', '.join(dead)} "
                    f"{'are' if len(dead) > 1 else 'is'} dead (every unit zero for the whole batch) "
                    "and pass no gradient"
                )
            else:
                why = (
                    "a dead ReLU, a mask or torch.where that selects none of these elements, "
                    "a multiplication by zero, or a loss that is constant in this parameter"
                )
            return Finding(name, "grad", Severity.WARNING, "exact_zero", (
                f"every entry of the gradient of {name} is exactly zero: {why}; it will not train"
            ))
        nonzero = n - zeros
        sub = int(g["subnormal"])
        dtype = _dtype_name(p.tensor.dtype)
        if sub and sub == nonzero:
            return Finding(name, "grad", Severity.ERROR, "underflow", (
                f"every nonzero entry of the gradient of {name} ({nonzero} of {n}) is subnormal in "
                f"{dtype} (|g| up to {g['max_abs']:.3g}); the rest underflowed to zero. Scale the "
                "loss (torch.amp.GradScaler), use bfloat16, or keep float32 master gradients"
            ))
        if sub and sub / nonzero >= th.underflow:
            return Finding(name, "grad", Severity.WARNING, "underflow", (
                f"{100 * sub / nonzero:.3g}% of the nonzero gradient entries of {name} are subnormal in "
                f"{dtype} (and {100 * zeros / n:.3g}% are exactly zero): the gradient is underflowing; "
                "scale the loss (torch.amp.GradScaler) or use bfloat16"
            ))
        if zeros / n >= th.mostly_zero and not p.embedding:
            counts = [int(r.rows[2 * p.index][0]["zeros"]) for r in records if r.rows and 2 * p.index in r.rows]
            fixed = len(counts) >= 2 and len(set(counts)) == 1
            why = (
                f"the same {zeros} entries at each of the last {len(counts)} monitored steps: a fixed mask, "
                "slice or torch.where blocks the gradient to the unselected elements, which never train"
                if fixed
                else "those elements got no gradient this step (a mask or torch.where that does not select "
                "them, dead ReLU units, sparse inputs)"
            )
            return Finding(name, "grad", Severity.INFO, "mostly_zero", (
                f"{100 * zeros / n:.3g}% of the gradient entries of {name} are exactly zero; {why}"
            ))
        if w is None:
            return None
        w_norm, g_norm = float(w["norm"]), float(g["norm"])
        if not (w_norm > 0 and math.isfinite(w_norm)):
            return None
        ratio = g_norm / w_norm
        if ratio < th.vanishing:
            return Finding(name, "grad", Severity.WARNING, "vanishing", (
                f"the gradient of {name} is vanishing: ||g||/||w|| = {ratio:.2e} (||g|| = {g_norm:.3g}, "
                f"||w|| = {w_norm:.3g}), below {th.vanishing:.0e}; plain SGD cannot move this weight"
            ))
        if ratio > th.exploding:
            return Finding(name, "grad", Severity.ERROR, "exploding", (
                f"the gradient of {name} is exploding: ||g||/||w|| = {ratio:.3g} (||g|| = {g_norm:.3g}, "
                f"||w|| = {w_norm:.3g}); clip gradients, lower the learning rate, or check the loss scale"
            ))
        return None

    def _update_finding(self, p: _Param, records: list[_Record]) -> Finding | None:
        if len(records) < 2:
            return None
        i = p.index
        prev, last = records[-2], records[-1]
        prev_rows, last_rows = prev.rows or {}, last.rows or {}
        g = prev_rows.get(2 * i)
        w0, w1 = prev_rows.get(2 * i + 1), last_rows.get(2 * i + 1)
        if g is None or w0 is None or w1 is None or w0[1] != w1[1]:
            return None
        gf = g[0]
        if not (float(gf["norm"]) > 0 and gf["nan"] + gf["posinf"] + gf["neginf"] == 0):
            return None
        if int(w1[0]["numel"]) == 0:
            return None
        unchanged = _unchanged_for(records, i)
        reasons = self._no_update_reasons(p, w1[0], gf)
        if unchanged >= self.thresholds.frozen_window:
            return Finding(p.name, "weight", Severity.WARNING, "frozen_in_time", (
                f"{p.name} has not changed for {unchanged} monitored steps although its gradient is "
                f"nonzero (||g|| = {float(gf['norm']):.3g}): {reasons}"
            ))
        return Finding(p.name, "weight", Severity.WARNING, "not_updated", (
            f"{p.name} did not change across the last optimizer step although its gradient was nonzero "
            f"(||g|| = {float(gf['norm']):.3g}): {reasons}"
        ))

    def _no_update_reasons(self, p: _Param, w: dict[str, float | int], g: dict[str, float | int]) -> str:
        dtype = p.tensor.dtype
        ulp = float(w["max_abs"]) * (torch.finfo(dtype).eps if dtype.is_floating_point else 1.0)
        below = (
            f"an update below the weight's resolution (one ulp of {_dtype_name(dtype)} at |w| = "
            f"{float(w['max_abs']):.3g} is about {ulp:.2g}, |g| is at most {float(g['max_abs']):.3g})"
        )
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                if any(t is p.tensor for t in group["params"]):
                    lr = group.get("lr")
                    if isinstance(lr, (int, float)) and lr == 0:
                        return "its optimizer param group has lr=0"
                    return f"lr={lr}: {below}, or optimizer.step() is skipped (GradScaler found inf)"
        return f"lr 0, a parameter missing from the optimizer, or {below}"

    def _activation_finding(
        self, name: str, tag: str, act: dict[str, float | int], unit: dict[str, float | int]
    ) -> Finding | None:
        th = self.thresholds
        if act["nan"] + act["posinf"] + act["neginf"]:
            return Finding(name, "activation", Severity.ERROR, "nonfinite", (
                f"the output of {name} holds {_nonfinite_words(act)}"
            ))
        n = int(unit["numel"])
        if n == 0:
            return None
        if tag == "relu":
            dead = int(unit["zeros"])
            if dead == n:
                return Finding(name, "activation", Severity.ERROR, "dead_units", (
                    f"all {n} units of {name} are exactly zero for the whole batch (a dead layer): it "
                    "passes neither signal nor gradient; check the init/bias of the layer before it, "
                    "lower the learning rate, or use LeakyReLU/GELU"
                ))
            if dead / n >= th.dead_units:
                return Finding(name, "activation", Severity.WARNING, "dead_units", (
                    f"{dead} of {n} units of {name} ({100 * dead / n:.3g}%) are exactly zero for the whole "
                    "batch (dead ReLU units get no gradient and cannot recover)"
                ))
            return None
        saturated = int(unit["zeros"]) + int(unit["near_zero"])
        if saturated / n >= th.saturated:
            return Finding(name, "activation", Severity.WARNING, "saturated_softmax", (
                f"{saturated} of {n} softmax rows of {name} ({100 * saturated / n:.3g}%) put all their mass "
                "on one entry (1 - max p within eps): the softmax gradient through them is ~0; "
                "scale the logits down (temperature, 1/sqrt(d) in attention) or check for huge logits"
            ))
        return None

    def _history_findings(self, records: list[_Record]) -> list[tuple[int, Finding]]:
        th = self.thresholds
        window = records[-th.drift_window:]
        if len(window) < th.drift_window:
            return []
        out: list[tuple[int, Finding]] = []
        norms: list[list[float]] = []
        totals: list[float] = []
        for r in window:
            rows = r.rows or {}
            per = []
            total = 0.0
            for p in self._params:
                g = rows.get(2 * p.index)
                v = float(g[0]["norm"]) if g is not None else math.nan
                per.append(v)
                if g is not None:
                    total += v * v
            norms.append(per)
            totals.append(math.sqrt(total))
        steps = f"{window[0].step}..{window[-1].step}"
        if _drifts(totals, th.drift_factor):
            out.append((-1, Finding(GLOBAL_NAME, "grad", Severity.WARNING, "norm_drift", (
                f"the total gradient norm fell from {totals[0]:.3g} to {totals[-1]:.3g} over monitored "
                f"steps {steps}, falling almost every step: training is stalling (aggressive clipping, "
                "a decaying scale or learning signal); if the loss is not improving, loosen the clipping"
            ))))
        else:
            for p in self._params:
                series = [row[p.index] for row in norms]
                if _drifts(series, th.drift_factor):
                    out.append((p.index, Finding(p.name, "grad", Severity.WARNING, "norm_drift", (
                        f"the gradient norm of {p.name} fell from {series[0]:.3g} to {series[-1]:.3g} over "
                        f"monitored steps {steps}, falling almost every step"
                    ))))
        for p in self._params:
            if p.embedding:
                continue
            series = []
            for r in window:
                g = (r.rows or {}).get(2 * p.index)
                if g is not None and g[0]["numel"]:
                    series.append(int(g[0]["zeros"]) / int(g[0]["numel"]))
            if len(series) == len(window) and _rises(series):
                out.append((p.index, Finding(p.name, "grad", Severity.WARNING, "zero_fraction_rising", (
                    f"the exact-zero fraction of the gradient of {p.name} rose from {100 * series[0]:.3g}% "
                    f"to {100 * series[-1]:.3g}% over monitored steps {steps}: units are dying "
                    "(ReLU) or a mask is closing"
                ))))
        return out

    def _tensor_rows(self, rec: _Record | None) -> list[dict[str, Any]]:
        if rec is None:
            return []
        rows = rec.rows or {}
        out = []
        for p in self._params:
            for code, kind in ((2 * p.index, "grad"), (2 * p.index + 1, "weight")):
                row = rows.get(code)
                if row is not None:
                    out.append(_tensor_dict(p.name, kind, row[0]))
        for name, _, act, _ in rec.acts or []:
            out.append(_tensor_dict(name, "activation", act))
        return out

    def _history(self, records: list[_Record]) -> dict[str, Any]:
        present = [
            p for p in self._params
            if any(r.rows is not None and 2 * p.index in r.rows for r in records)
        ]
        grad_norm, zero_fraction, underflow = [], [], []
        for r in records:
            rows = r.rows or {}
            gn, zf, uf = [], [], []
            for p in present:
                g = rows.get(2 * p.index)
                if g is None:
                    gn.append(math.nan)
                    zf.append(math.nan)
                    uf.append(math.nan)
                    continue
                f = g[0]
                n = int(f["numel"])
                gn.append(float(f["norm"]))
                zf.append(int(f["zeros"]) / n if n else 0.0)
                uf.append(int(f["subnormal"]) / n if n else 0.0)
            grad_norm.append(gn)
            zero_fraction.append(zf)
            underflow.append(uf)
        return {
            "steps": [r.step for r in records],
            "names": [p.name for p in present],
            "grad_norm": grad_norm,
            "zero_fraction": zero_fraction,
            "underflow_fraction": underflow,
        }


def _check_group(op: str, group: Any, params: list[_Param]) -> dist.ProcessGroup | None:
    """The Monitor's process group, checked (None stays None)."""
    if group is None:
        return None
    if not dist.is_available():
        raise RuntimeError(f"{op}: process_group was given but this torch has no torch.distributed")
    if group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):  # what new_group gives a non-member
        raise ValueError(f"{op}: this rank (global rank {dist.get_rank()}) is not a member of process_group")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{op}: process_group must be a torch.distributed.ProcessGroup (dist.group.WORLD for every rank) "
            f"or None, got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            f"{op}: process_group was given but torch.distributed is not initialized; "
            "call torch.distributed.init_process_group() first"
        )
    if dist.get_rank(group) < 0:
        raise ValueError(f"{op}: this rank (global rank {dist.get_rank()}) is not a member of process_group")
    ranks = sorted(dist.get_process_group_ranks(group))
    for p in params:
        if is_dtensor(p.tensor):
            mesh_ranks = sorted(p.tensor.device_mesh.mesh.flatten().tolist())  # type: ignore[attr-defined]
            if mesh_ranks != ranks:
                raise ValueError(
                    f"{op}: parameter {p.name} is a DTensor on a device mesh of ranks {mesh_ranks}, but "
                    f"process_group holds ranks {ranks}; pass a group over exactly the mesh's ranks"
                )
    return group


# Fields a replica_mismatch message shows, at most three that differ.
_SHOWN_FIELDS = ("numel", "nan", "posinf", "neginf", "zeros", "max_abs", "min_abs", "mean", "std")
# The per-slot flags of a step's host summary (see _summarize).
_IS_SHARDED, _ALL_PRESENT, _ANY_PRESENT, _AGREE, _NONFINITE, _SAME_KIND = range(6)
_NUM_FLAGS = 6


def _summarize(gathered: torch.Tensor, n: int, rtol: float) -> torch.Tensor:
    """What the host needs of one step's gathered rows int64 [W, n + 1, 16],
    computed where they are, as one int64 vector: the global rows [n, 16]
    (sharded slots merged, the others rank 0's), the per-slot flags [n, 6]
    (indexed by _IS_SHARDED ...) and every rank's header [W, 3]."""
    body = gathered[:, :n]
    kinds = body[..., _SHARDED_COL]
    sharded = kinds[0] == 1
    present = body[..., _PRESENT_COL] > 0
    merged = zdist.combine_rows(body) if n else body[0]
    rows = torch.where(sharded.unsqueeze(1), merged, body[0])
    flags = torch.stack(
        [
            sharded,
            present.all(0),
            present.any(0),
            zdist.rows_agree(body, body[:1], rtol).all(0),
            (body[..., 4:7].sum(-1) > 0).any(0),  # nan, +inf, -inf counts
            (kinds == kinds[:1]).all(0),
        ],
        dim=1,
    ).to(torch.int64)
    return torch.cat([rows.reshape(-1), flags.reshape(-1), gathered[:, n, :3].reshape(-1)])


def _to_host(vectors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies the vectors to the host, one copy per device."""
    out: list[torch.Tensor | None] = [None] * len(vectors)
    by_device: dict[torch.device, list[int]] = {}
    for k, v in enumerate(vectors):
        by_device.setdefault(v.device, []).append(k)
    for indices in by_device.values():
        host = torch.cat([vectors[k] for k in indices]).cpu()
        start = 0
        for k in indices:
            out[k] = host[start : start + vectors[k].numel()]
            start += vectors[k].numel()
    return out  # type: ignore[return-value]


def _in_shards(finding: Finding, ranks: tuple[int, ...] | None) -> Finding:
    """A non-finite finding of a sharded tensor, with the ranks whose shards hold the values."""
    if ranks is None:
        return finding
    where = f"rank {ranks[0]}'s shard" if len(ranks) == 1 else f"the shards of ranks {list(ranks)}"
    return dataclasses.replace(finding, ranks=ranks, message=f"{finding.message}; the values are in {where}")


def _short(v: float | int) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}"


def _native_many(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One native scan of tensors on one device: int64 [N, 16], not read."""
    return torch.ops.zeroscan.stats_many.default(tensors, None)


def _collect_params(model: nn.Module) -> list[_Param]:
    aliases: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(t), []).append(name)
    embedding_ids = set()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            embedding_ids.add(id(module.weight))
    params = []
    for name, t in model.named_parameters():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        params.append(_Param(
            index=len(params),
            name=name,
            aliases=tuple(a for a in aliases[id(t)] if a != name),
            tensor=t,
            owner=owner,
            embedding=id(t) in embedding_ids,
        ))
    return params


def _scannable(t: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """What the native scan can read of `t`, or None and why not."""
    if t.device.type == "meta":
        return None, "on the meta device (no data)"
    if isinstance(t, nn.parameter.UninitializedTensorMixin):
        return None, "an uninitialized (lazy) parameter"
    if t.layout == torch.sparse_coo:
        t = t._values()
    elif t.layout != torch.strided:
        try:
            t = t.values()
        except RuntimeError:
            return None, f"a {t.layout} tensor"
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dim() > 64:
        t = t.reshape(-1)
    return t, ""


def _unit_peak(out: torch.Tensor, *, nonneg: bool) -> torch.Tensor:
    """Per-unit max |output| over the batch: 0 means the unit is dead.
    Units are the last dim, or dim 1 (channels) for 4-D and 5-D outputs."""
    if out.dim() == 0 or out.numel() == 0:
        return out.reshape(-1)
    mags = out if nonneg else out.abs()
    unit_dim = 1 if out.dim() >= 4 else out.dim() - 1
    dims = tuple(d for d in range(out.dim()) if d != unit_dim)
    return mags.amax(dim=dims) if dims else mags


def _softmax_gap(out: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """1 - max probability per row: <= eps means the row is saturated."""
    if out.dim() == 0 or out.numel() == 0:
        return out.reshape(-1)
    dim = getattr(module, "dim", None)
    dim = -1 if dim is None else dim
    return (1.0 - out.amax(dim=dim)).reshape(-1)


def _decode_records(records: list[_Record], *, own_rows: bool = True) -> None:
    """Host-decodes every record not decoded yet: one copy per device.
    own_rows=False decodes the activations only (the rows come from elsewhere)."""
    pending: list[tuple[_Record, str, int, torch.Tensor]] = []
    for r in records:
        if r.rows is None:
            for k, (_, buf) in enumerate(r.groups if own_rows else []):
                pending.append((r, "group", k, buf))
            for k, (_, _, buf) in enumerate(r.activations):
                pending.append((r, "act", k, buf))
    by_device: dict[torch.device, list[tuple[_Record, str, int, torch.Tensor]]] = {}
    for item in pending:
        by_device.setdefault(item[3].device, []).append(item)
    decoded: dict[tuple[int, str, int], tuple[list[dict[str, float | int]], list[list[int]]]] = {}
    for items in by_device.values():
        host = torch.cat([buf.reshape(-1, 16) for *_, buf in items]).to("cpu")
        fields = decode(host)
        raw = host.tolist()
        start = 0
        for r, what, k, buf in items:
            n = buf.reshape(-1, 16).shape[0]
            decoded[(id(r), what, k)] = (fields[start:start + n], raw[start:start + n])
            start += n
    for r in records:
        if r.rows is not None:
            continue
        rows: dict[int, tuple[dict[str, float | int], tuple[int, ...]]] = {}
        for k, (codes, _) in enumerate(r.groups if own_rows else []):
            fields, raw = decoded[(id(r), "group", k)]
            for code, f, w in zip(codes, fields, raw):
                rows[code] = (f, tuple(w))
        acts = []
        for k, (name, tag, _) in enumerate(r.activations):
            fields, _ = decoded[(id(r), "act", k)]
            acts.append((name, tag, fields[0], fields[1]))
        r.rows = rows
        r.acts = acts


def _unchanged_for(records: list[_Record], i: int) -> int:
    """How many of the latest records hold a bit-identical scan of weight i."""
    code = 2 * i + 1
    last = (records[-1].rows or {}).get(code) if records else None
    if last is None:
        return 0
    count = 0
    for r in reversed(records):
        row = (r.rows or {}).get(code)
        if row is None or row[1] != last[1]:
            break
        count += 1
    return count


def _drifts(series: list[float], factor: float) -> bool:
    if len(series) < 2 or not all(math.isfinite(v) and v > 0 for v in series):
        return False
    falls = sum(1 for a, b in zip(series, series[1:]) if b < a)
    return falls >= 0.9 * (len(series) - 1) and series[0] / series[-1] >= factor


def _rises(series: list[float]) -> bool:
    ups = sum(1 for a, b in zip(series, series[1:]) if b >= a)
    return series[-1] >= 0.5 and series[-1] - series[0] >= 0.25 and ups >= 0.8 * (len(series) - 1)


def _tensor_dict(name: str, kind: str, f: dict[str, float | int]) -> dict[str, Any]:
    n = int(f["numel"])
    return {
        "name": name,
        "kind": kind,
        "numel": n,
        "zero_fraction": int(f["zeros"]) / n if n else 0.0,
        "subnormal_fraction": int(f["subnormal"]) / n if n else 0.0,
        "near_zero_fraction": int(f["near_zero"]) / n if n else 0.0,
        "nan": int(f["nan"]),
        "inf": int(f["posinf"]) + int(f["neginf"]),
        "norm": float(f["norm"]),
        "mean": float(f["mean"]),
        "std": float(f["std"]),
        "min_abs": float(f["min_abs"]),
        "max_abs": float(f["max_abs"]),
    }


def _nonfinite_words(f: dict[str, float | int]) -> str:
    parts = [f"{int(f[k])} {label}" for k, label in (("nan", "NaN"), ("posinf", "+inf"), ("neginf", "-inf")) if f[k]]
    return " and ".join(parts) + f" among {int(f['numel'])} values"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

