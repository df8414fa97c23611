"""Scanning memory that torch did not allocate, under the SIGBUS guard.

A CPU tensor may view memory torch did not allocate: a file's mapping
(torch.load(mmap=True), safetensors, zeroscan.checkpoint's tensor(),
torch.from_file, a numpy.memmap), a numpy array, a DLPack capsule, a Python
buffer. Where it maps a file that another process then truncates (a
training job saving the checkpoint again), reading a page past the file's
new end raises SIGBUS, which kills the process.

So the public scans read such a tensor inside the native stats_many_mapped,
which turns a SIGBUS into a flag (csrc/cpu/fault_guard.h), and the flag into
a one-line error naming the call and the tensor. The rows are those of the
unguarded scan, bit for bit. torch's own allocations have resizable storages;
any other storage is taken for a possible mapping: telling a file's mapping
from other foreign memory would cost a read of /proc/self/maps per call, a
hundred times the scan of a small tensor, and the guard costs nearly nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroscan import ops
from zeroscan.ops import refused

TRUNCATED = (
    "could not be read: its memory maps a file that no longer holds it (the file was truncated or "
    "rewritten since it was mapped); map or load the file again"
)


def maybe_mapped(x: torch.Tensor) -> bool:
    """Whether x is a CPU tensor whose memory torch did not allocate (a
    storage that cannot be resized), which may map a file. False while
    torch.compile traces (dynamo cannot read a storage) and for a tensor
    with no storage of its own (a torch.func wrapper)."""
    if torch.compiler.is_compiling():
        return False
    # Natively: asking Python for x.untyped_storage() makes a storage object,
    # a tenth of a small tensor's stats() call. A tensor with no storage to
    # ask (a lazy parameter, a torch.func wrapper) is left to the scan's own
    # checks, which name it.
    return bool(ops.foreign_storage(x))


def any_maybe_mapped(xs: Sequence[object]) -> bool:
    """Whether any of xs, on the CPU, is maybe_mapped; other items (None, a
    tensor on another device) are left to the scan's own checks."""
    if torch.compiler.is_compiling():
        return False
    foreign = ops.foreign_storage
    return any(foreign(x) for x in xs)


def guarded_rows(
    op: str, named: Sequence[tuple[str, torch.Tensor]], tol: float | None, histogram: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stats_many rows (int64 [N, 16]) of the CPU tensors of `named`
    ((name, tensor) pairs, as the public call `op` names them) and, with
    `histogram`, their histogram fields; read under the SIGBUS guard. A
    tensor that a SIGBUS hit is named in a RuntimeError; what the native
    checks refuse is named as stats_many names it."""
    xs = [x for _, x in named]
    try:
        rows, faulted, fields = ops.stats_many_mapped(xs, tol, histogram)
    except RuntimeError as e:
        refused(op, named, e)
    if bool(faulted.any()):  # on the CPU: no device to wait for (and a torch.func wrapper reads too)
        hit = faulted.nonzero().flatten().tolist()
        more = f" (and {len(hit) - 1} more of the {len(xs)})" if len(hit) > 1 else ""
        raise RuntimeError(f"{op}: {named[hit[0]][0]}{more} {TRUNCATED}")
    return rows, fields if histogram else None
