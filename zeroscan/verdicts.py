"""The words zeroscan judges in, shared by diagnose and the Monitor.

`Severity` orders what is found; `Cause` names it (a `Code`: an enum of
machine-readable codes, each a str, so `finding.cause == "underflow"`
holds; a checkpoint tensor's `Role` is one too); `Verdict` is what diagnose
says of one tensor, each verdict a Cause with a fixed Severity; the
thresholds that both diagnose and the Monitor use have one meaning and one
default here.
"""

from __future__ import annotations

import enum

# format() types that only numbers take (str accepts only "s" or none).
NUMERIC_PRESENTATION_TYPES = frozenset("bcdeEfFgGnoxX%")


class Severity(enum.IntEnum):
    """How much a finding matters; ordered, so findings sort by it."""

    OK = 0
    INFO = 1
    WARNING = 2
    ERROR = 3

    # Text shows the lower-case name, as to_dict(), the CLI and the loggers
    # write it ("warning"), not the number IntEnum prints; the value stays an
    # int for ordering, int() and JSON.
    def __str__(self) -> str:
        return self.name.lower()

    def __format__(self, spec: str) -> str:
        # A numeric presentation type ("d", "x", ".1f") still asks for the number.
        if spec and spec[-1] in NUMERIC_PRESENTATION_TYPES:
            return format(int(self), spec)
        return format(str(self), spec)


class Code(str, enum.Enum):
    """An enum of machine-readable codes, each a str: str() and format()
    give the code ("underflow"), as JSON does."""

    def __str__(self) -> str:
        return self.value


class Cause(Code):
    """What is wrong (or worth knowing) about a tensor or a parameter."""

    # What the values of one scan say (diagnose's verdicts and the Monitor's).
    EMPTY = "empty"
    NONFINITE = "nonfinite"
    EXACT_ZERO = "exact_zero"
    UNDERFLOW = "underflow"
    MOSTLY_ZERO = "mostly_zero"
    PARTIAL_UNDERFLOW = "partial_underflow"
    CONSTANT = "constant"
    HEALTHY = "healthy"
    # Why a parameter gets no gradient (the Monitor's cause analysis).
    DETACHED = "detached"
    FROZEN = "frozen"
    UNUSED = "unused"
    NO_BACKWARD = "no_backward"
    GRAD_CLEARED = "grad_cleared"
    CONDITIONAL = "conditional"
    NOT_REACHED = "not_reached"
    NOT_IN_OPTIMIZER = "not_in_optimizer"
    PLAIN_ATTRIBUTE = "plain_attribute"
    # What a gradient's size or the weights' history say.
    VANISHING = "vanishing"
    # A gradient that is zero in exact arithmetic by the model's structure (a key bias
    # before softmax, a bias before a batch norm): what is left is rounding noise.
    ZERO_BY_STRUCTURE = "zero_by_structure"
    EXPLODING = "exploding"
    NOT_UPDATED = "not_updated"
    FROZEN_IN_TIME = "frozen_in_time"
    NORM_DRIFT = "norm_drift"
    ZERO_FRACTION_RISING = "zero_fraction_rising"
    # A parameter that trained and then stopped mid-run: frozen while in the optimizer,
    # out of the optimizer, or its param group's lr down to 0 (the Monitor).
    STOPPED_TRAINING = "stopped_training"
    # Steps: optimizer.step() skipped (GradScaler), or never seen.
    SKIPPED_STEPS = "skipped_steps"
    NO_STEP = "no_step"
    # Where the first inf/NaN was born (Monitor(trace_nonfinite=True)).
    NONFINITE_ORIGIN = "nonfinite_origin"
    # Activations.
    DEAD_UNITS = "dead_units"
    SATURATED_SOFTMAX = "saturated_softmax"
    # Across ranks, and what could not be looked at.
    REPLICA_MISMATCH = "replica_mismatch"
    MISSING_ON_RANKS = "missing_on_ranks"
    NOT_SCANNED = "not_scanned"


class Verdict(enum.Enum):
    """What one scanned tensor is; `verdict.severity` is fixed per verdict,
    and `verdict.cause` is the same code in the Monitor's findings."""

    # Each verdict's value is its Cause, the code the Monitor's findings use too.
    EMPTY = Cause.EMPTY
    NONFINITE = Cause.NONFINITE
    EXACT_ZERO = Cause.EXACT_ZERO
    UNDERFLOW = Cause.UNDERFLOW
    MOSTLY_ZERO = Cause.MOSTLY_ZERO
    PARTIAL_UNDERFLOW = Cause.PARTIAL_UNDERFLOW
    CONSTANT = Cause.CONSTANT
    HEALTHY = Cause.HEALTHY

    @property
    def severity(self) -> Severity:
        return _SEVERITY[self]

    @property
    def cause(self) -> Cause:
        return self.value

    # The value is a Cause, whose own repr would nest inside this one
    # ("<Verdict.HEALTHY: <Cause.HEALTHY: 'healthy'>>"): show its code instead.
    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value.value!r}>"

    def __str__(self) -> str:
        return self.value.value  # the cause code, as str(Cause) and to_dict() give it

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


_SEVERITY = {
    Verdict.EMPTY: Severity.INFO,
    Verdict.NONFINITE: Severity.ERROR,
    Verdict.EXACT_ZERO: Severity.WARNING,
    Verdict.UNDERFLOW: Severity.WARNING,
    Verdict.MOSTLY_ZERO: Severity.WARNING,
    Verdict.PARTIAL_UNDERFLOW: Severity.WARNING,
    Verdict.CONSTANT: Severity.INFO,
    Verdict.HEALTHY: Severity.OK,
}


# Exact zeros at least this fraction of the values: the tensor is mostly zero.
MOSTLY_ZERO = 0.9
# Subnormal values at least this fraction of the nonzero ones: precision is
# being lost (partial underflow).
PARTIAL_UNDERFLOW = 0.01


def check_fraction(op: str, name: str, value: object) -> float:
    """A threshold in (0, 1], or an error naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a number in (0, 1], got {type(value).__name__}")
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{op}: {name} must be in (0, 1], got {value}")
    return value
