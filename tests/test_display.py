"""What zeroscan's objects print: short counts and byte sizes that carry into
the next unit ("1.0M", never "1000.0K"), the non-finite counts of a Stats line
(only those present, each flagged), Severity and Verdict as the lower-case
words the rest of zeroscan writes, and reprs that do not nest or dump arrays."""

from __future__ import annotations

import json
import math

import pytest
import torch

import zeroscan
from zeroscan.cli.cells import fmt_bytes
from zeroscan.diagnosis import Verdict
from zeroscan.histogram import Histogram
from zeroscan.words import short_count
from zeroscan.loggers import SEVERITY_RANK
from zeroscan.monitor.report import Finding, Report
from zeroscan.checkpoint.groups import RANK
from zeroscan.verdicts import Cause, Severity

NAN, INF = math.nan, math.inf

# --- counts and byte sizes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "want"),
    [
        (0, "0"), (999, "999"), (1000, "1000"), (9999, "9999"),  # exact below 10K
        (10_000, "10.0K"), (12_345, "12.3K"),
        (999_499, "999.5K"), (999_500, "999.5K"), (999_949, "999.9K"),
        (999_950, "1.0M"), (10**6, "1.0M"), (1_234_567, "1.2M"),  # rounds to 1000.0K: carried
        (999_949_999, "999.9M"), (999_950_000, "1.0G"), (10**9 - 1, "1.0G"), (10**9, "1.0G"),
        (10**12 - 1, "1.0T"), (10**12, "1.0T"),
        (10**15, "1000.0T"),  # past the largest unit a count stays in it
    ],
)
def test_short_count_carries_into_the_next_unit(n: int, want: str) -> None:
    assert short_count(n) == want


@pytest.mark.parametrize("scale", [1e3, 1e6, 1e9])
@pytest.mark.parametrize("below", [0, 1, 49, 50, 51, 0.05, 0.1])
def test_short_count_never_shows_1000_of_a_unit(scale: float, below: float) -> None:
    """Just under each unit's next one (by whole counts and by fractions of a
    unit): the number shown stays below 1000 and within half a last digit of n."""
    n = int(1000 * scale - (below * scale if below < 1 else below))
    text = short_count(n)
    value, unit = float(text[:-1]), text[-1]
    shown_scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[unit]
    assert value < 1000, text
    assert abs(value * shown_scale - n) <= 0.05 * shown_scale, (n, text)


@pytest.mark.parametrize(
    ("n", "want"),
    [
        (0, "0 B"), (1023, "1023 B"), (1023.4, "1023 B"),
        (1023.5, "1.0 KiB"), (1023.6, "1.0 KiB"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),  # "1024 B" carried
        (1023.94 * 1024, "1023.9 KiB"), (1023.96 * 1024, "1.0 MiB"), (1024**2, "1.0 MiB"),
        (1024**3 - 1, "1.0 GiB"), (1024**4 - 1, "1.0 TiB"), (1024**5 - 1, "1.0 PiB"), (1024**5, "1.0 PiB"),
        (1024**6, "1024.0 PiB"),  # past the largest unit a size stays in it
    ],
)
def test_fmt_bytes_carries_into_the_next_unit(n: float, want: str) -> None:
    assert fmt_bytes(n) == want


def test_stats_counts_carry_into_the_next_unit() -> None:
    s = zeroscan.stats(torch.zeros(10**6, dtype=torch.int8))
    assert repr(s).startswith("Stats(int8[1000000] n=1.0M zeros=1.0M (100%) ")


# --- Stats: the non-finite counts ------------------------------------------------------

# Each mix of non-finite values and the whole line it prints: only the kinds
# present, each flagged with "!".
STATS_LINES = {
    "finite": ([1.0, 2.0], "Stats(float32[2] n=2 zeros=0 (0%) |x|∈[1, 2] μ=1.5 σ=0.707 ‖x‖=2.24)"),
    "nan": ([1.0, NAN], "Stats(float32[2] n=2 zeros=0 (0%) NaN=1! |x|∈[1, 1] μ=1 σ=nan ‖x‖=1)"),
    "+inf": ([1.0, INF], "Stats(float32[2] n=2 zeros=0 (0%) +inf=1! |x|∈[1, ∞] μ=1 σ=nan ‖x‖=1)"),
    "-inf": ([1.0, -INF], "Stats(float32[2] n=2 zeros=0 (0%) -inf=1! |x|∈[1, ∞] μ=1 σ=nan ‖x‖=1)"),
    "both infs": ([INF, -INF], "Stats(float32[2] n=2 zeros=0 (0%) +inf=1! -inf=1! |x|∈[∞, ∞] μ=nan σ=nan ‖x‖=0)"),
    "nan and +inf": ([NAN, INF, 0.0],
                     "Stats(float32[3] n=3 zeros=1 (33.3%) NaN=1! +inf=1! |x|∈[0, ∞] μ=0 σ=nan ‖x‖=0)"),
    "nan and both infs": ([NAN, INF, -INF],
                          "Stats(float32[3] n=3 zeros=0 (0%) NaN=1! +inf=1! -inf=1! |x|∈[∞, ∞] μ=nan σ=nan ‖x‖=0)"),
    "all nan": ([NAN, NAN], "Stats(float32[2] n=2 zeros=0 (0%) NaN=2! |x|∈[nan, nan] μ=nan σ=nan ‖x‖=0)"),
}


@pytest.mark.parametrize("mix", list(STATS_LINES))
def test_stats_line_lists_the_nonfinite_values_present(mix: str) -> None:
    values, want = STATS_LINES[mix]
    assert repr(zeroscan.stats(torch.tensor(values))) == want


def test_stats_line_of_many_nan_is_short() -> None:
    x = torch.full((20_000,), NAN)
    x[:10] = 1.0
    assert " NaN=20.0K! |x|" in repr(zeroscan.stats(x))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_stats_line_of_an_integer_tensor(dtype: torch.dtype) -> None:
    """An integer tensor has no non-finite values to list, and its |x| reads as
    integers: "[0, 1]", not "[0.0, 1]"."""
    s = zeroscan.stats(torch.tensor([0, 1, 1, 0]).to(dtype))
    name = str(dtype).removeprefix("torch.")
    assert repr(s) == f"Stats({name}[4] n=4 zeros=2 (50%) |x|∈[0, 1] μ=0.5 σ=0.577 ‖x‖=1.41)"


# --- Severity ------------------------------------------------------------------------


@pytest.mark.parametrize("severity", list(Severity))
def test_severity_prints_its_lower_case_name(severity: Severity) -> None:
    word = severity.name.lower()
    assert str(severity) == word
    assert f"{severity}" == format(severity) == f"{severity!s}" == "%s" % severity == word
    assert f"{severity:>9}" == f"{word:>9}"  # a str spec pads the word
    assert repr(severity) == f"<Severity.{severity.name}: {int(severity)}>"


@pytest.mark.parametrize("severity", list(Severity))
def test_severity_stays_an_ordered_int(severity: Severity) -> None:
    value = int(severity)
    assert severity == value and isinstance(severity, int)
    assert f"{severity:d}" == "%d" % severity == str(value)  # a numeric spec still asks for the number
    assert f"{severity:03d}" == f"{value:03d}" and f"{severity:.1f}" == f"{value:.1f}"
    assert json.dumps(severity) == str(value)  # JSON written from a Severity is unchanged


def test_severities_sort_by_their_numbers() -> None:
    assert sorted(reversed(Severity)) == [Severity.OK, Severity.INFO, Severity.WARNING, Severity.ERROR]
    assert Severity.ERROR > Severity.WARNING > Severity.INFO > Severity.OK == 0


@pytest.mark.parametrize("severity", list(Severity))
def test_severity_words_are_the_ones_reports_write(severity: Severity) -> None:
    """The CLI and the loggers rank severities by their words; str() gives
    exactly those words, at the same rank."""
    assert RANK[str(severity)] == SEVERITY_RANK[str(severity)] == int(severity)
    finding = Finding("w", "grad", severity, Cause.UNDERFLOW, "m")
    assert finding.to_dict()["severity"] == str(severity)


@pytest.mark.parametrize("verdict", list(Verdict))
def test_diagnosis_severity_prints_a_word(verdict: Verdict) -> None:
    d = zeroscan.diagnosis.Diagnosis(verdict, "why", zeroscan.stats(torch.ones(2)))
    assert f"{d.severity}" == str(d.severity) == d.to_dict()["severity"] == d.severity.name.lower()


# --- Verdict and Cause -------------------------------------------------------------------


@pytest.mark.parametrize("verdict", list(Verdict))
def test_verdict_repr_and_str_show_its_code(verdict: Verdict) -> None:
    code = verdict.cause.value
    assert repr(verdict) == f"<Verdict.{verdict.name}: {code!r}>"  # not the Cause's repr nested inside
    assert str(verdict) == f"{verdict}" == format(verdict) == code == str(verdict.cause)
    assert f"{verdict:>20}" == f"{code:>20}"


@pytest.mark.parametrize("cause", list(Cause))
def test_cause_repr_and_str(cause: Cause) -> None:
    assert repr(cause) == f"<Cause.{cause.name}: {cause.value!r}>"
    assert str(cause) == f"{cause}" == cause.value


def test_diagnosis_repr_shows_the_verdict_once() -> None:
    d = zeroscan.diagnose(torch.tensor([1.0, 2.0]))
    assert repr(d).startswith("Diagnosis(verdict=<Verdict.HEALTHY: 'healthy'>, reason=")
    assert str(d).startswith("HEALTHY (ok): ")


# --- Finding, Report, Histogram --------------------------------------------------------------


def test_finding_str_is_one_line() -> None:
    f = Finding("fc.weight", "grad", Severity.WARNING, Cause.UNDERFLOW, "too small")
    assert str(f) == "warning fc.weight (grad, underflow): too small"
    assert repr(f).startswith("Finding(name='fc.weight', kind='grad', severity=<Severity.WARNING: 2>, "
                              "cause=<Cause.UNDERFLOW: 'underflow'>, ")


@pytest.mark.parametrize("severity", list(Severity))
def test_report_repr_names_the_worst_severity_in_words(severity: Severity) -> None:
    history = {"steps": [], "names": [], "grad_norm": [], "zero_fraction": [], "subnormal_fraction": []}
    report = Report(7, [Finding("w", "grad", severity, Cause.UNDERFLOW, "m")], [], history)
    assert repr(report) == f"Report(step=7, findings=1, worst={severity.name.lower()})"


def test_histogram_repr_shows_the_occupied_binades() -> None:
    h = zeroscan.stats(torch.tensor([0.0, 1.0, 3.0, 0.25, NAN, INF, -INF, 1e-40]), histogram=True).histogram
    assert isinstance(h, Histogram)
    assert repr(h) == str(h) == (
        "Histogram(dtype=float32, numel=8, binades={-2: 1, 0: 1, 1: 1}, zeros=1, subnormal=1, posinf=1, neginf=1, nan=1)"
    )


def test_histogram_repr_of_an_integer_tensor() -> None:
    h = zeroscan.stats(torch.tensor([0, 1, 2, 3, -4]), histogram=True).histogram
    assert isinstance(h, Histogram)
    assert repr(h) == (
        "Histogram(dtype=int64, numel=5, binades={0: 1, 1: 2, 2: 1}, zeros=1, subnormal=0, posinf=0, neginf=0, nan=0)"
    )
