"""What every framework integration shares: importing the framework with an
error that names zeroscan's extra, the torch optimizer inside a wrapper,
one report's trip to the sinks and to Python logging (send_report), what
each has sent to Python logging (so that a finding is logged once, not at
every report), and the callbacks' common arguments and state
(ReportingCallback).

Each integration logs zeroscan.loggers.scalars(report, summary=True): a
handful of numbers per report whatever the model's size, so they can ride
along in a framework's own log rows (and its console printout); the
per-tensor scalars are opt-in (per_tensor=True). They go to sinks
(zeroscan.loggers.Sink): the framework's own (Lightning's loggers, the
Trainer's log row, the Accelerator's trackers) and any given as `sinks=`.

Steps: an integration logs everything of a report (its scalars, its log
lines) at its framework's step, the count of optimizer steps taken, from 1
(the Trainer's state.global_step, Lightning's trainer.global_step, the
`step` given to Accelerate's log()), not at the report's own step, the
Monitor's 0-based index of the step it scanned.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import torch

from zeroscan.inputs import received
from zeroscan.loggers import SEVERITY_RANK, Sink, log_finding, log_summary, report_rows, scalars
from zeroscan.monitor import Monitor, Report
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


def send_report(
    report: Report | Mapping[str, Any],
    *,
    step: int,
    sinks: Iterable[Sink],
    prefix: str,
    per_tensor: bool,
    findings: LoggedFindings | None,
    logger: logging.Logger,
    summary_level: int = logging.DEBUG,
) -> dict[str, float]:
    """What an integration does with one report: its scalars
    (zeroscan.loggers.scalars with the summary, and with per_tensor the
    per-tensor ones) to each sink at `step`, then, where `findings` is given
    (the main process), what changed in its findings to `logger`, naming the
    same step. Returns the scalars."""
    rows = report_rows(report)
    values = scalars(rows, prefix=prefix, per_tensor=per_tensor, summary=True)
    for sink in sinks:
        sink.log(values, step)
    if findings is not None:
        findings.log(rows, logger, step=step, summary_level=summary_level)
    return values


def check_sinks(user: str, sinks: Sequence[Sink]) -> tuple[Sink, ...]:
    """`sinks` as a tuple, each checked to have a log() (zeroscan.loggers.Sink)."""
    if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Sequence):
        raise TypeError(f"{user}: sinks must be a list or tuple of sinks (objects with log(scalars, step)), "
                        f"got {received(sinks)}")
    for k, sink in enumerate(sinks):
        if not callable(getattr(sink, "log", None)):
            raise TypeError(f"{user}: sinks[{k}] must have log(scalars, step) (a zeroscan.loggers.Sink), "
                            f"got {type(sink).__name__}")
    return tuple(sinks)


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
    sinks: tuple[Sink, ...]
    options: dict[str, Any]


def callback_settings(
    user: str,
    *,
    every: int,
    report_every: int | None,
    per_tensor: bool,
    prefix: str,
    logger: logging.Logger | None,
    sinks: Sequence[Sink],
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
        logger or logging.getLogger("zeroscan"), check_sinks(user, sinks), monitor_options(user, options),
    )


class ReportingCallback:
    """What the Trainer and Lightning callbacks (ZeroscanCallback in
    zeroscan.integrations.transformers and .lightning) share: their
    arguments, the Monitor of the run and its latest Report, and one
    report's trip to the sinks and to Python logging (take_report). Each
    names itself in USER and comes before its framework's Callback class
    among its bases.

    every: scan one optimizer step in `every` (Monitor's `every`).
    report_every: optimizer steps between reports. None (the default):
        follow the framework's own logging interval.
    per_tensor: also log a norm, zero % and underflow % per gradient
        (three scalars per parameter; zeroscan.loggers.scalars).
    prefix: the first part of every logged key ("zeroscan.findings/error").
    logger: where findings go (default logging.getLogger("zeroscan")).
    sinks: more sinks (zeroscan.loggers.Sink: objects with log(scalars,
        step)) that each report's scalars go to, on the main process, at the
        framework's step, besides the framework's own loggers.
    monitor_options: history, activations, thresholds, histogram,
        trace_nonfinite, passed on to zeroscan.Monitor.
    """

    USER = "zeroscan.integrations.common.ReportingCallback"  # the callback's name in its errors

    def __init__(
        self,
        *,
        every: int = 1,
        report_every: int | None = None,
        per_tensor: bool = False,
        prefix: str = "zeroscan",
        logger: logging.Logger | None = None,
        sinks: Sequence[Sink] = (),
        **monitor_options: Any,
    ) -> None:
        super().__init__()
        self.every, self.report_every, self.per_tensor, self.prefix, self.logger, self.sinks, self.options = (
            callback_settings(
                self.USER, every=every, report_every=report_every, per_tensor=per_tensor, prefix=prefix,
                logger=logger, sinks=sinks, options=monitor_options,
            )
        )
        self.monitor: Monitor | None = None
        self.report: Report | None = None
        self._reported_at = 0  # the framework's step at the last report
        self._steps_reported = 0  # the Monitor's steps_seen at the last report
        self._logged = LoggedFindings()  # the findings sent to Python logging so far

    def _start_run(self, step: int) -> None:
        """Forgets the last run's reports: a new Monitor starts at the framework's `step`."""
        self.report = None
        self._reported_at = step
        self._steps_reported = 0
        self._logged.clear()

    def _unreported(self) -> bool:
        """Whether the Monitor has seen steps since the last report (or none was made)."""
        assert self.monitor is not None
        return self.report is None or self.monitor.steps_seen > self._steps_reported

    def take_report(self, step: int, *, main_process: bool, final: bool, sinks: Sequence[Sink]) -> dict[str, float]:
        """One report of the Monitor, at the framework's `step`: its scalars
        to `sinks` (the framework's own), and on the main process to the
        callback's sinks, and what changed in its findings to Python logging
        (the summary line at INFO when `final`, else DEBUG). Returns the
        scalars."""
        assert self.monitor is not None
        self.report = self.monitor.report()
        self._reported_at = step
        self._steps_reported = self.monitor.steps_seen
        return send_report(
            self.report, step=step, sinks=[*sinks, *(self.sinks if main_process else ())], prefix=self.prefix,
            per_tensor=self.per_tensor, findings=self._logged if main_process else None, logger=self.logger,
            summary_level=logging.INFO if final else logging.DEBUG,
        )
