"""Reading checkpoints tensor by tensor, without loading them whole.

Two formats are read:

* torch.save files, loaded with ``weights_only=True`` (no pickled code is
  ever run) and memory-mapped (``torch.load(mmap=True)``) when the file uses
  the zip format; nested dicts, lists and tuples of tensors are flattened to
  dotted names (``model.layer.0.weight``, ``optimizer.state.3.exp_avg``);
  leaves that are not tensors (an epoch number, a config string) are left out.
* .safetensors files, read by zeroscan.safetensors_io without the
  safetensors package: each tensor is memory-mapped on its own when asked
  for, so a file larger than memory is never read whole.

Every problem with the file itself raises CheckpointError with a one-line
message naming the file. scan_checkpoint diagnoses every tensor of a
checkpoint; zeroscan.checkpoint_diff compares two.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroscan.ops import SCANNABLE_DTYPES
from zeroscan.safetensors_io import (
    SafetensorsError,
    looks_like_safetensors,
    map_safetensors_slot,
    read_safetensors_header,
)

# Complex tensors are scanned as their real and imaginary parts (torch.view_as_real).
COMPLEX_DTYPES = frozenset({torch.complex64, torch.complex128})


class CheckpointError(Exception):
    """A file that cannot be read as a checkpoint; str() is one line."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, described without reading its data."""

    name: str
    dtype: str  # torch's name ("float32"), or the file's own for a dtype torch lacks
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def scannable(dtype: torch.dtype) -> bool:
    """True when zeroscan can scan a tensor of this dtype (complex via its parts)."""
    return dtype in SCANNABLE_DTYPES or dtype in COMPLEX_DTYPES


class Checkpoint:
    """An opened checkpoint: its tensor entries in file order, and each
    tensor on demand. Use as a context manager, or call close()."""

    def __init__(
        self,
        path: Path,
        format: str,
        entries: list[TensorEntry],
        get: Callable[[str], torch.Tensor],
        close: Callable[[], None] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.format = format  # "torch", "torch-legacy" or "safetensors"
        self.entries = entries
        self._by_name = {e.name: e for e in entries}
        self._get = get
        self._close = close
        self.metadata = metadata or {}  # a safetensors file's __metadata__

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`, memory-mapped where the format allows."""
        self.entry(name)
        return self._get(name)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in file order, each mapped only when reached."""
        for e in self.entries:
            yield e.name, self._get(e.name)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, format={self.format!r}, {len(self)} tensors)"


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Opens a torch.save file or a .safetensors file (recognised by content,
    not by name). Raises CheckpointError with a one-line reason."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file")
    if p.is_dir():
        raise CheckpointError(f"{p}: is a directory, not a checkpoint file")
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
    if size == 0:
        raise CheckpointError(f"{p}: empty file, not a checkpoint")
    if looks_like_safetensors(head, size) or p.suffix == ".safetensors":
        return open_safetensors(p)
    return open_torch(p)


def load_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint by flattened name (memory-mapped where possible)."""
    with open_checkpoint(path) as ckpt:
        return dict(ckpt.tensors())


# --- torch.save files -------------------------------------------------------


def flatten(obj: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield (prefix or "tensor"), obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from flatten(value, f"{prefix}.{i}" if prefix else str(i))


def open_torch(p: Path) -> Checkpoint:
    zipped = zipfile.is_zipfile(p)
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(e))
        if found:
            raise CheckpointError(
                f"{p}: the pickle holds a {found.group(1)} object, not only tensors and plain containers; "
                "zeroscan loads with weights_only=True and never runs pickled code "
                "(save the state_dict alone to scan it)"
            ) from None
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
        why = detail.group(1).strip() if detail else one_line(e)
        raise CheckpointError(f"{p}: not a PyTorch checkpoint or a safetensors file ({why})") from None
    except Exception as e:  # torch.load raises many types for a file that is not its own
        raise CheckpointError(f"{p}: not a PyTorch checkpoint or a safetensors file ({one_line(e)})") from None
    tensors: dict[str, torch.Tensor] = {}
    for name, t in flatten(obj):
        unique, n = name, 1
        while unique in tensors:  # a key "a.b" beside a nested {"a": {"b": ...}}
            n += 1
            unique = f"{name}#{n}"
        tensors[unique] = t
    entries = [
        TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
        for name, t in tensors.items()
    ]
    return Checkpoint(p, "torch" if zipped else "torch-legacy", entries, tensors.__getitem__, tensors.clear)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    msg = text[0] if text else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


# --- safetensors files -------------------------------------------------------


def open_safetensors(p: Path) -> Checkpoint:
    """A .safetensors file as a Checkpoint. The format's own errors become
    CheckpointError, the one error every caller of open_checkpoint handles."""
    try:
        slots, metadata = read_safetensors_header(p)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    entries = []
    for name, slot in slots.items():
        label = dtype_name(slot.dtype) if slot.dtype is not None else slot.file_dtype
        entries.append(TensorEntry(name, label, slot.shape, slot.nbytes))

    def get(name: str) -> torch.Tensor:
        try:
            return map_safetensors_slot(p, name, slots[name])
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None

    return Checkpoint(p, "safetensors", entries, get, metadata=metadata)


# --- scanning ---------------------------------------------------------------

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclass
class CheckpointScan:
    """The scan of one checkpoint: a row per tensor in file order, and the
    tensors left out (a dtype zeroscan cannot scan) with the reason."""

    path: str
    format: str
    nbytes: int  # all tensor bytes in the file, skipped ones included
    rows: list[dict[str, object]]
    skipped: list[dict[str, object]]

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "format": self.format, "tensors": self.rows, "skipped": self.skipped}


def scan_checkpoint(
    path: str | os.PathLike[str],
    *,
    tol: float | None = None,
    mostly_zero: float = 0.9,
    progress: ProgressFn | None = None,
    batch_bytes: int = 64 << 20,
) -> CheckpointScan:
    """Scans every tensor of a checkpoint and diagnoses each (zeroscan.diagnose_stats)
    in its role (zeroscan.roles): a zero bias or BatchNorm running mean is OK,
    an all-zero weight matrix a warning, a NaN an error in any role; other
    findings on integer and bool tensors are at most "info".

    Tensors are scanned a batch at a time (up to `batch_bytes`, one native
    stats_many call per batch) straight from the memory-mapped file, so the
    pages a scan touches are file pages the kernel can drop again, never a
    copy of the checkpoint. `progress(done, total)` is called in bytes after
    each batch.
    """
    from zeroscan.diagnosis import Severity, diagnose_stats
    from zeroscan.roles import judge_in_role, tensor_role
    from zeroscan.stats import stats_many

    with open_checkpoint(path) as ckpt:
        total = ckpt.nbytes
        rows: list[dict[str, object]] = []
        skipped: list[dict[str, object]] = []
        batch: list[tuple[TensorEntry, torch.Tensor]] = []
        done = 0

        def flush() -> None:
            nonlocal done
            if not batch:
                return
            results = stats_many([t for _, t in batch], tol=tol)
            for (entry, t), s in zip(batch, results):
                d = diagnose_stats(s, mostly_zero=mostly_zero)
                role = tensor_role(entry.name, entry.shape)
                severity, reason = judge_in_role(role, d.verdict.cause, d.severity, d.reason)
                if not t.is_floating_point() and severity > Severity.INFO:
                    # indices and masks (token_type_ids, attention_mask): all zero is normal
                    reason = f"{reason} (an integer tensor: a counter, index or mask, so only info)"
                    severity = Severity.INFO
                rows.append(scan_row(entry, s.to_dict(), d.verdict.value, role.value, severity.name.lower(), reason))
                done += entry.nbytes
            batch.clear()
            if progress is not None:
                progress(done, total)

        size = 0
        for entry in ckpt.entries:
            reason = unscannable_reason(entry)
            if reason is not None:
                skipped.append({"name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape), "reason": reason})
                done += entry.nbytes
                continue
            t = ckpt.tensor(entry.name)
            if t.dtype in COMPLEX_DTYPES:
                t = torch.view_as_real(t)
            if t.device.type == "meta":
                skipped.append({"name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape),
                                "reason": "a meta tensor: the checkpoint holds no data for it"})
                continue
            batch.append((entry, t))
            size += entry.nbytes
            if size >= batch_bytes or len(batch) >= 1024:
                flush()
                size = 0
        flush()
        if progress is not None:
            progress(total, total)
        return CheckpointScan(str(path), ckpt.format, total, rows, skipped)


def unscannable_reason(entry: TensorEntry) -> str | None:
    dtype = getattr(torch, entry.dtype, None)
    if not isinstance(dtype, torch.dtype):
        return f"dtype {entry.dtype} has no torch equivalent here"
    if not scannable(dtype):
        return f"dtype {entry.dtype} is not scanned (zeroscan reads floating, integer and bool tensors)"
    return None


def scan_row(
    entry: TensorEntry, s: dict[str, object], verdict: str, role: str, severity: str, reason: str
) -> dict[str, object]:
    numel = int(s["numel"])  # type: ignore[call-overload]
    zeros = int(s["zeros"])  # type: ignore[call-overload]
    return {
        "name": entry.name,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "numel": numel,
        "zeros": zeros,
        "zero_fraction": zeros / numel if numel else 0.0,
        "subnormal": s["subnormal"],
        "near_zero": s["near_zero"],
        "nan": s["nan"],
        "posinf": s["posinf"],
        "neginf": s["neginf"],
        "negative": s["negative"],
        "min_abs": s["min_abs"],
        "min_abs_nonzero": s["min_abs_nonzero"],
        "max_abs": s["max_abs"],
        "mean": s["mean"],
        "std": s["std"],
        "norm": s["norm"],
        "verdict": verdict,
        "role": role,
        "severity": severity,
        "reason": reason,
    }
