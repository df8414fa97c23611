"""What the Monitor reports: Finding, Thresholds and Report.

A Finding is one thing wrong (or worth knowing) about one tensor, named by a
zeroscan.Cause; Thresholds say what counts as a problem; a Report holds the
findings of one report() call, ranked by severity, with the latest scan of
every tensor, the per-step history and, with Monitor(histogram=True), the
latest histogram of every gradient and weight.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zeroscan.histogram import Histogram
from zeroscan.report_data import json_safe
from zeroscan.verdicts import MOSTLY_ZERO, PARTIAL_UNDERFLOW, Cause, Severity, check_fraction

GLOBAL_NAME = "(all parameters)"  # the name of findings about the whole model


def histogram_key(name: str, kind: str) -> str:
    """How Report.histograms names a tensor: "fc1.weight:grad" for the
    gradient of fc1.weight, "fc1.weight:weight" for the weight itself (the
    Monitor's notes name tensors alike)."""
    return f"{name}:{kind}"


@dataclass(frozen=True)
class Finding:
    """One thing wrong (or worth knowing) about one tensor.

    kind: "grad", "weight", "activation" or "param" (the parameter as a whole).
    cause: a zeroscan.Cause (a str: `finding.cause == "detached"` holds).
    ranks: with a process group, the (global) ranks the finding is about
    where that is known (the replicas that differ, the shards that hold a
    non-finite value); None otherwise.
    root: the cause worded for every tensor it explains, where the cause
    analysis knows one (grouping.py gathers the findings that share it).
    names / members: a finding that stands for one root cause of several
    tensors names them all, and keeps each one's own finding as a member;
    () for a finding about one tensor.
    """

    name: str
    kind: str
    severity: Severity
    cause: Cause
    message: str
    ranks: tuple[int, ...] | None = None
    root: str | None = None
    names: tuple[str, ...] = ()
    members: tuple[Finding, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "cause", Cause(self.cause))  # a code given as a str becomes its Cause

    def __str__(self) -> str:
        # One line, in the Report table's order, instead of the dataclass's field dump.
        return f"{self.severity} {self.name} ({self.kind}, {self.cause}): {self.message}"

    def to_dict(self) -> dict[str, Any]:
        """name, kind, severity, cause, message; plus "ranks" (a list) only
        when the finding names ranks, and "names" and "members" (each
        member's to_dict()) only when it stands for several tensors."""
        out: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "severity": self.severity.name.lower(),
            "cause": self.cause.value,
            "message": self.message,
        }
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
        if self.members:
            out["names"] = list(self.names)
            out["members"] = [m.to_dict() for m in self.members]
        return out


@dataclass(frozen=True)
class Thresholds:
    """What the Monitor calls a problem; every value has a documented default.

    mostly_zero: exact-zero fraction of a gradient from which it is reported
        as "mostly_zero" (INFO); the same meaning and default (0.9) as
        diagnose's mostly_zero.
    partial_underflow: fraction of a gradient's nonzero values that are
        subnormal from which it is reported as "underflow"; the same meaning
        and default (0.01) as diagnose's partial_underflow.
    vanishing / exploding: bounds on ||grad|| / ||weight|| (weights of norm 0
        are skipped). 1e-7 is about float32 eps: an SGD step with lr <= 1
        cannot move the weight. 1e3: one step with lr 1e-3 would move it by
        more than its own norm. For "exploding" a weight counts as at least
        1e-2 per entry (root mean square), so that a near-zero bias does not
        make the ratio huge.
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
    zero_window: a gradient that is exactly zero is a WARNING once it has been
        zero for this many monitored steps in a row, or for two in a row with
        the weight unchanged; before that it is INFO, because designs that
        start from zero (LoRA's B = 0, zero_init_residual) give exactly zero
        gradients at the first step and train from the next.
    skip_run: optimizer steps skipped (GradScaler found inf/NaN) this many
        monitored steps in a row, up to the latest, are a WARNING; fewer are
        INFO (a GradScaler calibrating its scale skips a few); every monitored
        step skipped is an ERROR.
    replica_rtol: across ranks, replicas agree when their counts and min/max
        |x| are equal and their mean and sum of squared deviations differ by
        at most this, relative to their scale (another reduction order); DDP
        gradients after the all-reduce are bitwise equal.
    """

    mostly_zero: float = MOSTLY_ZERO
    partial_underflow: float = PARTIAL_UNDERFLOW
    vanishing: float = 1e-7
    exploding: float = 1e3
    dead_units: float = 0.5
    saturated: float = 0.5
    drift_window: int = 20
    drift_factor: float = 100.0
    frozen_window: int = 8
    zero_window: int = 3
    skip_run: int = 3
    replica_rtol: float = 1e-9

    def __post_init__(self) -> None:
        op = "zeroscan.Thresholds"
        for name in ("mostly_zero", "partial_underflow", "dead_units", "saturated"):
            check_fraction(op, name, getattr(self, name))
        for name in ("vanishing", "exploding", "drift_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{op}: {name} must be a positive number, got {value!r}")
        rtol = self.replica_rtol
        if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 <= rtol < 1:
            raise ValueError(f"{op}: replica_rtol must be a number in [0, 1), got {rtol!r}")
        for name in ("drift_window", "frozen_window", "zero_window", "skip_run"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"{op}: {name} must be an int >= 2, got {value!r}")


class Report:
    """What the Monitor saw: findings ranked by severity, one per root cause
    (a finding that stands for several tensors lists them in `names` and
    keeps each one's own finding in `members`; `detailed` has them all), the
    latest scan of every tensor, and the per-step history (see to_dict for
    the schema).

    histograms: with Monitor(histogram=True), the exact log2-magnitude
    histogram (zeroscan.histogram.Histogram) of every gradient and weight of
    the report's step, by histogram_key ("fc1.weight:grad",
    "fc1.weight:weight"); {} otherwise.

    nonfinite_origin: with Monitor(trace_nonfinite=True), where the inf/NaN
    of the recorded gradients was born, as the nonfinite_origin finding
    names it (a dict: step, pass, micro_batch, name, kind, values, how);
    None when no gradient held inf/NaN, when nothing was traced, and when
    the finding says this rank's passes made none (it came in after backward).
    """

    def __init__(
        self,
        step: int,
        findings: list[Finding],
        tensors: list[dict[str, Any]],
        history: dict[str, Any],
        histograms: dict[str, Histogram] | None = None,
        nonfinite_origin: dict[str, Any] | None = None,
    ) -> None:
        self.step = step
        self.findings = findings
        self.tensors = tensors
        self.history = history
        self.histograms: dict[str, Histogram] = dict(histograms or {})
        self.nonfinite_origin = nonfinite_origin

    @property
    def worst(self) -> Severity:
        return max((f.severity for f in self.findings), default=Severity.OK)

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    @property
    def detailed(self) -> list[Finding]:
        """Every finding about one tensor: the members of grouped findings in
        their place, the others as they are."""
        return [m for f in self.findings for m in (f.members or (f,))]

    def __len__(self) -> int:
        return len(self.findings)

    def to_dict(self) -> dict[str, Any]:
        """{"step", "findings": [Finding.to_dict(), with "ranks" where a finding
        names ranks], "tensors": [per tensor:
        name, kind, numel, zero_fraction, subnormal_fraction,
        near_zero_fraction, nan, inf, norm, mean, std, min_abs, max_abs; and,
        where the report has the tensor's histogram, "histogram"
        (Histogram.to_dict()) with "dtype", the dtype it counts (a complex
        tensor's real one): float32 and bfloat16 share binades], "history": {"steps", "names", "grad_norm",
        "zero_fraction", "subnormal_fraction"} (the tensor rows' names; a
        history made with the older "underflow_fraction" is read too)};
        floats are Python floats, nan where unknown; and "nonfinite_origin"
        where the report has one."""
        out: dict[str, Any] = {
            "step": self.step,
            "findings": [f.to_dict() for f in self.findings],
            "tensors": [self._tensor_dict(t) for t in self.tensors],
            "history": {
                "steps": list(self.history["steps"]),
                "names": list(self.history["names"]),
                "grad_norm": [list(r) for r in self.history["grad_norm"]],
                "zero_fraction": [list(r) for r in self.history["zero_fraction"]],
                # A history built before the key's rename (Report(...) by hand) has "underflow_fraction".
                "subnormal_fraction": [
                    list(r) for r in self.history[
                        "subnormal_fraction" if "subnormal_fraction" in self.history else "underflow_fraction"
                    ]
                ],
            },
        }
        if self.nonfinite_origin is not None:
            out["nonfinite_origin"] = dict(self.nonfinite_origin)
        return out

    def _tensor_dict(self, t: dict[str, Any]) -> dict[str, Any]:
        """One entry of to_dict()["tensors"]: the tensor's row, with its histogram if any."""
        out = dict(t)
        hist = self.histograms.get(histogram_key(str(t["name"]), str(t["kind"]))) if self.histograms else None
        if hist is not None:
            out["dtype"] = str(hist.dtype).removeprefix("torch.")  # the counts mean nothing without it
            out["histogram"] = hist.to_dict()
        return out

    def to_json_lines(self) -> str:
        """One JSON object per line: each finding ("type": "finding") then each
        tensor ("type": "tensor"), all with "step". NaN and inf become null."""
        lines = []
        for f in self.findings:
            lines.append({"type": "finding", "step": self.step, **f.to_dict()})
        for t in self.tensors:
            lines.append({"type": "tensor", "step": self.step, **self._tensor_dict(t)})
        return "".join(json.dumps(json_safe(line), allow_nan=False) + "\n" for line in lines)

    def plot(self, path: str) -> Any:
        """Draws the report with zeroscan.plot.plot_report (needs matplotlib)."""
        from zeroscan.plot import plot_report

        return plot_report(self.to_dict(), path)

    def __str__(self) -> str:
        return self.format()

    def format(self, *, verbose: bool = False, width: int | None = None) -> str:
        """The report as a table, one finding per line group, its messages
        wrapped to `width` columns, at least 60 (None: the terminal's width,
        100 when standard output is not a terminal). verbose: also every
        tensor's own finding under a grouped one."""
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
            raise ValueError(f"zeroscan.Report.format: width must be an int >= 1 or None, got {width!r}")
        width = max(60, width if width is not None else text_width())
        grads = sum(1 for t in self.tensors if t.get("kind") == "grad")
        weights = sum(1 for t in self.tensors if t.get("kind") == "weight")
        head = (
            f"zeroscan report · step {self.step} · {grads} gradient{'s' if grads != 1 else ''}, "
            f"{weights} weight{'s' if weights != 1 else ''} scanned"
        )
        if not self.findings:
            return head + " · no findings"
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in Severity}
        summary = ", ".join(
            f"{counts[s]} {s.name.lower()}{'s' if counts[s] > 1 and s != Severity.INFO else ''}"
            for s in reversed(Severity)
            if counts[s]
        )
        rows: list[tuple[str, ...]] = [("SEVERITY", "NAME", "KIND", "CAUSE", "MESSAGE")]
        for f in self.findings:
            rows.append((f.severity.name, f.name, f.kind, f.cause.value, f.message))
            if verbose:
                rows += [("", f"  {m.name}", m.kind, m.cause.value, m.message) for m in f.members]
        lines = textwrap.wrap(f"{head} · {summary}", width, subsequent_indent="  ")
        lines += table_lines(rows, width)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Report(step={self.step}, findings={len(self.findings)}, worst={self.worst})"


NAME_COLUMN = 36  # longer names wrap within their column


def text_width() -> int:
    """The width text output wraps to: the terminal's, or 100 columns."""
    if sys.stdout is not None and sys.stdout.isatty():
        return shutil.get_terminal_size((100, 24)).columns
    return 100


def table_lines(rows: list[tuple[str, ...]], width: int) -> list[str]:
    """Rows of five columns (the first holds the headings), the name and the
    message wrapped so that no line is longer than `width`. Where the four
    short columns leave under 30 columns for the message, each finding is
    one line of them and its message indented below."""
    name_width = min(NAME_COLUMN, max(len(r[1]) for r in rows))
    widths = [max(len(r[0]) for r in rows), name_width, max(len(r[2]) for r in rows), max(len(r[3]) for r in rows)]
    lead = sum(widths) + 2 * len(widths)
    out = []
    if width - lead < 30:
        for r in rows[1:]:
            out += textwrap.wrap(f"{r[0] or '  ·'} {r[3]} ({r[2]}): {r[1].strip()}", width, subsequent_indent="    ")
            out += textwrap.wrap(r[4], width, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False)
        return out
    for r in rows:
        names = textwrap.wrap(r[1], name_width, break_on_hyphens=False, drop_whitespace=False) or [""]
        message = textwrap.wrap(r[4], width - lead, break_on_hyphens=False) or [""]
        for k in range(max(len(names), len(message))):
            name = names[k] if k < len(names) else ""
            cells = (r[0], name, r[2], r[3]) if k == 0 else ("", name, "", "")
            left = "  ".join(c.ljust(w) for c, w in zip(cells, widths))
            out.append((left + "  " + (message[k] if k < len(message) else "")).rstrip())
    return out
