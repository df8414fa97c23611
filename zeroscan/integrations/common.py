"""What every framework integration shares: importing the framework with an
error that names zeroscan's extra, the torch optimizer inside a wrapper,
the scalars each logs, what each has sent to Python logging (so that a
finding is logged once, not at every report), and the callbacks' common
arguments.

The summary is a handful of numbers per report whatever the model's size,
so it can ride along in a framework's own log rows (and its console
printout); per-tensor scalars (zeroscan.loggers.scalars) are opt-in.

Steps: an integration logs everything of a report (its scalars, its log
lines) at its framework's step, the count of optimizer steps taken, from 1
(the Trainer's state.global_step, Lightning's trainer.global_step, the
`step` given to Accelerate's log()), not at the report's own step, the
Monitor's 0-based index of the step it scanned.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any, NamedTuple

import torch

from zeroscan.inputs import received
from zeroscan.loggers import SEVERITY_RANK, log_finding, log_summary, scalars
from zeroscan.monitor import Report, Severity
from zeroscan.report_data import report_dict
from zeroscan.words import listed


def require(module: str, extra: str, user: str) -> ModuleType:
    """Imports `module` for the integration `user`, or raises an ImportError
    that says which extra of zeroscan's distribution (torch-zeroscan) installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"{user} needs the {module} package ({err}); install it with: pip install 'torch-zeroscan[{extra}]' "
            f"(from a zeroscan checkout: pip install --no-build-isolation -e '.[{extra}]')"
        ) from err


def report_rows(report: Report | Mapping[str, Any]) -> Mapping[str, Any]:
    """What the loggers read of a report: its "step", "findings" (as dicts)
    and "tensors". Report.to_dict() would also convert the history, P x
    steps values, which no logged scalar uses."""
    if isinstance(report, Report):
        return {"step": report.step, "findings": [f.to_dict() for f in report.findings], "tensors": report.tensors}
    return report_dict(report)


def summary_scalars(report: Report | Mapping[str, Any], *, prefix: str = "zeroscan") -> dict[str, float]:
    """A fixed handful of scalars for one report, whatever the model's size:

    {prefix}.findings/error, /warning, /info   findings of each severity
    {prefix}.grad/zero_pct                     exact zeros, % of all gradient elements scanned
    {prefix}.grad/underflow_pct                subnormal values (underflow), % of the same
    {prefix}.grad/nonfinite                    NaN and inf gradient elements
    {prefix}.grad/scanned                      gradients scanned (a None gradient is not)

    The tag scheme of zeroscan.loggers.scalars, whose per-tensor tags add
    the tensor's name ({prefix}.grad/zero_pct/fc1.weight), so the two merge
    into one dict. The gradient numbers are of the report's step; with no
    gradient scanned, the three gradient shares are left out (not logged
    as 0).
    """
    data = report_rows(report)
    counts = {s.name.lower(): 0 for s in (Severity.ERROR, Severity.WARNING, Severity.INFO)}
    for f in data.get("findings", []):
        severity = str(f.get("severity", "info")).lower()
        if severity in counts:
            counts[severity] += 1
    out = {f"{prefix}.findings/{severity}": float(n) for severity, n in counts.items()}
    grads = [t for t in data.get("tensors", []) if t.get("kind") == "grad"]
    out[f"{prefix}.grad/scanned"] = float(len(grads))
    grads = [t for t in grads if int(t["numel"])]  # an empty gradient has no share to add
    numel = sum(int(t["numel"]) for t in grads)
    if numel:
        zeros = sum(float(t["zero_fraction"]) * int(t["numel"]) for t in grads)
        subnormal = sum(float(t["subnormal_fraction"]) * int(t["numel"]) for t in grads)
        out[f"{prefix}.grad/zero_pct"] = 100.0 * zeros / numel
        out[f"{prefix}.grad/underflow_pct"] = 100.0 * subnormal / numel
        out[f"{prefix}.grad/nonfinite"] = float(sum(int(t["nan"]) + int(t["inf"]) for t in grads))
    return {k: v for k, v in out.items() if math.isfinite(v)}


def logged_scalars(report: Report | Mapping[str, Any], *, prefix: str, per_tensor: bool) -> dict[str, float]:
    """What an integration logs of one report: summary_scalars, plus, with
    per_tensor, zeroscan.loggers.scalars (a norm, zero % and underflow % per
    gradient)."""
    data = report_rows(report)
    values = summary_scalars(data, prefix=prefix)
    if per_tensor:
        values.update(scalars(data, prefix=prefix))
    return values


class LoggedFindings:
    """What an integration has sent to Python logging of one run's findings:
    the severity it logged each at, by (finding name, cause).

    A report lists every finding that still holds, so a frozen block is in
    each report of the run, and logging each report whole would print the
    same lines at every interval (Lightning's own callbacks warn once). log()
    logs a finding when it first appears, when its severity changes, and,
    in one short INFO line, when it clears (is in no later report). Only
    names, causes and severities are compared: a message whose counts grow
    makes no new line. A finding that stands for several tensors (its
    "members", each one's own finding) counts as its members, so that the
    same tensors grouped otherwise at the next report (a name with "+2
    more" where it had "+5 more") are no new finding either.
    """

    def __init__(self) -> None:
        self.logged: dict[tuple[str, str], str] = {}  # (name, cause) -> severity, lower case

    def log(self, report: Mapping[str, Any], logger: logging.Logger, *, step: int | None, summary_level: int) -> int:
        """Logs what changed since the last report (report: report_rows'
        form) and the report's one-line summary at `summary_level`, all
        naming `step`; returns the number of finding lines logged."""
        findings = list(report.get("findings", []))
        units = [_units(f) for f in findings]
        now: dict[tuple[str, str], str] = {}
        for key, severity in (u for us in units for u in us):
            if SEVERITY_RANK.get(severity, 0) >= SEVERITY_RANK.get(now.get(key, "ok"), 0):
                now[key] = severity  # the worst of a name's findings of one cause (grad and weight)
        lines = 0
        for f, us in zip(findings, units):
            before = {self.logged.get(key) for key, _ in us}
            if any(self.logged.get(key) != now[key] for key, _ in us):
                was = next(iter(before)) if len(before) == 1 else None  # None: new, or of several
                log_finding(logger, f, step, was=was)
                lines += 1
        cleared: dict[tuple[str, str], list[str]] = {}
        for (name, cause), was in self.logged.items():
            if (name, cause) not in now:
                cleared.setdefault((cause, was), []).append(name)
        for (cause, was), names in cleared.items():
            logger.info("zeroscan step %s: %s: %s cleared (was %s)", step, listed(names, SHOWN_NAMES), cause, was)
            lines += 1
        self.logged = now
        log_summary(logger, report, step, summary_level)
        return lines

    def clear(self) -> None:
        """Forgets what was logged: a new run logs its findings afresh."""
        self.logged = {}


SHOWN_NAMES = 8  # names a "cleared" line lists before "and N more"


def _units(finding: Mapping[str, Any]) -> list[tuple[tuple[str, str], str]]:
    """((name, cause), severity) of each tensor a finding (to_dict() form) is about."""
    return [
        ((str(m.get("name")), str(m.get("cause"))), str(m.get("severity", "info")).lower())
        for m in finding.get("members") or [finding]
    ]


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (Accelerate's
    AcceleratedOptimizer, which the Trainer uses, keeps it as .optimizer).

    The Monitor hooks this one because a GradScaler that finds inf/NaN
    skips its step(): the Monitor then sees the step skipped, while the
    wrapper's own step() runs either way."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    return inner


MONITOR_OPTIONS = ("history", "activations", "thresholds", "histogram", "trace_nonfinite")


def monitor_options(user: str, options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments an integration passes on to zeroscan.Monitor,
    checked by name now (the Monitor checks their values when the framework
    creates it, at the start of training)."""
    unknown = sorted(set(options) - set(MONITOR_OPTIONS))
    if unknown:
        raise TypeError(
            f"{user}: unexpected keyword argument(s) {', '.join(unknown)}; "
            f"the Monitor options it passes on are {', '.join(MONITOR_OPTIONS)}"
        )
    return dict(options)


def check_interval(user: str, name: str, value: int | None, *, none_ok: bool) -> int | None:
    """`value` as a step interval: an int >= 1 (or None where `none_ok`)."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an int >= 1 or None" if none_ok else "an int >= 1"
        raise ValueError(f"{user}: {name} must be {allowed}, got {received(value)}")
    return value


class CallbackSettings(NamedTuple):
    """A framework callback's arguments, checked (see callback_settings)."""

    every: int
    report_every: int | None
    per_tensor: bool
    prefix: str
    logger: logging.Logger
    options: dict[str, Any]


def callback_settings(
    user: str,
    *,
    every: int,
    report_every: int | None,
    per_tensor: bool,
    prefix: str,
    logger: logging.Logger | None,
    options: dict[str, Any],
) -> CallbackSettings:
    """The arguments the Trainer and Lightning callbacks share, checked with
    one-line errors; `logger` None becomes the "zeroscan" logger."""
    checked_every = check_interval(user, "every", every, none_ok=False)
    assert checked_every is not None  # none_ok=False
    checked_report_every = check_interval(user, "report_every", report_every, none_ok=True)
    if not isinstance(prefix, str):
        raise TypeError(f"{user}: prefix must be a str, got {type(prefix).__name__}")
    if logger is not None and not isinstance(logger, logging.Logger):
        raise TypeError(f"{user}: logger must be a logging.Logger or None, got {type(logger).__name__}")
    return CallbackSettings(
        checked_every, checked_report_every, bool(per_tensor), prefix,
        logger or logging.getLogger("zeroscan"), monitor_options(user, options),
    )
