"""Comparing two checkpoints tensor by tensor, bit for bit: which tensors
changed (how many elements, by how much), which stayed bit-identical, and
which were added, removed, reshaped or retyped. A floating-point tensor left
bit-identical while others changed is "unchanged" (info): a frozen backbone or
a fine-tune that touched only a head does that on purpose. Only when the second
file was trained from the first (trained_from_first=True) is it a warning: the
optimizer never updated it.
"""

from __future__ import annotations

import os

import torch

from zeroscan.checkpoint import ProgressFn, open_checkpoint
from zeroscan.words import count_noun

# Integer views of each element width, so bits are compared, not values (NaN == NaN,
# -0.0 != 0.0); a 16-byte element (complex128) is compared as two int64 words.
INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


def diff_checkpoints(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    trained_from_first: bool = False,
    progress: ProgressFn | None = None,
    chunk_elements: int = 1 << 22,
) -> list[dict[str, object]]:
    """Compares two checkpoints tensor by tensor, bit for bit.

    One row per name in either file (a's order, then names only in b), with
    status "changed", "identical", "added" (only in b), "removed" (only in a),
    "reshaped" or "retyped"; for changed tensors the number and fraction of
    elements whose bits differ and the largest |a - b| over values where
    neither is NaN. A floating-point tensor left bit-identical while others
    changed is "unchanged" (info), or with `trained_from_first` (b is a's
    model after more training) a warning: the optimizer never updated it.
    """
    if not isinstance(trained_from_first, bool):
        raise TypeError(
            f"zeroscan.diff_checkpoints: trained_from_first must be a bool, got {type(trained_from_first).__name__}"
        )
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        rows: list[dict[str, object]] = []
        total = sum(e.nbytes for e in ca.entries if e.name in cb)
        done = 0
        for ea in ca.entries:
            row: dict[str, object] = {"name": ea.name, "dtype": ea.dtype, "shape": list(ea.shape), "numel": ea.numel}
            if ea.name not in cb:
                row.update(status="removed", severity="info", reason=f"only in {a}")
                rows.append(row)
                continue
            eb = cb.entry(ea.name)
            if eb.dtype != ea.dtype:
                row.update(status="retyped", severity="info", reason=f"dtype {ea.dtype} -> {eb.dtype}")
            elif eb.shape != ea.shape:
                row.update(status="reshaped", severity="info", reason=f"shape {list(ea.shape)} -> {list(eb.shape)}")
            elif not isinstance(getattr(torch, ea.dtype, None), torch.dtype):
                row.update(status="unread", severity="info", reason=f"dtype {ea.dtype} cannot be read")
            else:
                changed, max_diff = compare_tensors(ca.tensor(ea.name), cb.tensor(ea.name), chunk_elements)
                row.update(
                    status="changed" if changed else "identical",
                    changed=changed,
                    changed_fraction=changed / ea.numel if ea.numel else 0.0,
                    max_abs_diff=max_diff,
                    severity="ok",
                    reason="",
                )
            rows.append(row)
            done += ea.nbytes
            if progress is not None:
                progress(done, total)
        for eb in cb.entries:
            if eb.name not in ca:
                rows.append({"name": eb.name, "dtype": eb.dtype, "shape": list(eb.shape), "numel": eb.numel,
                             "status": "added", "severity": "info", "reason": f"only in {b}"})
    n_changed = sum(1 for r in rows if r["status"] == "changed")
    if n_changed:
        for r in rows:
            dtype = getattr(torch, str(r["dtype"]), None)
            floating = isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)
            if r["status"] == "identical" and floating and r["numel"]:
                others = f"{count_noun(n_changed, 'other tensor')} changed"
                if trained_from_first:
                    r["severity"], r["reason"] = "warning", f"bit-identical while {others}: never updated"
                else:
                    r["severity"], r["reason"] = "info", f"unchanged while {others}"
    return rows


def compare_tensors(x: torch.Tensor, y: torch.Tensor, chunk: int) -> tuple[int, float | None]:
    """(elements whose bits differ, max |x - y| over non-NaN pairs or None)."""
    if x.numel() == 0:
        return 0, None
    xf, yf = x.reshape(-1), y.reshape(-1)
    width = x.element_size()
    ints = INT_VIEWS[width]
    per = 2 if width == 16 else 1
    numeric = not (x.dtype.is_complex or x.dtype == torch.bool)
    changed = 0
    max_diff: float | None = None
    for start in range(0, xf.numel(), chunk):
        xs, ys = xf[start : start + chunk], yf[start : start + chunk]
        bits = xs.view(ints).reshape(-1, per) != ys.view(ints).reshape(-1, per)
        differ = bits.any(dim=1)
        n = int(differ.sum())
        if n == 0:
            continue
        changed += n
        if numeric:
            xd, yd = xs[differ].double(), ys[differ].double()
            d = (xd - yd).abs()
            d = d[~d.isnan()]
            if d.numel():
                m = float(d.max())
                max_diff = m if max_diff is None else max(max_diff, m)
    return changed, max_diff
