"""What a checkpoint tensor is for, read from its name and shape, and which
verdicts are normal for it.

A freshly initialised model is full of tensors that are exactly zero or
constant on purpose: biases start at zero, a normalisation layer's scale at
one (or zero under zero-init residual), BatchNorm's running mean at zero and
its running variance at one. Judged by their values alone each would be a
warning, and a real one (an all-zero conv kernel) would drown among them.
So a checkpoint scan asks `tensor_role` what each tensor is and lowers to OK
only the verdicts that `NORMAL` lists for that role. Nothing else changes:
a NaN or an infinity stays an error in every role (but for the -inf of an
additive mask, see MASK), and an underflowed bias is still a warning.

  WEIGHT        dim >= 2 and no other role: a matrix, a conv kernel, an
                embedding table (or optimizer state shaped like one); all
                zero means the layer passes nothing on, so it stays a
                warning, as diagnose rates EXACT_ZERO: an error is kept for
                NaN/Inf, which poison every value computed from them, while
                a model with a dead layer still runs
  BIAS          the name's last part ends in "bias", or is "beta"
  SCALE         a 1-D (or 0-D) "weight", "gamma" or "scale": a normalisation
                layer's or another per-channel scale
  RUNNING_MEAN  "running_mean" (BatchNorm, InstanceNorm with running stats)
  RUNNING_VAR   "running_var"
  COUNTER       "num_batches_tracked"
  MASK          the name's last part holds "mask" or starts with "alibi": an
                attention mask or bias kept as a buffer; an additive one
                holds -inf where attention is blocked (softmax gives those
                entries weight 0), so -inf alone is normal in it, while a
                NaN or a +inf stays an error; its other verdicts stand (an
                all-zero mask may block everything or nothing)
  OTHER         anything else, judged by its values alone

An embedding's padding row (nn.Embedding(padding_idx=...)) is zero by design,
but it is one row of many: it never decides the tensor's verdict, so it
needs no role of its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from zeroscan.verdicts import Cause, Code, Severity


class Role(Code):
    """What a tensor of a checkpoint is for (see the module doc)."""

    WEIGHT = "weight"
    BIAS = "bias"
    SCALE = "scale"
    RUNNING_MEAN = "running_mean"
    RUNNING_VAR = "running_var"
    COUNTER = "counter"
    MASK = "mask"
    OTHER = "other"


# The verdicts that are how a tensor of each role starts out, and the words
# that say so. A running variance of zero is not among them: it starts at one,
# and zero means every input of the channel was the same (a dead channel
# upstream), which BatchNorm then divides by sqrt(eps).
NORMAL: dict[Role, tuple[frozenset[Cause], str]] = {
    Role.BIAS: (frozenset({Cause.EXACT_ZERO, Cause.MOSTLY_ZERO, Cause.CONSTANT}), "a bias"),
    Role.SCALE: (frozenset({Cause.EXACT_ZERO, Cause.MOSTLY_ZERO, Cause.CONSTANT}),
                 "a normalisation layer's scale (ones, or zeros under zero-init residual)"),
    Role.RUNNING_MEAN: (frozenset({Cause.EXACT_ZERO, Cause.MOSTLY_ZERO, Cause.CONSTANT}),
                        "a running mean (zeros until the layer sees data)"),
    Role.RUNNING_VAR: (frozenset({Cause.CONSTANT}), "a running variance (ones until the layer sees data)"),
    Role.COUNTER: (frozenset({Cause.EXACT_ZERO, Cause.CONSTANT}), "a batch counter"),
}

_BUFFERS = {"running_mean": Role.RUNNING_MEAN, "running_var": Role.RUNNING_VAR, "num_batches_tracked": Role.COUNTER}
_SCALES = frozenset({"weight", "gamma", "scale"})


def tensor_role(name: str, shape: Sequence[int]) -> Role:
    """The role of the tensor `name` (a dotted state_dict name such as
    "layer1.0.bn2.weight") of shape `shape`."""
    if not isinstance(name, str):
        raise TypeError(f"zeroscan.checkpoint.roles.tensor_role: name must be a str, got {type(name).__name__}")
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"zeroscan.checkpoint.roles.tensor_role: shape must be a sequence of ints, got {type(shape).__name__}")
    # The last dotted part, less the "#2" that zeroscan.checkpoint appends to a repeated name.
    last = re.sub(r"#\d+$", "", name).rsplit(".", 1)[-1].lower()
    if last in _BUFFERS:
        return _BUFFERS[last]
    if "mask" in last or last.startswith("alibi"):
        return Role.MASK
    if last.endswith("bias") or last == "beta":
        return Role.BIAS
    if len(shape) <= 1 and last in _SCALES:
        return Role.SCALE
    return Role.WEIGHT if len(shape) >= 2 else Role.OTHER


def judge_in_role(
    role: Role, cause: Cause, severity: Severity, reason: str, *, only_negative_infinities: bool = False
) -> tuple[Severity, str]:
    """The severity and reason of a verdict (`cause`, at `severity`) for a
    tensor of `role`: OK, saying why, when the verdict is normal for it;
    unchanged otherwise. `only_negative_infinities`: the tensor's only
    non-finite values are -inf (no NaN, no +inf), which an additive mask holds."""
    if role is Role.MASK and cause == Cause.NONFINITE and only_negative_infinities:
        return Severity.OK, (f"{reason}, which is normal for an additive mask: -inf where attention is blocked, "
                             "to which softmax gives weight 0")
    normal = NORMAL.get(role)
    if normal is None or cause not in normal[0] or severity == Severity.OK:
        return severity, reason
    return Severity.OK, f"{reason}, which is normal for {normal[1]}"
