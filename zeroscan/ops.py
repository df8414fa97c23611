"""The native operators: loading them, their fake kernels, and input checks.

`torch.ops.zeroscan.stats` and `torch.ops.zeroscan.stats_many` are declared
once in csrc/zeroscan.cpp and implemented per backend in csrc/cpu and
csrc/cuda. The fake kernels here give their output shapes to torch.compile and
to meta/fake tensors without running them.
"""

from __future__ import annotations

import torch

from zeroscan import _C  # noqa: F401  (loading the library registers the ops)

# Columns of a result row; mirrors the Field enum in csrc/stats_record.h.
NUM_FIELDS = 16
COUNT_FIELDS = ("numel", "zeros", "subnormal", "near_zero", "nan", "posinf", "neginf", "negative")
FLOAT_FIELDS = ("min_abs", "min_abs_nonzero", "max_abs", "mean", "m2")
FLOAT_COLUMNS = slice(8, 8 + len(FLOAT_FIELDS))

NONE_HINT = (
    "a gradient that was never computed is None: the parameter is frozen "
    "(requires_grad=False), did not take part in the forward pass, or backward "
    "has not run yet; zeroscan.diagnose explains which"
)


@torch.library.register_fake("zeroscan::stats")
def _stats_fake(x: torch.Tensor, tol: float | None = None) -> torch.Tensor:
    return x.new_empty((NUM_FIELDS,), dtype=torch.int64)


@torch.library.register_fake("zeroscan::stats_many")
def _stats_many_fake(xs: list[torch.Tensor], tol: float | None = None) -> torch.Tensor:
    # One meta tensor among real ones dispatches the whole call here: refuse
    # it, as the real kernels refuse mixed devices.
    devices = {x.device for x in xs}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise RuntimeError(f"zeroscan.stats_many: all tensors of one call must be on one device, got {names}")
    return xs[0].new_empty((len(xs), NUM_FIELDS), dtype=torch.int64)


def check_tensor(op: str, what: str, x: object, index: int | None = None) -> torch.Tensor:
    """Returns x if zeroscan can scan it, else raises an error naming `what`
    (`what[index]` for an element of a list)."""
    if isinstance(x, torch.Tensor) and x.layout == torch.strided and not x.is_meta:
        return x
    name = what if index is None else f"{what}[{index}]"
    if isinstance(x, torch.Tensor):
        if x.is_meta:
            raise ValueError(f"{op}: {name} is on the meta device and holds no data to scan")
        raise ValueError(
            f"{op}: {name} is a {x.layout} tensor; zeroscan scans dense tensors "
            "(pass x.to_dense(), or x.values() for the stored entries only)"
        )
    if x is None:
        raise TypeError(f"{op}: {name} is None, not a tensor; {NONE_HINT}")
    raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")


def check_tol(op: str, tol: object) -> float | None:
    if tol is None:
        return None
    if isinstance(tol, bool) or not isinstance(tol, (int, float)):
        raise TypeError(f"{op}: tol must be a number or None, got {type(tol).__name__}")
    tol = float(tol)
    if not tol >= 0.0:
        raise ValueError(f"{op}: tol must be a non-negative number, got {tol}")
    return tol
