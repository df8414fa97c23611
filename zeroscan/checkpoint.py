"""Reading checkpoints tensor by tensor, without loading them whole.

Two formats are read:

* torch.save files, loaded with ``weights_only=True`` (no pickled code is
  ever run) and memory-mapped (``torch.load(mmap=True)``) when the file uses
  the zip format; nested dicts, lists and tuples of tensors are flattened to
  dotted names (``model.layer.0.weight``, ``optimizer.state.3.exp_avg``);
  leaves that are not tensors (an epoch number, a config string) are left out.
* .safetensors files, parsed here without the safetensors package: an 8-byte
  little-endian header length, a JSON header naming each tensor's dtype,
  shape and byte range, then the raw bytes. Each tensor is memory-mapped on
  its own when asked for, so a file larger than memory is never read whole.

Every problem with the file itself raises CheckpointError with a one-line
message naming the file.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import struct
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# safetensors dtype names -> torch dtypes (those this torch has).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
    "C128": torch.complex128,
}

# What the native scan reads directly; complex tensors are scanned as their
# real and imaginary parts (torch.view_as_real).
SCANNABLE_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    }
)
COMPLEX_DTYPES = frozenset({torch.complex64, torch.complex128})

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors reference refuses larger headers too


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


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """An 8-byte header length that fits the file, then a JSON object."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= size - 8 and head[8:9] == b"{"


@dataclass(frozen=True)
class SafetensorsSlot:
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(p: Path) -> tuple[dict[str, SafetensorsSlot], dict[str, str], list[TensorEntry]]:
    """Parses and checks the header; returns the slots, the __metadata__ and
    the entries in file (byte-offset) order."""
    size = p.stat().st_size
    with open(p, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(
                f"{p}: corrupt safetensors header: the file is {size} bytes, shorter than the 8-byte length"
            )
        (n,) = struct.unpack("<Q", raw_len)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{p}: corrupt safetensors header: header length {n} does not fit a {size}-byte file"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: corrupt safetensors header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{p}: corrupt safetensors header: a JSON {type(header).__name__}, not an object")
    data_start = 8 + n
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{p}: corrupt safetensors header: __metadata__ is not an object")
    slots: dict[str, SafetensorsSlot] = {}
    entries: list[tuple[int, TensorEntry]] = []
    for name, info in header.items():
        where = f"{p}: corrupt safetensors header: tensor {name!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where} is described by a {type(info).__name__}, not an object")
        dtype_str, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype_str, str):
            raise CheckpointError(f"{where} has no dtype")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CheckpointError(f"{where} has shape {shape!r}, not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size
        ):
            raise CheckpointError(f"{where} has data_offsets {offsets!r} outside the {data_size} data bytes")
        begin, end = offsets
        dtype = SAFETENSORS_DTYPES.get(dtype_str)
        if dtype is not None:
            want = math.prod(shape) * dtype.itemsize
            if end - begin != want:
                raise CheckpointError(
                    f"{where} spans {end - begin} bytes, but {dtype_str}{shape} needs {want}"
                )
        slots[name] = SafetensorsSlot(dtype, tuple(shape), data_start + begin, end - begin)
        label = dtype_name(dtype) if dtype is not None else dtype_str
        entries.append((begin, TensorEntry(name, label, tuple(shape), end - begin)))
    entries.sort(key=lambda item: item[0])
    return slots, {str(k): str(v) for k, v in metadata.items()}, [e for _, e in entries]


def open_safetensors(p: Path) -> Checkpoint:
    slots, metadata, entries = read_safetensors_header(p)

    def get(name: str) -> torch.Tensor:
        return map_safetensors_slot(p, name, slots[name])

    return Checkpoint(p, "safetensors", entries, get, metadata=metadata)


def map_safetensors_slot(p: Path, name: str, slot: SafetensorsSlot) -> torch.Tensor:
    """Maps one tensor's bytes copy-on-write: reads fault pages in from the
    file on demand, and a write (zeroscan makes none) never reaches the file."""
    if slot.dtype is None:
        raise CheckpointError(f"{p}: tensor {name!r} has a dtype this torch cannot represent")
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    mapped = np.memmap(p, dtype=np.uint8, mode="c", offset=slot.start, shape=(slot.nbytes,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mapped, dtype=torch.uint8)
    if slot.start % slot.dtype.itemsize:
        flat = flat.clone()  # a misaligned tensor: one aligned copy of this tensor alone
    return flat.view(slot.dtype).reshape(slot.shape)


def write_safetensors(
    path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Writes `tensors` as a .safetensors file (for tests and small exports):
    the header is padded with spaces to a multiple of 8 bytes, as the format
    recommends, so every tensor starts aligned."""
    names = {d: n for n, d in SAFETENSORS_DTYPES.items()}
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    blobs: list[bytes] = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in names:
            raise ValueError(f"write_safetensors: tensors[{name!r}] has dtype {t.dtype}, which safetensors cannot hold")
        blob = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


# --- scanning and comparing -------------------------------------------------

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
    """Scans every tensor of a checkpoint and diagnoses each (zeroscan.diagnose_stats);
    findings on integer and bool tensors are at most "info".

    Tensors are scanned a batch at a time (up to `batch_bytes`, one native
    stats_many call per batch) straight from the memory-mapped file, so the
    pages a scan touches are file pages the kernel can drop again, never a
    copy of the checkpoint. `progress(done, total)` is called in bytes after
    each batch.
    """
    from zeroscan.diagnosis import Severity, diagnose_stats
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
                severity, reason = d.severity.name.lower(), d.reason
                if not t.is_floating_point() and d.severity > Severity.INFO:
                    # counters, indices, masks (num_batches_tracked, token_type_ids): all zero is normal
                    severity, reason = "info", f"{reason} (an integer tensor: a counter, index or mask, so only info)"
                rows.append(scan_row(entry, s.to_dict(), d.verdict.value, severity, reason))
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


def scan_row(entry: TensorEntry, s: dict[str, object], verdict: str, severity: str, reason: str) -> dict[str, object]:
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
        "severity": severity,
        "reason": reason,
    }


INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


def diff_checkpoints(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    progress: ProgressFn | None = None,
    chunk_elements: int = 1 << 22,
) -> list[dict[str, object]]:
    """Compares two checkpoints tensor by tensor, bit for bit.

    One row per name in either file (a's order, then names only in b), with
    status "changed", "identical", "added" (only in b), "removed" (only in a),
    "reshaped" or "retyped"; for changed tensors the number and fraction of
    elements whose bits differ and the largest |a - b| over values where
    neither is NaN. A floating-point tensor left bit-identical while others
    changed is a warning: the optimizer never updated it.
    """
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
                r["severity"] = "warning"
                others = f"{n_changed} other tensor{'s' if n_changed != 1 else ''}"
                r["reason"] = f"bit-identical while {others} changed: never updated"
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
