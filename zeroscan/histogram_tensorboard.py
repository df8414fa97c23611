"""A Monitor report's exact histograms drawn in TensorBoard, with no second
pass over any tensor: each tensor's counts by binade (Monitor(histogram=True))
become SummaryWriter.add_histogram_raw's buckets of |x|, and its NaN and inf
counts, which a TensorBoard histogram cannot hold, scalars of their own.
zeroscan.loggers.log_tensorboard calls it; tensorboard is not imported here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from zeroscan.report_data import report_dict


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
    tensors = with_histograms(data, kinds)
    require_histogram_writer("log_tensorboard_histograms", writer, tensors)
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


def with_histograms(data: Mapping[str, Any], kinds: Sequence[str]) -> list[Mapping[str, Any]]:
    """The report's tensors of `kinds` that have a histogram."""
    return [t for t in data.get("tensors", []) if t.get("histogram") and str(t.get("kind", "grad")) in kinds]


def require_histogram_writer(op: str, writer: object, tensors: list[Mapping[str, Any]]) -> None:
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
