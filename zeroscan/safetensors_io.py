"""The .safetensors file format, read and written without the safetensors package.

A file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range (and an optional "__metadata__" object
of strings), then the raw bytes. Reading parses and checks the header alone;
each tensor is then memory-mapped on its own when asked for, so a file larger
than memory is never read whole.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
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

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors reference refuses larger headers too


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; str() is one line naming the file."""


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """An 8-byte header length that fits the file, then a JSON object."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= size - 8 and head[8:9] == b"{"


@dataclass(frozen=True)
class SafetensorsSlot:
    """Where one tensor lies in the file, and what it holds."""

    file_dtype: str  # the file's own name ("F32"), kept for a dtype this torch lacks
    dtype: torch.dtype | None  # None: this torch cannot represent file_dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(p: Path) -> tuple[dict[str, SafetensorsSlot], dict[str, str]]:
    """Parses and checks the header; returns the slots by name in file
    (byte-offset) order, and the __metadata__."""
    size = p.stat().st_size
    with open(p, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise SafetensorsError(
                f"{p}: corrupt safetensors header: the file is {size} bytes, shorter than the 8-byte length"
            )
        (n,) = struct.unpack("<Q", raw_len)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise SafetensorsError(
                f"{p}: corrupt safetensors header: header length {n} does not fit a {size}-byte file"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{p}: corrupt safetensors header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{p}: corrupt safetensors header: a JSON {type(header).__name__}, not an object")
    data_start = 8 + n
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{p}: corrupt safetensors header: __metadata__ is not an object")
    slots: dict[str, SafetensorsSlot] = {}
    for name, info in header.items():
        where = f"{p}: corrupt safetensors header: tensor {name!r}"
        if not isinstance(info, dict):
            raise SafetensorsError(f"{where} is described by a {type(info).__name__}, not an object")
        dtype_str, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype_str, str):
            raise SafetensorsError(f"{where} has no dtype")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise SafetensorsError(f"{where} has shape {shape!r}, not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size
        ):
            raise SafetensorsError(f"{where} has data_offsets {offsets!r} outside the {data_size} data bytes")
        begin, end = offsets
        dtype = SAFETENSORS_DTYPES.get(dtype_str)
        if dtype is not None:
            want = math.prod(shape) * dtype.itemsize
            if end - begin != want:
                raise SafetensorsError(
                    f"{where} spans {end - begin} bytes, but {dtype_str}{shape} needs {want}"
                )
        slots[name] = SafetensorsSlot(dtype_str, dtype, tuple(shape), data_start + begin, end - begin)
    in_file_order = dict(sorted(slots.items(), key=lambda item: item[1].start))  # stable: ties keep header order
    return in_file_order, {str(k): str(v) for k, v in metadata.items()}


def map_safetensors_slot(p: Path, name: str, slot: SafetensorsSlot) -> torch.Tensor:
    """Maps one tensor's bytes copy-on-write: reads fault pages in from the
    file on demand, and a write (zeroscan makes none) never reaches the file."""
    if slot.dtype is None:
        raise SafetensorsError(f"{p}: tensor {name!r} has dtype {slot.file_dtype}, which this torch cannot represent")
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
