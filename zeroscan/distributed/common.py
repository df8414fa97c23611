"""What every collective call of zeroscan.distributed shares.

The check that torch.distributed is up and this rank is in the group, the
check of the result rows a call is given, the device on which a group's
backend exchanges tensors (gloo: CPU, NCCL: the current CUDA device), this
rank's result rows on that device (from its Stats, or scanned), and a
collective in flight (PendingMerge).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from zeroscan.inputs import received
from zeroscan.ops import check_tensor
from zeroscan.result_row import NUM_FIELDS
from zeroscan.stats import Stats, buffers_of, device_groups

T = TypeVar("T")
U = TypeVar("U")


class PendingMerge(Generic[T]):
    """A collective in flight. `wait()` waits for it, finishes the merge and
    returns the result (the same object on every later call)."""

    def __init__(self, work: dist.Work | None, finish: Callable[[], T]) -> None:
        self._work = work
        self._finish: Callable[[], T] | None = finish
        self._result: T | None = None

    def is_completed(self) -> bool:
        """True once the collective has finished (wait() then does not block on it)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> T:
        if self._finish is not None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._finish = None
        return self._result  # type: ignore[return-value]

    def then(self, fn: Callable[[T], U]) -> PendingMerge[U]:
        """A PendingMerge for fn(this result), waiting on the same collective."""
        return PendingMerge(self._work, lambda: fn(self.wait()))


def member_group(op: str, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """`group` (None: the world), once torch.distributed is up and this rank
    is a member; the errors name the public call `op`."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{op}: torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "first, or leave group=None for single-process statistics"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    pg = group if group is not None else dist.group.WORLD
    if dist.get_rank(pg) < 0:
        raise ValueError(f"{op}: this rank (global rank {dist.get_rank()}) is not a member of group")
    return pg  # type: ignore[return-value]


def group_for(op: str, group: dist.ProcessGroup | None, refusal: Exception | None) -> dist.ProcessGroup:
    """member_group(op, group), where this rank shares `refusal` (its own
    error about its arguments) with the others; where it has no group to
    share it over, the refusal is raised here instead."""
    try:
        return member_group(op, group)
    except (RuntimeError, ValueError):
        if refusal is not None:
            raise refusal from None
        raise


def check_rows(op: str, name: str, rows: object, shape: str, dims: tuple[int, ...]) -> torch.Tensor:
    """`rows` as result rows: a dense int64 tensor of one of `dims`
    dimensions, the last of 16 (`shape` says so in words, "[N, 16]"), with
    data to read; else the one-line error naming the public call `op` and
    the argument `name`."""
    wanted = f"{op}: {name} must be an int64 {shape} tensor of result rows"
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{wanted}, got {received(rows)}")
    if rows.is_nested or rows.layout != torch.strided:
        raise ValueError(f"{wanted}, got {received(rows)}")
    x = check_tensor(op, name, rows)  # a meta or lazy tensor, freed memory: in the words of every scan
    if x.dtype != torch.int64 or x.dim() not in dims or x.shape[-1] != NUM_FIELDS:
        raise ValueError(f"{wanted}, got {received(x)}")
    return x


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """The device on which `group`'s backend exchanges tensors, preferring `device`
    (gloo: CPU, NCCL: the current CUDA device)."""
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):
        return device
    backends = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    if not backends:
        return device
    if device.type == "cpu" and "cpu" in backends:
        return device
    if device.type != "cpu" and backends.get(device.type, "gloo") != "gloo":
        return device
    if "cpu" in backends:
        return torch.device("cpu")
    if "cuda" in backends and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def rows_of(items: Sequence[Stats], device: torch.device) -> torch.Tensor:
    """int64 [N, 16] on `device`: the result rows of `items`, in order."""
    if not items:
        return torch.empty((0, NUM_FIELDS), dtype=torch.int64, device=device)
    return torch.stack([s.buffer.to(device) for s in items])


def scan_rows(
    op: str, tensors: list[torch.Tensor], tol: float | None, device: torch.device, names: Callable[[int], str]
) -> torch.Tensor:
    """int64 [N, 16] on `device`: one row per tensor, in order, from one native
    call per device (no copy when all are on `device`); a refusal names
    `op` and the tensor as names(i)."""
    buffers = buffers_of(op, tensors, tol, names)
    groups = device_groups(tensors)
    if len(groups) == 1 and buffers[0].device == device:
        return buffers[0]
    rows = torch.empty((len(tensors), NUM_FIELDS), dtype=torch.int64, device=device)
    for indices, buffer in zip(groups, buffers):
        rows[indices] = buffer.to(device)
    return rows
