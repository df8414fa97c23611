"""Sending a Monitor report where people look: TensorBoard, W&B, files, logging.

Everything here takes a Report or its ``to_dict()`` dict (see
zeroscan.monitor), so a report saved as JSON can be replayed too:

    scalars(report)                  {tag: value}: norm, zero %, underflow % per tensor,
                                     and finding counts; feed it to any dashboard
    log_tensorboard(writer, report)  writer.add_scalar for each of them (you pass the
                                     SummaryWriter; zeroscan never creates one)
    JsonlLogger(path).log(report)    one JSON object per report, one per line
    CsvLogger(path).log(report)      one row per tensor per report
    log_report(report, logger)       each finding to Python logging at its severity

Weights & Biases takes the same scalars:

    wandb.log(zeroscan.loggers.scalars(report), step=report.step)

and a Lightning module can hand them to whatever logger the Trainer has:

    self.log_dict(zeroscan.loggers.scalars(report))

or use ``lightning_callback()``. tensorboard and lightning are optional; this
module imports neither.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

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


def underflow_fraction(t: Mapping[str, Any]) -> float | None:
    """The report's underflow share of one tensor: subnormal values over all."""
    value = t.get("underflow_fraction", t.get("subnormal_fraction"))
    return None if value is None else float(value)


# --- dashboards ----------------------------------------------------------------


def scalars(report: object, *, prefix: str = "zeroscan", kinds: Sequence[str] = ("grad",)) -> dict[str, float]:
    """Dashboard scalars of one report, by tag.

    Per tensor of the given kinds ("grad", "weight", "activation"), tags
    ``{prefix}.{kind}_norm/{name}``, ``{prefix}.{kind}_zero_pct/{name}`` and
    ``{prefix}.{kind}_underflow_pct/{name}`` (so each quantity gets its own
    section in TensorBoard and W&B); plus ``{prefix}.findings/{severity}``
    counts. Missing values (a gradient that was never computed) are left out.
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
                out[f"{prefix}.{kind}_{metric}/{name}"] = float(value)
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
) -> int:
    """Writes scalars(report) with writer.add_scalar at `step` (default the
    report's step) and returns how many were written."""
    if not callable(getattr(writer, "add_scalar", None)):
        raise TypeError(
            f"log_tensorboard: writer must have add_scalar (a torch.utils.tensorboard.SummaryWriter), "
            f"got {type(writer).__name__}"
        )
    data = report_dict(report)
    if step is None:
        step = data.get("step")
    values = scalars(data, prefix=prefix, kinds=kinds)
    for tag, value in values.items():
        writer.add_scalar(tag, value, global_step=step)
    return len(values)


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
    parameter as a whole), empty when it has none."""

    def __init__(self, path: str | os.PathLike[str], *, mode: str = "a") -> None:
        super().__init__(path, mode)
        self.writer = csv.DictWriter(self.file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        if self.file.tell() == 0:
            self.writer.writeheader()
            self.file.flush()

    def log(self, report: object) -> None:
        data = report_dict(report)
        worst: dict[str, Mapping[str, Any]] = {}
        for f in data.get("findings", []):
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


def log_report(report: object, logger: logging.Logger | None = None, *, summary_level: int = logging.DEBUG) -> int:
    """Logs each finding at its severity (info, warning, error) and a one-line
    summary at `summary_level`; returns the number of findings logged."""
    logger = logger or logging.getLogger("zeroscan")
    data = report_dict(report)
    findings = list(data.get("findings", []))
    step = data.get("step")
    for f in findings:
        sev = str(f.get("severity", "info")).lower()
        logger.log(
            LOG_LEVELS.get(sev, logging.INFO),
            "zeroscan step %s: %s (%s): %s: %s",
            step, f.get("name"), f.get("kind"), f.get("cause"), f.get("message"),
        )
    logger.log(
        summary_level,
        "zeroscan step %s: %d tensors, %d findings",
        step, len(data.get("tensors", [])), len(findings),
    )
    return len(findings)


# --- Lightning ------------------------------------------------------------------------------


def lightning_callback(
    *, log_every: int = 50, logger: logging.Logger | None = None, prefix: str = "zeroscan", **monitor_kwargs: Any
) -> Any:
    """A Lightning Callback running a zeroscan Monitor over the LightningModule.

    It scans before each optimizer step (Lightning's on_before_optimizer_step)
    and, every `log_every` steps, sends scalars(report) to the Trainer's
    loggers through LightningModule.log_dict and each finding to Python
    logging. `monitor_kwargs` go to zeroscan.Monitor (every, history,
    activations, thresholds). The latest report is kept as `callback.report`.

        trainer = lightning.Trainer(callbacks=[zeroscan.loggers.lightning_callback()])
    """
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"lightning_callback: log_every must be an int >= 1, got {log_every!r}")
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError:
            raise ImportError("zeroscan.loggers.lightning_callback needs Lightning: pip install lightning") from None
    from zeroscan.monitor import Monitor

    class ZeroscanCallback(Callback):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            self.monitor: Monitor | None = None
            self.report: Any = None
            self.steps = 0

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            optimizers = list(getattr(trainer, "optimizers", None) or [])
            optimizer = optimizers[0] if len(optimizers) == 1 else None
            self.monitor = Monitor(pl_module, optimizer, auto=False, **monitor_kwargs)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.monitor is None:
                return
            self.monitor.step()
            self.steps += 1
            if self.steps % log_every == 0:
                self.report = self.monitor.report()
                pl_module.log_dict(scalars(self.report, prefix=prefix))
                log_report(self.report, logger)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            if self.monitor is not None:
                self.report = self.monitor.report()
                self.monitor.close()

    return ZeroscanCallback()
