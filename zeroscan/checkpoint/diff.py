"""Comparing two checkpoints tensor by tensor, bit for bit: which tensors
changed (how many elements, by how much), which stayed bit-identical, and
which were added, removed, reshaped or retyped. A floating-point tensor left
bit-identical while others changed is "unchanged" (info): a frozen backbone or
a fine-tune that touched only a head does that on purpose. Only when the second
file was trained from the first (trained_from_first=True) is it a warning: the
optimizer never updated it.

Tensors are compared as stored, never materialised: an expanded view (stride
0) is compared once per stored value and counted as often as it repeats; a
view compares only what it views, not the whole storage torch.save kept; a
quantized tensor compares its stored integers and its quantization
parameters. What cannot be compared is "unread", with the reason.

A floating-point tensor that changed is also checked for what training can
break: elements that became NaN or infinite where the first file's were
finite (an error, counted exactly), or a tensor that became all zero (a
warning). Both are counted in the same pass that compares the bits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from zeroscan.checkpoint.opening import open_checkpoint
from zeroscan.checkpoint.table import ProgressFn, checked_path
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

    Every row also has "became": "nan" when elements finite in a are NaN or
    infinite in b (severity error, the reason counting them), "zero" when b
    is all zero and a was not (a warning), "" otherwise; and "shard", the
    file of a many-file checkpoint holding the tensor (a's; b's for an added
    tensor), "" for a one-file checkpoint.
    """
    op = "zeroscan.checkpoint.diff_checkpoints"
    checked_path(op, "a", a)
    checked_path(op, "b", b)
    if not isinstance(trained_from_first, bool):
        raise TypeError(f"{op}: trained_from_first must be a bool, got {type(trained_from_first).__name__}")
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        rows: list[dict[str, object]] = []
        total = sum(e.nbytes for e in ca.entries if e.name in cb)
        done = 0
        for ea in ca.entries:
            row: dict[str, object] = {"name": ea.name, "dtype": ea.dtype, "shape": list(ea.shape), "numel": ea.numel,
                                      "shard": ea.shard, "became": ""}
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
                try:
                    # read(), not tensor(): a file truncated while it is compared is then an
                    # error naming it, where reading through its mapping would be a SIGBUS.
                    c = compare_tensors(ca.read(ea.name), cb.read(ea.name), chunk_elements)
                except NotCompared as e:
                    row.update(status="unread", severity="info", reason=str(e))
                else:
                    row.update(
                        status="changed" if c.changed or c.note else "identical",
                        changed=c.changed,
                        changed_fraction=c.changed / ea.numel if ea.numel else 0.0,
                        max_abs_diff=c.max_abs_diff,
                        severity="ok",
                        reason=c.note,
                    )
                    row.update(became_fields(c, c.note))
            rows.append(row)
            done += ea.nbytes
            if progress is not None:
                progress(done, total)
        for eb in cb.entries:
            if eb.name not in ca:
                rows.append({"name": eb.name, "dtype": eb.dtype, "shape": list(eb.shape), "numel": eb.numel,
                             "shard": eb.shard, "became": "", "status": "added", "severity": "info",
                             "reason": f"only in {b}"})
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


def became_fields(c: Comparison, note: str) -> dict[str, object]:
    """What a changed tensor became, as a diff row's became, severity and reason."""
    also = f"; {note}" if note else ""
    if c.became_nonfinite:
        return {"became": "nan", "severity": "error",
                "reason": f"became NaN/Inf at {count_noun(c.became_nonfinite, 'element')}{also}"}
    if c.became_zero:
        return {"became": "zero", "severity": "warning", "reason": f"became all zero{also}"}
    return {}


# --- comparing two tensors ---------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """How two tensors of the same dtype and shape differ."""

    changed: int  # elements whose value-defining bits differ
    max_abs_diff: float | None  # over changed elements where neither is NaN; None when there are none
    note: str = ""  # what changed besides the elements (a quantization parameter)
    became_nonfinite: int = 0  # floating elements NaN or infinite in y where x's was finite
    became_zero: bool = False  # a floating y all zero where x was not


class NotCompared(Exception):
    """A pair of tensors this diff does not compare; str() is the one-line reason."""


def compare_tensors(x: torch.Tensor, y: torch.Tensor, chunk: int = 1 << 22) -> Comparison:
    """Compares x and y (same dtype and shape) bit for bit, a chunk of at most
    `chunk` elements at a time. Expanded (stride-0) and overlapping views are
    never materialised: what both repeat is compared once and counted as often
    as it repeats. Raises NotCompared for what cannot be compared (a sparse or
    meta tensor, a packed 4-bit quantized one, views expanded so differently
    that comparing would cost far more than the files hold)."""
    for t in (x, y):
        if t.layout != torch.strided:
            raise NotCompared(f"a {str(t.layout).removeprefix('torch.')} tensor: only dense tensors are compared")
        if t.device.type == "meta":
            raise NotCompared("a meta tensor: the file holds no data for it")
    try:
        if x.is_quantized or y.is_quantized:
            return compare_quantized(x, y, chunk)
        return compare_plain(x, y, chunk)
    except RuntimeError as e:  # a dtype or layout torch cannot view as integers
        lines = str(e).strip().splitlines()
        raise NotCompared(f"cannot be compared ({lines[0] if lines else type(e).__name__})") from None


def compare_plain(x: torch.Tensor, y: torch.Tensor, chunk: int) -> Comparison:
    """The elements whose bits differ, the max |x - y| over those where neither
    is NaN (None when there are none) and, for a floating dtype, the elements
    that became NaN/Inf and whether y became all zero."""
    width = x.element_size()
    ints = INT_VIEWS[width]
    per = 2 if width == 16 else 1
    numeric = not (x.dtype.is_complex or x.dtype == torch.bool)
    watched = watches_values(x.dtype)
    changed = 0
    max_diff: float | None = None
    became_nonfinite = 0
    # Whether every block so far is all zero in y, and in x. Once y's is not,
    # neither is read again: a trained tensor costs one pass over its first block.
    y_zero = x_zero = watched
    for xs, ys, repeat in block_pairs(x, y, chunk):
        bits = xs.view(ints).reshape(-1, per) != ys.view(ints).reshape(-1, per)
        differ = bits.any(dim=1)
        n = int(differ.sum())
        if y_zero:
            y_zero = bool((float_values(ys) == 0).all())
            # a block with no differing bits is all zero in x exactly when it is in y
            x_zero = x_zero and (y_zero if n == 0 else bool((float_values(xs) == 0).all()))
        if n == 0:
            continue
        changed += n * repeat
        if numeric:
            max_diff = larger(max_diff, (xs[differ].double() - ys[differ].double()).abs())
        if watched:
            # Only differing elements can have gone from finite to NaN/Inf.
            was, now = float_values(xs[differ]), float_values(ys[differ])
            became_nonfinite += int((was.isfinite() & ~now.isfinite()).sum()) * repeat
    return Comparison(changed, max_diff, became_nonfinite=became_nonfinite, became_zero=y_zero and not x_zero)


# Floating dtypes whose values cannot be read one by one (two 4-bit values per byte).
PACKED_FLOATS = frozenset(d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)


def watches_values(dtype: torch.dtype) -> bool:
    """Whether a diff checks this dtype's values for NaN/Inf and all zero."""
    return dtype.is_floating_point and dtype not in PACKED_FLOATS


def float_values(t: torch.Tensor) -> torch.Tensor:
    """t's values in a dtype that isfinite() and == 0 read right: the 8-bit
    floats as float32 (torch has no isfinite for some, and float8_e8m0fnu's
    == 0 holds for its smallest power of two), the others as they are."""
    return t.float() if t.element_size() == 1 else t


def larger(best: float | None, diffs: torch.Tensor) -> float | None:
    """The larger of `best` and the largest non-NaN value of `diffs`."""
    diffs = diffs[~diffs.isnan()]
    if not diffs.numel():
        return best
    m = float(diffs.max())
    return m if best is None else max(best, m)


def block_pairs(x: torch.Tensor, y: torch.Tensor, chunk: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """(flat block of x, the same block of y, how many elements each stands for),
    blocks of at most `chunk` elements covering the distinct element pairs.

    A dimension both tensors repeat (stride 0, as expand() makes) is read at one
    index and counted as often as it repeats. What is left is walked block by
    block, so no expanded view is ever copied whole; its size is bounded by the
    stored elements (the denser side's file holds them) unless the two repeat
    along different dimensions, which is refused rather than run for hours.
    """
    if x.numel() == 0:
        return
    repeat = 1
    for dim in range(x.dim()):
        if x.size(dim) > 1 and x.stride(dim) == 0 and y.stride(dim) == 0:
            repeat *= x.size(dim)
            x, y = x.narrow(dim, 0, 1), y.narrow(dim, 0, 1)
    stored = stored_elements(x) + stored_elements(y)
    if x.numel() > max(stored, 16 * chunk):
        raise NotCompared(
            f"the two files repeat its values along different dimensions: {x.numel()} element pairs "
            f"from {stored} stored elements are not compared one by one"
        )
    for xs, ys in blocks(x, y, chunk):
        yield xs, ys, repeat


def stored_elements(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // max(t.element_size(), 1)


def blocks(x: torch.Tensor, y: torch.Tensor, chunk: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """x and y in flat contiguous blocks of at most `chunk` elements, in
    row-major order, slicing the leading dimension (recursing when one index
    of it is already larger than a block)."""
    if x.numel() <= chunk or x.dim() == 0:
        yield x.reshape(-1).contiguous(), y.reshape(-1).contiguous()
        return
    inner = math.prod(x.shape[1:])
    step = chunk // inner
    if step >= 1:
        for start in range(0, x.size(0), step):
            yield x[start : start + step].reshape(-1).contiguous(), y[start : start + step].reshape(-1).contiguous()
    else:
        for i in range(x.size(0)):
            yield from blocks(x[i], y[i], chunk)


# --- quantized tensors: their stored integers plus the quantization parameters ---------

# The integer each quantized element is stored as; quint4x2 and quint2x4 pack
# several elements per byte and are not compared.
QUANTIZED_INTS = {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}


def compare_quantized(x: torch.Tensor, y: torch.Tensor, chunk: int) -> Comparison:
    """An element changed when its stored integer or its scale or zero point
    did; the largest difference is between dequantized values."""
    if x.dtype not in QUANTIZED_INTS:
        raise NotCompared(f"{str(x.dtype).removeprefix('torch.')} packs several values per byte: not compared")
    xi, yi = stored_ints(x), stored_ints(y)
    scheme_a, scheme_b = x.qscheme(), y.qscheme()
    if scheme_a != scheme_b:
        name = lambda s: str(s).removeprefix("torch.")  # noqa: E731
        return Comparison(x.numel(), None, f"qscheme {name(scheme_a)} -> {name(scheme_b)}")
    if scheme_a in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        qa, qb = (x.q_scale(), x.q_zero_point()), (y.q_scale(), y.q_zero_point())
        changed, max_diff = compare_affine(xi, yi, qa, qb, chunk)
        notes = [f"{what} {fmt_param(a)} -> {fmt_param(b)}" for what, a, b in zip(("scale", "zero point"), qa, qb)
                 if a != b]
        return Comparison(changed, max_diff, ", ".join(notes))
    axis_a, axis_b = x.q_per_channel_axis(), y.q_per_channel_axis()
    if axis_a != axis_b:
        return Comparison(x.numel(), None, f"quantization axis {axis_a} -> {axis_b}")
    scales = x.q_per_channel_scales().tolist(), y.q_per_channel_scales().tolist()
    zeros = x.q_per_channel_zero_points().tolist(), y.q_per_channel_zero_points().tolist()
    changed, max_diff, moved = 0, None, 0
    for c, (sa, sb, za, zb) in enumerate(zip(*scales, *zeros)):
        moved += (sa, za) != (sb, zb)
        n, m = compare_affine(xi.select(axis_a, c), yi.select(axis_a, c), (sa, za), (sb, zb), chunk)
        changed += n
        max_diff = max((v for v in (max_diff, m) if v is not None), default=None)
    note = f"scale or zero point changed on {moved} of {len(scales[0])} channels" if moved else ""
    return Comparison(changed, max_diff, note)


def stored_ints(q: torch.Tensor) -> torch.Tensor:
    """The quantized tensor's stored integers as a plain integer view of the
    same storage and strides (int_repr() would copy, an expanded view whole)."""
    ints = torch.empty(0, dtype=QUANTIZED_INTS[q.dtype])
    return ints.set_(q.untyped_storage(), q.storage_offset(), q.size(), q.stride())


def compare_affine(
    xi: torch.Tensor, yi: torch.Tensor, qa: tuple[float, int], qb: tuple[float, int], chunk: int
) -> tuple[int, float | None]:
    """(changed elements, max |dequantized difference|) of stored integers xi, yi
    under (scale, zero point) qa and qb; with different parameters every element changed."""
    if qa == qb:
        ints = compare_plain(xi, yi, chunk)
        max_int = ints.max_abs_diff
        return ints.changed, None if max_int is None else max_int * qa[0]
    max_diff: float | None = None
    for xs, ys, _ in block_pairs(xi, yi, chunk):
        dequantized = ((xs.double() - qa[1]) * qa[0] - (ys.double() - qb[1]) * qb[0]).abs()
        max_diff = larger(max_diff, dequantized)
    return xi.numel(), max_diff


def fmt_param(v: float | int) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)
