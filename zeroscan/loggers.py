"""Sending a Monitor report where people look: TensorBoard, W&B, files, logging.

Every dashboard and file is a sink: an object with one method,

    sink.log(scalars, step)          scalars: {tag: value}; step: the step they are of

(the Sink protocol below). A report becomes scalars by one function,
scalars(report), whose tags are the one scheme of the README's "What each
number means" ("zeroscan.grad/zero_pct/fc1.weight"); every dashboard call
here and every framework integration (zeroscan.integrations) hands those
to sinks.
Built in:

    TensorBoardSink(writer)          writer.add_scalar for each (you pass the
                                     SummaryWriter; zeroscan never creates one)
    JsonlLogger(path)                one JSON object per call, one per line
    CsvLogger(path)                  one row per scalar: step, tag, value

and any object with that log() is one: wandb (wandb.log(scalars, step)),
an accelerate.Accelerator, or your own class. Front doors that take a
Report or its ``to_dict()`` dict (so a report saved as JSON can be
replayed too):

    log_tensorboard(writer, report)  TensorBoardSink(writer).log(scalars(report), step),
                                     and writer.add_histogram_raw for each histogram of
                                     a Monitor(histogram=True) report
    JsonlLogger(path).log(report)    the report itself, one JSON object per report
    CsvLogger(path).log(report)      one row per tensor per report
    log_report(report, logger)       each finding to Python logging at its severity
                                     (text, not scalars)

Weights & Biases takes the same scalars:

    wandb.log(zeroscan.loggers.scalars(report), step=report.step)

and a Lightning module can hand them to whatever logger the Trainer has:

    self.log_dict(zeroscan.loggers.scalars(report))

or use zeroscan.integrations.lightning.ZeroscanCallback. tensorboard and
lightning are optional; this module imports neither.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO, cast

# The histogram calls are this module's too: log_tensorboard draws them, and users find
# every TensorBoard call in zeroscan.loggers.
from zeroscan.histogram_tensorboard import (  # noqa: F401  (names of this module)
    HistogramWriter,
    MagnitudeHistogram,
    log_tensorboard_histograms,
    magnitude_histogram,
    require_histogram_writer,
    with_histograms,
)
from zeroscan.report_data import json_safe, report_dict

LOG_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
SEVERITY_RANK = {"ok": 0, "info": 1, "warning": 2, "error": 3}
CSV_COLUMNS = (
    "step",
    "name",
    "kind",
    "numel",
    "zero_fraction",
    "subnormal_fraction",
    "near_zero_fraction",
    "nan",
    "inf",
    "norm",
    "mean",
    "std",
    "min_abs",
    "max_abs",
    "severity",
    "cause",
)
SCALAR_CSV_COLUMNS = ("step", "tag", "value")
REPORT_KEYS = ("step", "findings", "tensors")  # a dict with any of these is a report, not scalars


class Sink(Protocol):
    """Where scalars go: the one interface of every logger and integration.

    log(scalars, step) is called once per report with its scalars by tag
    (scalars(report): "zeroscan.findings/error", "zeroscan.grad/zero_pct",
    ...) and the step they are of: the report's own step, or, from a
    framework integration, its framework's step. A sink keeps or sends them
    as it likes."""

    def log(self, scalars: Mapping[str, float], step: int) -> None: ...


class ScalarWriter(Protocol):
    """What TensorBoardSink and log_tensorboard need: torch.utils.tensorboard.SummaryWriter,
    or anything else with the same add_scalar."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


def underflow_fraction(t: Mapping[str, Any]) -> float | None:
    """The underflow share of one tensor row: its subnormal values over all
    ("subnormal_fraction"; near-zero values are "near_zero_fraction", a
    quantity of its own). Reports saved before the key had that name have
    "underflow_fraction", read here too."""
    value = t.get("subnormal_fraction", t.get("underflow_fraction"))
    return None if value is None else float(value)


def scanned_words(tensors: Sequence[Mapping[str, Any]]) -> str:
    """What a report scanned, by kind: "24 gradients, 28 weights" (and
    activations where it has them), the words the report itself uses."""
    counts = {kind: sum(1 for t in tensors if t.get("kind") == kind) for kind in ("grad", "weight", "activation")}
    words = [f"{counts['grad']} gradient{'s' if counts['grad'] != 1 else ''}",
             f"{counts['weight']} weight{'s' if counts['weight'] != 1 else ''}"]
    if counts["activation"]:
        words.append(f"{counts['activation']} activation{'s' if counts['activation'] != 1 else ''}")
    return ", ".join(words)


# --- a report as scalars -------------------------------------------------------------


def report_rows(report: object) -> Mapping[str, Any]:
    """What the loggers read of a report: its "step", "findings" (as dicts)
    and "tensors". Report.to_dict() would also convert the history, P x
    steps values, which no scalar uses. A Report is known by its lists of
    findings and tensors (zeroscan.monitor imports this module, through its
    plots, so this one cannot import the Report class)."""
    findings, tensors = getattr(report, "findings", None), getattr(report, "tensors", None)
    if not isinstance(report, Mapping) and isinstance(findings, list) and isinstance(tensors, list):
        return {"step": getattr(report, "step", None), "findings": [f.to_dict() for f in findings], "tensors": tensors}
    return report_dict(report)


def scalars(
    report: object,
    *,
    prefix: str = "zeroscan",
    kinds: Sequence[str] = ("grad",),
    per_tensor: bool = True,
    summary: bool = False,
) -> dict[str, float]:
    """The scalars of one report, by tag: what every sink is given.

    Always ``{prefix}.findings/error``, ``/warning`` and ``/info``: the
    findings of each severity.

    per_tensor (the default): per tensor of the given kinds ("grad",
    "weight", "activation"), ``{prefix}.{kind}/norm/{name}``,
    ``{prefix}.{kind}/zero_pct/{name}`` and ``{prefix}.{kind}/underflow_pct/{name}``
    (underflow: subnormal values only). Missing values (a gradient that was
    never computed) are left out.

    summary: a fixed handful for the whole model, whatever its size (what
    the framework integrations log):

        {prefix}.grad/zero_pct        exact zeros, % of all gradient elements scanned
        {prefix}.grad/underflow_pct   subnormal values (underflow), % of the same
        {prefix}.grad/nonfinite       NaN and inf gradient elements
        {prefix}.grad/scanned         gradients scanned (a None gradient is not)

    with no gradient scanned, the three gradient shares are left out (not
    logged as 0). The per-tensor tags add the tensor's name to the
    model-wide ones ({prefix}.grad/zero_pct/fc1.weight), so each quantity's
    tags sit under one group.
    """
    data = report_rows(report)
    counts = {"error": 0, "warning": 0, "info": 0}
    for f in data.get("findings", []):
        severity = str(f.get("severity", "info")).lower()
        if severity in counts:
            counts[severity] += 1
    findings = {f"{prefix}.findings/{severity}": float(n) for severity, n in counts.items()}
    tensors = data.get("tensors", [])
    each = _per_tensor(tensors, prefix, kinds) if per_tensor else {}
    if not summary:  # per tensor, then the finding counts: the order dashboards have always been sent
        return {**each, **findings}
    return {**findings, **_model_wide(tensors, prefix), **each}  # the integrations' order


def _model_wide(tensors: Sequence[Mapping[str, Any]], prefix: str) -> dict[str, float]:
    """The gradients' summary scalars of scalars(summary=True), the finite ones."""
    grads = [t for t in tensors if t.get("kind") == "grad"]
    out = {f"{prefix}.grad/scanned": float(len(grads))}
    grads = [t for t in grads if int(t["numel"])]  # an empty gradient has no share to add
    numel = sum(int(t["numel"]) for t in grads)
    if numel:
        zeros = sum(float(t["zero_fraction"]) * int(t["numel"]) for t in grads)
        subnormal = sum(float(t["subnormal_fraction"]) * int(t["numel"]) for t in grads)
        out[f"{prefix}.grad/zero_pct"] = 100.0 * zeros / numel
        out[f"{prefix}.grad/underflow_pct"] = 100.0 * subnormal / numel
        out[f"{prefix}.grad/nonfinite"] = float(sum(int(t["nan"]) + int(t["inf"]) for t in grads))
    return {k: v for k, v in out.items() if math.isfinite(v)}


def _per_tensor(tensors: Sequence[Mapping[str, Any]], prefix: str, kinds: Sequence[str]) -> dict[str, float]:
    """The per-tensor scalars of scalars(per_tensor=True)."""
    out: dict[str, float] = {}
    for t in tensors:
        kind = str(t.get("kind", "grad"))
        if kind not in kinds:
            continue
        name = str(t["name"])
        zero, under = t.get("zero_fraction"), underflow_fraction(t)
        values = {
            "norm": t.get("norm"),
            "zero_pct": None if zero is None else 100.0 * float(zero),
            "underflow_pct": None if under is None else 100.0 * under,
        }
        for metric, value in values.items():
            if value is not None:
                out[f"{prefix}.{kind}/{metric}/{name}"] = float(value)
    return out


# --- TensorBoard -----------------------------------------------------------------------


class TensorBoardSink:
    """A Sink that writes each scalar with writer.add_scalar(tag, value, global_step=step)."""

    def __init__(self, writer: ScalarWriter) -> None:
        _require_add_scalar("TensorBoardSink", writer)
        self.writer = writer

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)


def log_tensorboard(
    writer: ScalarWriter,
    report: object,
    step: int | None = None,
    *,
    prefix: str = "zeroscan",
    kinds: Sequence[str] = ("grad",),
    histograms: bool = True,
) -> int:
    """Writes scalars(report) through TensorBoardSink(writer) at `step`
    (default the report's step) and, with histograms=True, the histograms of
    the report's tensors of `kinds` where it has them
    (log_tensorboard_histograms; the writer then needs add_histogram_raw);
    returns how many were written."""
    _require_add_scalar("log_tensorboard", writer)
    data = report_dict(report)
    if step is None:
        step = data.get("step")
    if histograms:
        require_histogram_writer("log_tensorboard", writer, with_histograms(data, kinds))
    values = scalars(data, prefix=prefix, kinds=kinds)
    TensorBoardSink(writer).log(values, step)
    if not histograms:
        return len(values)
    # require_histogram_writer has checked that it has add_histogram_raw where needed.
    hist_writer = cast(HistogramWriter, writer)
    return len(values) + log_tensorboard_histograms(hist_writer, data, step, prefix=prefix, kinds=kinds)


def _require_add_scalar(user: str, writer: object) -> None:
    if not callable(getattr(writer, "add_scalar", None)):
        raise TypeError(
            f"{user}: writer must have add_scalar (a torch.utils.tensorboard.SummaryWriter), "
            f"got {type(writer).__name__}"
        )


# --- files -------------------------------------------------------------------------


def is_report(data: object) -> bool:
    """Whether a file logger's log() was given a report (a Report, or a dict
    with "step", "findings" or "tensors") rather than scalars by tag."""
    return not isinstance(data, Mapping) or any(key in data for key in REPORT_KEYS)


class _FileLogger:
    """A file a Sink appends to. log(scalars, step) is the Sink's; log(report)
    (a Report or its to_dict() dict, `step` optional) writes the report
    itself, each subclass in its own form."""

    def __init__(self, path: str | os.PathLike[str], mode: str) -> None:
        if mode not in ("a", "w"):
            raise ValueError(f"mode must be 'a' (append) or 'w' (overwrite), got {mode!r}")
        self.path = Path(path)
        self._file: TextIO | None = open(self.path, mode, encoding="utf-8", newline="")

    @property
    def file(self) -> TextIO:
        if self._file is None:
            raise ValueError(f"{type(self).__name__}({str(self.path)!r}) is closed")
        return self._file

    def log(self, data: Mapping[str, float] | object, step: int | None = None) -> None:
        if is_report(data):
            report = report_dict(data)
            self.write_report(report, report.get("step") if step is None else step)
        else:
            self.write_scalars(cast(Mapping[str, float], data), step)
        self.file.flush()

    def write_report(self, report: Mapping[str, Any], step: int | None) -> None:
        raise NotImplementedError

    def write_scalars(self, scalars: Mapping[str, float], step: int | None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JsonlLogger(_FileLogger):
    """Appends one JSON object per log() to a file, one per line, with "time"
    (Unix seconds): log(scalars, step) writes {"step", "time", "scalars"};
    log(report) the report's dict plus "time". The history is left out
    unless asked for, since it grows with every step."""

    def __init__(self, path: str | os.PathLike[str], *, mode: str = "a", history: bool = False) -> None:
        super().__init__(path, mode)
        self.history = history

    def write_scalars(self, scalars: Mapping[str, float], step: int | None) -> None:
        self._write({"step": step, "time": time.time(), "scalars": dict(scalars)})

    def write_report(self, report: Mapping[str, Any], step: int | None) -> None:
        data = dict(report)
        if not self.history:
            data.pop("history", None)
        if "step" in data or step is not None:
            data["step"] = step
        data["time"] = time.time()
        self._write(data)

    def _write(self, data: Mapping[str, Any]) -> None:
        self.file.write(json.dumps(json_safe(data), separators=(",", ":")) + "\n")


class CsvLogger(_FileLogger):
    """Appends rows to a CSV file: log(scalars, step) one row per scalar
    (columns SCALAR_CSV_COLUMNS: step, tag, value); log(report) one row per
    tensor (columns CSV_COLUMNS), whose severity and cause are those of the
    worst finding about the tensor's name (its gradient, weight or the
    parameter as a whole; a grouped finding's members each count for their
    own name), empty when it has none.

    The header is written once, by the first log() into an empty file; a
    file holds rows of one form, and log() of the other raises ValueError."""

    def __init__(self, path: str | os.PathLike[str], *, mode: str = "a") -> None:
        super().__init__(path, mode)
        self.columns: tuple[str, ...] | None = _csv_header(self.path) if self.file.tell() else None

    def write_scalars(self, scalars: Mapping[str, float], step: int | None) -> None:
        writer = self._writer(SCALAR_CSV_COLUMNS, "scalars")
        for tag, value in scalars.items():
            writer.writerow({"step": "" if step is None else step, "tag": tag, "value": value})

    def write_report(self, report: Mapping[str, Any], step: int | None) -> None:
        writer = self._writer(CSV_COLUMNS, "a report's per-tensor rows")
        worst: dict[str, Mapping[str, Any]] = {}
        for f in (m for g in report.get("findings", []) for m in (g.get("members") or [g])):
            name = str(f.get("name"))
            sev = str(f.get("severity", "info")).lower()
            if name not in worst or SEVERITY_RANK.get(sev, 0) > SEVERITY_RANK.get(str(worst[name].get("severity")), 0):
                worst[name] = f
        for t in report.get("tensors", []):
            f = worst.get(str(t.get("name")), {})
            row = {c: t.get(c) for c in CSV_COLUMNS}
            row["step"] = step
            row["severity"] = str(f.get("severity", "")).lower()
            row["cause"] = f.get("cause", "")
            writer.writerow({k: "" if v is None else v for k, v in row.items()})

    def _writer(self, columns: tuple[str, ...], what: str) -> csv.DictWriter[str]:
        """A writer of rows of `columns`, after the header where the file has none yet."""
        if self.columns is None:
            self.columns = columns
            csv.writer(self.file).writerow(columns)
        elif self.columns != columns:
            raise ValueError(
                f"CsvLogger({str(self.path)!r}): the file has the columns {','.join(self.columns)}, "
                f"so it cannot take {what} (columns {','.join(columns)}); give each its own file"
            )
        return csv.DictWriter(self.file, fieldnames=columns, extrasaction="ignore")


def _csv_header(path: Path) -> tuple[str, ...]:
    """The first row of a CSV file, as written there."""
    with open(path, encoding="utf-8", newline="") as f:
        return tuple(next(csv.reader(f), ()))


# --- Python logging --------------------------------------------------------------------


def log_report(
    report: object, logger: logging.Logger | None = None, *, step: int | None = None, summary_level: int = logging.DEBUG
) -> int:
    """Logs each finding at its severity (info, warning, error) and a one-line
    summary at `summary_level` ("zeroscan step 7: 24 gradients, 28 weights
    scanned, 2 findings"); returns the number of findings logged. `step`:
    the step the lines name, default the report's own (the Monitor's count,
    from 0); the framework integrations pass their framework's step."""
    logger = logger or logging.getLogger("zeroscan")
    data = report_dict(report)
    findings = list(data.get("findings", []))
    if step is None:
        step = data.get("step")
    for f in findings:
        log_finding(logger, f, step)
    log_summary(logger, data, step, summary_level)
    return len(findings)


def log_finding(logger: logging.Logger, finding: Mapping[str, Any], step: object, *, was: str | None = None) -> None:
    """One finding (its to_dict() form) to `logger` at its severity; `was`:
    the severity it had when last logged, said at the end of the line."""
    sev = str(finding.get("severity", "info")).lower()
    logger.log(
        LOG_LEVELS.get(sev, logging.INFO),
        "zeroscan step %s: %s (%s): %s: %s%s",
        step, finding.get("name"), finding.get("kind"), finding.get("cause"), finding.get("message"),
        "" if was is None else f" (was {was})",
    )


def log_summary(logger: logging.Logger, report: Mapping[str, Any], step: object, level: int) -> None:
    """The one-line summary of a report (a to_dict() form) at `level`."""
    logger.log(
        level,
        "zeroscan step %s: %s scanned, %d findings",
        step, scanned_words(report.get("tensors", [])), len(report.get("findings", [])),
    )
