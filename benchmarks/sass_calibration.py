"""sass_cost.py's issue slots, calibrated against what an H200 measured.

sass_cost.py adds each instruction's slots at its pipe's peak rate
(benchmarks/pipe_rates.cu). On the H200 that sum missed in both directions.
It counted 26-35 % over the slots the integer-heavy kernels of 2026-11-27
spent (their integer, FP64 and conversion pipes overlap). It counted 22-40 %
under those of the float-pipe kernels of 2026-11-30 (their FP32 and packed
FP16 arithmetic issues below the peak it reaches alone). Two factors, one
for the float pipes' slots and one for every other slot, fitted to the four
plain contiguous kernels below, bring all four within 7 %:

    H200 slots an element = FLOAT_FACTOR * float-pipe slots + OTHER_FACTOR * other slots

The four histogram kernels measured in the same runs are held out of the fit
and checked against it (calibration_table). Three land within 6 %; the
2026-11-30 bfloat16 histogram spent 35 % more slots than predicted (the
prediction is 26 % under). It counts one shared-memory atomic an element,
and so does the float32 histogram, which the model predicts within 6 %: if
shared atomics are what bounds the bfloat16
histogram, an SM completes about 3.7 of them a clock (ATOMIC_RATE, one point,
an estimate). The one-byte kernels count one atomic an element too, and no
one-byte kernel has run on a GPU: predict_share gives their prediction with
and without that bound.

    python benchmarks/sass_cost.py --calibration   # the runs, the fit, the residuals
"""

from __future__ import annotations

from dataclasses import dataclass

# The H200 of the runs below: 132 SMs, four schedulers each issuing one warp
# instruction (32 lanes) a clock at up to 1.98 GHz; its device-to-device copy
# moved 4,237 GB/s, bytes read plus written (benchmarks/README.md, 2026-11-27).
H200_SLOTS_PER_S = 132 * 4 * 1.98e9 * 32
H200_COPY_BYTES_PER_S = 4237e9
H200_SMS_CLOCKS_PER_S = 132 * 1.98e9


@dataclass(frozen=True)
class H200Run:
    """One kernel as an H200 ran it at 1 GB (its worst distribution), beside
    sass_cost.py's count of that kernel's slots an element."""

    kernels: str  # the commit whose kernels ran, and the day
    dtype: str
    kind: str  # "contig" or "contig_hist"
    elements_per_s: float
    float_slots: float  # sass_cost.py: the float pipes' slots an element
    other_slots: float  # every other slot an element, the per-tile code's included
    fitted: bool  # in the fit, or held out to check it

    @property
    def slots(self) -> float:
        """The slots an element the H200 spent."""
        return H200_SLOTS_PER_S / self.elements_per_s


# Element rates from benchmarks/README.md: 2026-11-27, 0.51 ms (float32) and
# 1.00 ms (bfloat16) a GB, the histograms 45.5 % and 23 % of the copy;
# 2026-11-30, 79.5 % and 58 % of the copy, the histograms 73 % and 46 %.
# Shares of the copy are turned into elements a second with the 2026-11-27
# copy's 4,237 GB/s: the 2026-11-30 run's copy rate is not recorded. The
# slots are sass_cost.py's on a checkout of that commit.
H200_RUNS: tuple[H200Run, ...] = (
    H200Run("a2f1f87, 2026-11-27", "float32", "contig", 268.4e6 / 0.51e-3, 0.00, 80.29, True),
    H200Run("a2f1f87, 2026-11-27", "bfloat16", "contig", 536.9e6 / 1.00e-3, 0.00, 83.81, True),
    H200Run("d418703, 2026-11-30", "float32", "contig", 0.795 * H200_COPY_BYTES_PER_S / 4, 21.22, 9.57, True),
    H200Run("d418703, 2026-11-30", "bfloat16", "contig", 0.58 * H200_COPY_BYTES_PER_S / 2, 12.47, 6.56, True),
    H200Run("a2f1f87, 2026-11-27", "float32", "contig_hist", 0.455 * H200_COPY_BYTES_PER_S / 4, 0.00, 89.58, False),
    H200Run("a2f1f87, 2026-11-27", "bfloat16", "contig_hist", 0.23 * H200_COPY_BYTES_PER_S / 2, 0.00, 92.92, False),
    H200Run("d418703, 2026-11-30", "float32", "contig_hist", 0.73 * H200_COPY_BYTES_PER_S / 4, 18.25, 14.67, False),
    H200Run("d418703, 2026-11-30", "bfloat16", "contig_hist", 0.46 * H200_COPY_BYTES_PER_S / 2, 10.97, 9.76, False),
)


def fit(runs: tuple[H200Run, ...]) -> tuple[float, float]:
    """(float factor, other factor) that minimize the sum of squared relative
    errors of float * F + other * O against the measured slots: linear least
    squares, two normal equations."""
    rows = [(r.float_slots / r.slots, r.other_slots / r.slots) for r in runs if r.fitted]
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa = sum(a for a, _ in rows)
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    if det <= 1e-9 * saa * sbb:  # (nearly) proportional columns: no unique fit
        raise ValueError("fit: the fitted runs do not separate the float pipes from the rest")
    return (sa * sbb - sb * sab) / det, (sb * saa - sa * sab) / det


FLOAT_FACTOR, OTHER_FACTOR = fit(H200_RUNS)

# Shared-memory atomics an SM completes a clock, if they bound the 2026-11-30
# bfloat16 histogram (one atomic an element): one point, an estimate.
ATOMIC_RATE = next(
    r.elements_per_s for r in H200_RUNS if r.kernels.startswith("d418703") and r.dtype == "bfloat16" and r.kind == "contig_hist"
) / H200_SMS_CLOCKS_PER_S


def h200_slots(float_slots: float, other_slots: float) -> float:
    return FLOAT_FACTOR * float_slots + OTHER_FACTOR * other_slots


def predict_share(float_slots: float, other_slots: float, elem_size: int, atomics: float = 0.0) -> tuple[float, float]:
    """The predicted stats read GB/s as a share of the H200's copy GB/s, at
    most 1 (x.sum() read 98-101 % of it): from the calibrated slots alone,
    and also bounded by ATOMIC_RATE for `atomics` shared atomics an element."""
    elements_per_s = H200_SLOTS_PER_S / h200_slots(float_slots, other_slots)
    issue = min(1.0, elements_per_s * elem_size / H200_COPY_BYTES_PER_S)
    if atomics <= 0:
        return issue, issue
    bounded = min(elements_per_s, ATOMIC_RATE * H200_SMS_CLOCKS_PER_S / atomics)
    return issue, min(1.0, bounded * elem_size / H200_COPY_BYTES_PER_S)


def calibration_table() -> list[str]:
    """The runs, the raw and calibrated counts against the measured slots."""
    lines = [
        f"H200 slots an element = {FLOAT_FACTOR:.3f} x float-pipe slots + {OTHER_FACTOR:.3f} x other slots "
        f"(fitted to the plain kernels); shared atomics at most {ATOMIC_RATE:.1f} an SM clock (estimate)",
        "",
        "| kernels | dtype | kernel | measured G elements/s | measured slots | sass_cost slots | error | calibrated | error | |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in H200_RUNS:
        raw = r.float_slots + r.other_slots
        cal = h200_slots(r.float_slots, r.other_slots)
        lines.append(
            f"| {r.kernels} | {r.dtype} | {r.kind} | {r.elements_per_s / 1e9:.0f} | {r.slots:.1f} | {raw:.1f} | "
            f"{raw / r.slots - 1:+.0%} | {cal:.1f} | {cal / r.slots - 1:+.1%} | {'fitted' if r.fitted else 'held out'} |"
        )
    return lines


def worst_fitted_error() -> float:
    return max(abs(h200_slots(r.float_slots, r.other_slots) / r.slots - 1) for r in H200_RUNS if r.fitted)
