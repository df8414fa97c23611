"""A plain-PyTorch float64 reference for every Stats field.

It is slow and obviously correct: each field is its own whole-tensor torch
expression in float64. The test suite compares the native kernels against it,
and users can use it to check zeroscan on their own data.
"""

from __future__ import annotations

import math

import torch


def dtype_tiny_eps(dtype: torch.dtype) -> tuple[float, float]:
    """(smallest normal, eps) of a floating dtype; (0, 0) for integers and bool."""
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        return float(info.tiny), float(info.eps)
    return 0.0, 0.0


def reference_stats(x: torch.Tensor, tol: float | None = None) -> dict[str, float | int]:
    """The Stats fields of `x`, computed in float64 with plain torch ops."""
    tiny, eps = dtype_tiny_eps(x.dtype)
    tol = eps if tol is None else float(tol)
    v = x.detach().reshape(-1).to(torch.float64)
    a = v.abs()
    is_nan = v.isnan()
    finite_values = v[v.isfinite()]
    non_nan = a[~is_nan]
    nonzero = non_nan[non_nan != 0]
    n_finite = finite_values.numel()
    return {
        "numel": v.numel(),
        "zeros": int((v == 0).sum()),
        "subnormal": int(((a > 0) & (a < tiny)).sum()),
        "near_zero": int(((a > 0) & (a <= tol)).sum()),
        "nan": int(is_nan.sum()),
        "posinf": int((v == math.inf).sum()),
        "neginf": int((v == -math.inf).sum()),
        "negative": int((v < 0).sum()),
        "finite": n_finite,
        "min_abs": float(non_nan.min()) if non_nan.numel() else math.nan,
        "min_abs_nonzero": float(nonzero.min()) if nonzero.numel() else math.inf,
        "max_abs": float(non_nan.max()) if non_nan.numel() else math.nan,
        "mean": float(finite_values.mean()) if n_finite else math.nan,
        "std": float(finite_values.std()) if n_finite >= 2 else math.nan,
        "norm": float(finite_values.norm()) if n_finite else 0.0,
        "sum": float(finite_values.sum()),
    }
