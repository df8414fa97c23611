"""The native operators: loading them, their fake kernels, and what they accept.

`torch.ops.zeroscan.stats`, `stats_many`, `stats_many_hist`,
`stats_many_mapped`, `combine_rows` and `mark_nonfinite` (the flags of
Monitor(trace_nonfinite=True)) are declared once in
csrc/zeroscan.cpp and implemented per backend in csrc/cpu and csrc/cuda
(stats_many_mapped on the CPU alone). The fake kernels here give their
output shapes to torch.compile and to meta/fake tensors without running
them.

This is also where zeroscan's input policy (zeroscan.inputs) meets the
native ops: `check_tensor` for the public calls, which refuse anything a
scan does not read with an error naming the argument; `refused`, which
names a native refusal as the caller named the argument; `scannable_form`
for the Monitor, which scans the stored values of a sparse gradient rather
than refuse it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NoReturn

import torch

import zeroscan._C  # noqa: F401  (loading the library registers the ops)
from zeroscan.histogram import field_bins
from zeroscan.inputs import is_dtensor, require_readable, unreadable  # noqa: F401  (also imported from here)
from zeroscan.result_row import NUM_FIELDS

MAX_DIMS = 64  # kMaxDims of csrc/layout.h

# What the native scan reads, in the order of csrc/dtypes.h (ZEROSCAN_DTYPES).
FLOAT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
INT_DTYPES: tuple[torch.dtype, ...] = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
SCANNABLE_DTYPES = frozenset(FLOAT_DTYPES + INT_DTYPES)

# The native ops, under the names the rest of zeroscan calls them by: nothing
# outside this module reaches torch.ops.zeroscan (tests/test_layout.py checks).
# Each is the op's OpOverload itself, so a call costs no Python frame of ours.
stats = torch.ops.zeroscan.stats.default  # (x, tol) -> rows [NUM_FIELDS] int64
stats_many = torch.ops.zeroscan.stats_many.default  # (xs, tol) -> rows [len(xs), NUM_FIELDS]
# (xs, tol) -> rows [len(xs), NUM_FIELDS], fields [len(xs), widest field_bins]
stats_many_hist = torch.ops.zeroscan.stats_many_hist.default
# (xs, tol, histogram) -> rows [len(xs), NUM_FIELDS], faulted [len(xs)] bool, fields [len(xs), bins or 0]
stats_many_mapped = torch.ops.zeroscan.stats_many_mapped.default
combine_rows = torch.ops.zeroscan.combine_rows.default  # rows [ranks, n, NUM_FIELDS] -> [n, NUM_FIELDS]
mark_nonfinite = torch.ops.zeroscan.mark_nonfinite.default  # (xs, flags [F] int32, slots [len(xs)]) -> None; ORs into flags
# The library's direct entry points, which skip the dispatcher where no torch
# function mode or compile can be active (zeroscan.stats says when).
stats_call = zeroscan._C.stats_call  # (x, tol) -> rows [NUM_FIELDS], as stats
stats_many_call = zeroscan._C.stats_many_call  # (xs, tol, histogram) -> rows | (rows, fields) | None
tensor_metas = zeroscan._C.tensor_metas  # (xs) -> (dtypes, packed shapes, any mapped) | None
foreign_storage = zeroscan._C.foreign_storage  # (x) -> whether x's memory is a mapped file's



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


def _fields_fake(xs: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    width = max((field_bins(x.dtype) for x in xs), default=0)
    return rows.new_empty((len(xs), width))


@torch.library.register_fake("zeroscan::stats_many_hist")
def _stats_many_hist_fake(xs: list[torch.Tensor], tol: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _stats_many_fake(xs, tol)
    return rows, _fields_fake(xs, rows)


@torch.library.register_fake("zeroscan::stats_many_mapped")
def _stats_many_mapped_fake(
    xs: list[torch.Tensor], tol: float | None = None, histogram: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = _stats_many_fake(xs, tol)
    fields = _fields_fake(xs, rows) if histogram else rows.new_empty((len(xs), 0))
    return rows, rows.new_empty((len(xs),), dtype=torch.bool), fields


@torch.library.register_fake("zeroscan::combine_rows")
def _combine_rows_fake(rows: torch.Tensor) -> torch.Tensor:
    torch._check(rows.dim() == 3 and rows.shape[-1] == NUM_FIELDS and rows.shape[0] > 0)
    return rows.new_empty((rows.shape[1], NUM_FIELDS))


@torch.library.register_fake("zeroscan::mark_nonfinite")
def _mark_nonfinite_fake(xs: list[torch.Tensor], flags: torch.Tensor, slots: list[int]) -> None:
    # As in stats_many's: a meta tensor among real ones dispatches the call here.
    for k, x in enumerate(xs):
        if x.device != flags.device:
            raise RuntimeError(f"zeroscan.mark_nonfinite: xs[{k}] is on {x.device} but flags is on {flags.device}")
    return None


# Under torch.func.vmap a scan would have to give one Stats per slice, but a
# Stats field is one Python number: vmap cannot batch it. So a batched input
# is refused by name; an input vmap does not batch is scanned as usual.
VMAP_HINT = (
    "a Stats field is a Python number, which torch.func.vmap cannot batch; call zeroscan "
    "outside vmap (zeroscan.stats_many(list(x.unbind(0))) gives one Stats per slice)"
)


@torch.library.register_vmap("zeroscan::stats")
def _stats_vmap(
    info: object, in_dims: tuple[int | None, ...], x: torch.Tensor, tol: float | None = None
) -> tuple[torch.Tensor, int | None]:
    if in_dims[0] is not None:
        raise RuntimeError(f"zeroscan.stats: x is batched by torch.func.vmap; {VMAP_HINT}")
    return torch.ops.zeroscan.stats.default(x, tol), None


def _refuse_batched(op: str, in_dims: tuple[object, ...]) -> None:
    """Refuses a list of tensors of which vmap batches one, named as the
    native ops name it (zeroscan.ops.refused gives the caller's names)."""
    batched = [i for i, d in enumerate(in_dims[0]) if d is not None]  # type: ignore[arg-type]
    if batched:
        raise RuntimeError(f"{op}: xs[{batched[0]}] is batched by torch.func.vmap; {VMAP_HINT}")


@torch.library.register_vmap("zeroscan::stats_many")
def _stats_many_vmap(
    info: object, in_dims: tuple[object, ...], xs: list[torch.Tensor], tol: float | None = None
) -> tuple[torch.Tensor, int | None]:
    _refuse_batched("zeroscan.stats_many", in_dims)
    return torch.ops.zeroscan.stats_many.default(xs, tol), None


@torch.library.register_vmap("zeroscan::stats_many_hist")
def _stats_many_hist_vmap(
    info: object, in_dims: tuple[object, ...], xs: list[torch.Tensor], tol: float | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int | None, int | None]]:
    _refuse_batched("zeroscan.stats_many_hist", in_dims)
    return torch.ops.zeroscan.stats_many_hist.default(xs, tol), (None, None)


def check_tensor(
    op: str, what: str, x: object, index: int | None = None, *, collective: bool = False
) -> torch.Tensor:
    """Returns x if zeroscan can scan it, else raises an error naming `what`
    (`what[index]` for an element of a list); `collective`: a DTensor is
    accepted (see unreadable). Dtype and rank are checked by the native op
    itself, with messages of the same form."""
    if type(x) is torch.Tensor and x.layout == torch.strided and not x.is_meta:
        # The common case, decided without the checks below. Quantized and
        # nested tensors pass it too: the dispatcher, which has no kernel for
        # them, refuses them, and refused() then names them.
        return x
    return require_readable(op, what if index is None else f"{what}[{index}]", x, collective=collective)


# How the native checks (csrc/op_common.h) begin a refusal: the native op,
# then its argument ("x", "xs[3]" or "rows").
NATIVE_REFUSAL = re.compile(r"zeroscan\.\w+: (?:x|rows|xs\[(\d+)\]) ")


def refused(op: str, named: Sequence[tuple[str, object]], error: Exception) -> NoReturn:
    """Raises why the native op refused one of the (name, tensor) pairs, in
    the words of the call the caller made: the first tensor that cannot be
    read is named by `op` and its name; a native check's refusal (a dtype,
    too many dimensions) is `error` with the native op and argument replaced
    by `op` and the name of that tensor, `named` listing the native op's
    arguments in order; any other error is `error` itself."""
    for name, x in named:
        try:
            require_readable(op, name, x)
        except (TypeError, ValueError) as why:
            raise why from None  # the native error it explains is not shown beside it
    # A native refusal is one line; torch appends the C++ stack below it when
    # TORCH_SHOW_CPP_STACKTRACES=1, which the caller's one-line error leaves out.
    message = str(error).split("\n", 1)[0]
    found = NATIVE_REFUSAL.match(message)
    if found is None or not isinstance(error, RuntimeError):
        raise error
    index = int(found.group(1) or 0)
    name = named[index][0] if index < len(named) else f"tensors[{index}]"
    raise RuntimeError(f"{op}: {name} {message[found.end():]}") from None


def scannable_form(x: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """What the Monitor scans of x: x itself, or the form that the error of
    check_tensor asks for where it keeps every stored value (a sparse
    tensor's values, a complex tensor's real view, a flat view of a tensor of
    more than MAX_DIMS dimensions); else None and why not (a phrase that
    follows the tensor's name), also for a dtype the native scan does not
    read (uint16/32/64, the float8 fnuz variants, quantized dtypes): a
    caller skips that tensor alone instead of failing a whole stats_many."""
    if x.layout == torch.sparse_coo and not x.is_meta:
        x = x._values()  # no coalescing: a gradient's stored entries as they are
    elif x.layout != torch.strided and not x.is_meta:
        try:
            x = x.values()
        except RuntimeError:
            pass
    why = unreadable(x)
    if why is not None:
        return None, why
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype not in SCANNABLE_DTYPES:
        return None, f"has dtype {str(x.dtype).removeprefix('torch.')}, which zeroscan does not scan"
    if x.dim() > MAX_DIMS:
        x = x.reshape(-1)
    return x, ""


def check_tol(op: str, tol: object) -> float | None:
    """`tol` as a float, or None for each dtype's default: a non-negative
    number (inf calls every nonzero value near zero); -0.0 is returned as
    +0.0, the same threshold."""
    if tol is None:
        return None
    if isinstance(tol, bool) or not isinstance(tol, (int, float)):
        raise TypeError(f"{op}: tol must be a number or None, got {type(tol).__name__}")
    try:
        value = float(tol)
    except OverflowError:  # an int beyond the float range, such as 10**400
        raise ValueError(
            f"{op}: tol must be a non-negative number within the float range, got an integer of {tol.bit_length()} bits"
        ) from None
    if not value >= 0.0:
        raise ValueError(f"{op}: tol must be a non-negative number, got {value}")
    return value + 0.0  # -0.0 + 0.0 is +0.0
