"""Sending a Monitor report where people look: TensorBoard, W&B, files, logging.

Everything here takes a Report or its ``to_dict()`` dict (see
zeroscan.monitor), so a report saved as JSON can be replayed too:

    scalars(report)                  {tag: value}: norm, zero %, underflow % per tensor
                                     ("zeroscan.grad/zero_pct/fc1.weight"), and finding
                                     counts; feed it to any dashboard
    log_tensorboard(writer, report)  writer.add_scalar for each of them (you pass the
                                     SummaryWriter; zeroscan never creates one), and
                                     writer.add_histogram_raw for each histogram of a
                                     Monitor(histogram=True) report
    JsonlLogger(path).log(report)    one JSON object per report, one per line
    CsvLogger(path).log(report)      one row per tensor per report
    log_report(report, logger)       each finding to Python logging at its severity

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
from typing import Any, NamedTuple, Protocol, TextIO, cast

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


class ScalarWriter(Protocol):
    """What log_tensorboard needs: torch.utils.tensorboard.SummaryWriter, or
    anything else with the same add_scalar."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


class HistogramWriter(Protocol):
    """What log_tensorboard_histograms needs: torch.utils.tensorboard.SummaryWriter,
    or anything else with the same add_histogram_raw and add_scalar."""

    def add_histogram_raw(
        self,
        tag: str,
        min: float,
        max: float,
        num: int,
        sum: float,
        sum_squares: float,
        bucket_limits: list[float],
        bucket_counts: list[int],
        global_step: int | None = None,
    ) -> Any: ...

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


class MagnitudeHistogram(NamedTuple):
    """The arguments of SummaryWriter.add_histogram_raw that draw one tensor's
    histogram of |x| (see magnitude_histogram)."""

    min: float
    max: float
    num: int
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[int]


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


# --- dashboards ----------------------------------------------------------------


def scalars(report: object, *, prefix: str = "zeroscan", kinds: Sequence[str] = ("grad",)) -> dict[str, float]:
    """Dashboard scalars of one report, by tag.

    Per tensor of the given kinds ("grad", "weight", "activation"), tags
    ``{prefix}.{kind}/norm/{name}``, ``{prefix}.{kind}/zero_pct/{name}`` and
    ``{prefix}.{kind}/underflow_pct/{name}`` (underflow: subnormal values
    only); plus ``{prefix}.findings/{severity}`` counts. One scheme with the
    model-wide ``{prefix}.grad/zero_pct`` of the framework integrations
    (zeroscan.integrations.common.summary_scalars), so each quantity's tags
    sit under one group. Missing values (a gradient that was never computed)
    are left out.
    """
    data = report_dict(report)
    out: dict[str, float] = {}
    for t in data.get("tensors", []):
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
    counts = {"error": 0, "warning": 0, "info": 0}
    for f in data.get("findings", []):
        sev = str(f.get("severity", "info")).lower()
        if sev in counts:
            counts[sev] += 1
    for sev, n in counts.items():
        out[f"{prefix}.findings/{sev}"] = float(n)
    return out


def log_tensorboard(
    writer: ScalarWriter,
    report: object,
    step: int | None = None,
    *,
    prefix: str = "zeroscan",
    kinds: Sequence[str] = ("grad",),
    histograms: bool = True,
) -> int:
    """Writes scalars(report) with writer.add_scalar at `step` (default the
    report's step) and, with histograms=True, the histograms of the report's
    tensors of `kinds` where it has them (log_tensorboard_histograms; the
    writer then needs add_histogram_raw); returns how many were written."""
    if not callable(getattr(writer, "add_scalar", None)):
        raise TypeError(
            f"log_tensorboard: writer must have add_scalar (a torch.utils.tensorboard.SummaryWriter), "
            f"got {type(writer).__name__}"
        )
    data = report_dict(report)
    if step is None:
        step = data.get("step")
    if histograms:
        _require_histogram_writer("log_tensorboard", writer, _with_histograms(data, kinds))
    values = scalars(data, prefix=prefix, kinds=kinds)
    for tag, value in values.items():
        writer.add_scalar(tag, value, global_step=step)
    if not histograms:
        return len(values)
    # _require_histogram_writer has checked that it has add_histogram_raw where needed.
    hist_writer = cast(HistogramWriter, writer)
    return len(values) + log_tensorboard_histograms(hist_writer, data, step, prefix=prefix, kinds=kinds)


def magnitude_histogram(t: Mapping[str, Any]) -> MagnitudeHistogram | None:
    """TensorBoard's form of the exact histogram of one report tensor (an
    entry of Report.to_dict()["tensors"] with its "histogram"): a histogram of
    |x| over the tensor's finite values, None when it has no histogram or no
    finite value.

    Buckets, by upper limit: 0 holds the zeros; the dtype's smallest normal
    2^min_exponent (float32: 2^-126) the subnormals; 2^(e + 1) the binade
    2^e <= |x| < 2^(e + 1), from the lowest binade holding a value to the
    highest (one empty bucket ending at 2^lowest, so that the lowest binade
    keeps its width). NaN and inf fit no bucket: they are left out (num is
    the finite count; log_tensorboard_histograms logs them as scalars).
    min/max are the row's min_abs/max_abs (max: the highest bucket's limit
    when an inf hides the largest finite |x|); sum is the row's sum of x
    (signed: the scan has no sum of |x|) and sum_squares its norm^2, both
    over the finite values."""
    hist = t.get("histogram")
    if not hist:
        return None
    binades = {int(e): int(n) for e, n in hist["binades"].items() if int(n)}
    limits = [0.0, _power_of_two(int(hist["min_exponent"]))]
    counts = [int(hist["zeros"]), int(hist["subnormal"])]
    if binades:
        low, high = min(binades), max(binades)
        if low > int(hist["min_exponent"]):
            limits.append(_power_of_two(low))
            counts.append(0)
        for e in range(low, high + 1):
            limits.append(_power_of_two(e + 1))
            counts.append(binades.get(e, 0))
    finite = sum(counts)
    if finite == 0:
        return None
    top = max(k for k, n in enumerate(counts) if n)
    mean, norm = _finite_or(t.get("mean"), 0.0), _finite_or(t.get("norm"), 0.0)
    return MagnitudeHistogram(
        min=_finite_or(t.get("min_abs"), 0.0),
        max=_finite_or(t.get("max_abs"), limits[top]),
        num=finite,
        sum=mean * finite,
        sum_squares=norm * norm,
        bucket_limits=limits,
        bucket_counts=counts,
    )


def log_tensorboard_histograms(
    writer: HistogramWriter,
    report: object,
    step: int | None = None,
    *,
    prefix: str = "zeroscan",
    kinds: Sequence[str] = ("grad",),
) -> int:
    """Writes the histogram of |x| of each tensor of the given kinds that has
    one (Monitor(histogram=True)) with writer.add_histogram_raw, tag
    ``{prefix}.{kind}/magnitude/{name}``, from the report's exact counts (no
    second pass over any tensor; see magnitude_histogram), and its NaN and
    inf counts, which a TensorBoard histogram cannot hold, with
    writer.add_scalar as ``{prefix}.{kind}/nan/{name}`` and
    ``{prefix}.{kind}/inf/{name}``; at `step` (default the report's step).
    Returns how many histograms and scalars were written."""
    data = report_dict(report)
    if step is None:
        step = data.get("step")
    tensors = _with_histograms(data, kinds)
    _require_histogram_writer("log_tensorboard_histograms", writer, tensors)
    written = 0
    for t in tensors:
        kind, name, hist = str(t.get("kind", "grad")), str(t["name"]), t["histogram"]
        writer.add_scalar(f"{prefix}.{kind}/nan/{name}", float(hist["nan"]), global_step=step)
        writer.add_scalar(f"{prefix}.{kind}/inf/{name}", float(hist["posinf"] + hist["neginf"]), global_step=step)
        written += 2
        raw = magnitude_histogram(t)
        if raw is not None:
            writer.add_histogram_raw(f"{prefix}.{kind}/magnitude/{name}", **raw._asdict(), global_step=step)
            written += 1
    return written


def _with_histograms(data: Mapping[str, Any], kinds: Sequence[str]) -> list[Mapping[str, Any]]:
    """The report's tensors of `kinds` that have a histogram."""
    return [t for t in data.get("tensors", []) if t.get("histogram") and str(t.get("kind", "grad")) in kinds]


def _require_histogram_writer(op: str, writer: object, tensors: list[Mapping[str, Any]]) -> None:
    """Checked before anything is written, so that a failing call writes nothing."""
    if tensors and not callable(getattr(writer, "add_histogram_raw", None)):
        raise TypeError(
            f"{op}: writer must have add_histogram_raw (a torch.utils.tensorboard.SummaryWriter) to log the "
            f"report's histograms, got {type(writer).__name__}; pass histograms=False to log scalars only"
        )


def _power_of_two(e: int) -> float:
    """2.0 ** e as a float; inf above the float64 range (the top limit of float64's top binade)."""
    return math.ldexp(1.0, e) if e < 1024 else math.inf


def _finite_or(value: object, fallback: float) -> float:
    """value as a float, or `fallback` where it is missing (None in JSON) or not finite."""
    number = None if value is None else float(value)  # type: ignore[arg-type]
    return number if number is not None and math.isfinite(number) else fallback


# --- files -------------------------------------------------------------------------


class _FileLogger:
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

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JsonlLogger(_FileLogger):
    """Appends one JSON object per report to a file, one per line: the
    report's dict plus "time" (Unix seconds). The history is left out unless
    asked for, since it grows with every step."""

    def __init__(self, path: str | os.PathLike[str], *, mode: str = "a", history: bool = False) -> None:
        super().__init__(path, mode)
        self.history = history

    def log(self, report: object) -> None:
        data = dict(report_dict(report))
        if not self.history:
            data.pop("history", None)
        data["time"] = time.time()
        self.file.write(json.dumps(json_safe(data), separators=(",", ":")) + "\n")
        self.file.flush()


class CsvLogger(_FileLogger):
    """Appends one row per tensor per report (columns CSV_COLUMNS; the header
    is written once, when the file is empty). severity and cause are those of
    the worst finding about the tensor's name (its gradient, weight or the
    parameter as a whole; a grouped finding's members each count for their
    own name), empty when it has none."""

    def __init__(self, path: str | os.PathLike[str], *, mode: str = "a") -> None:
        super().__init__(path, mode)
        self.writer = csv.DictWriter(self.file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        if self.file.tell() == 0:
            self.writer.writeheader()
            self.file.flush()

    def log(self, report: object) -> None:
        data = report_dict(report)
        worst: dict[str, Mapping[str, Any]] = {}
        for f in (m for g in data.get("findings", []) for m in (g.get("members") or [g])):
            name = str(f.get("name"))
            sev = str(f.get("severity", "info")).lower()
            if name not in worst or SEVERITY_RANK.get(sev, 0) > SEVERITY_RANK.get(str(worst[name].get("severity")), 0):
                worst[name] = f
        for t in data.get("tensors", []):
            f = worst.get(str(t.get("name")), {})
            row = {c: t.get(c) for c in CSV_COLUMNS}
            row["step"] = data.get("step")
            row["severity"] = str(f.get("severity", "")).lower()
            row["cause"] = f.get("cause", "")
            self.writer.writerow({k: "" if v is None else v for k, v in row.items()})
        self.file.flush()


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
