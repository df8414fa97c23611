"""The .safetensors file format, read and written without the safetensors package.

A file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range (and an optional "__metadata__" object
of strings), then the raw bytes. Reading parses and checks the header alone;
the tensors are then views of one mapping of the whole file, made when first
asked for, so a file larger than memory is never read whole.
"""

from __future__ import annotations

import io
import json
import math
import os
import reprlib
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
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
if hasattr(torch, "float8_e8m0fnu"):  # torch 2.7 and later
    SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu

# Bits per element of every dtype name the format has, including those no
# torch dtype matches (the 4- and 6-bit floats, packed across bytes). C128 is
# zeroscan's own: write_safetensors writes it, the safetensors package does not.
SAFETENSORS_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "C128": 128,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

# Names other writers use for the same dtypes ("float32", "torch.float16", "fp32"), for the hint
# when a header spells one of them its own way. Keys are lowercase.
DTYPE_ALIASES: dict[str, str] = {
    **{str(dtype).removeprefix("torch."): name for name, dtype in SAFETENSORS_DTYPES.items()},
    **{name.lower(): name for name in SAFETENSORS_DTYPE_BITS},
    "float": "F32", "double": "F64", "half": "F16", "long": "I64", "int": "I32", "short": "I16",
    "cfloat": "C64", "cdouble": "C128",
}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors reference refuses larger headers too
MAX_NUMEL = 2**63 - 1  # torch sizes are int64; the safetensors package refuses overflowing shapes too


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; str() is one line naming the file."""


class HeaderError(ValueError):
    """A problem found while parsing the header JSON; str() lacks the file name."""


def brief(value: object) -> str:
    """repr() cut short: a hostile header can hold a 100 MB name or a million-long shape."""
    short = reprlib.Repr()
    short.maxstring, short.maxlist, short.maxlong, short.maxother = 120, 8, 40, 120
    return short.repr(value)


def header_object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """json.loads' object_pairs_hook: a JSON object as a dict, refusing a key
    given twice (json.loads would keep the last, so a NaN tensor could hide
    behind a healthy twin of the same name) and text with lone surrogate escapes
    ("\\ud800" parses, but is no Unicode and cannot be printed)."""
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise HeaderError(f"the key {brief(key)} appears twice in one JSON object")
        for text in (key, value) if isinstance(value, str) else (key,):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise HeaderError(f"{brief(text)} holds a lone surrogate escape, not Unicode text") from None
        obj[key] = value
    return obj


def parse_header_json(raw: bytes) -> object:
    """The header's JSON value; HeaderError says why it is not valid."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=header_object)
    except json.JSONDecodeError as e:
        raise HeaderError(f"not valid JSON ({e})") from None
    except HeaderError:
        raise
    except RecursionError:
        raise HeaderError("JSON nested too deeply to parse (a safetensors header is three levels deep)") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise HeaderError(f"not valid JSON ({str(e).splitlines()[0]})") from None


def checked_dtype(where: str, dtype_str: object) -> str:
    if not isinstance(dtype_str, str):
        raise SafetensorsError(f"{where} has dtype {brief(dtype_str)}, not a safetensors dtype name")
    if dtype_str in SAFETENSORS_DTYPE_BITS:
        return dtype_str
    # Refused rather than skipped: the element size, and so the byte range, cannot be
    # checked, and the safetensors package (and every reader built on it) refuses the file.
    key = dtype_str.strip().lower().removeprefix("torch.")
    guess = DTYPE_ALIASES.get("f" + key[2:] if key.startswith("fp") else key)
    hint = f"did you mean {guess!r}?" if guess else f"the names are {', '.join(SAFETENSORS_DTYPE_BITS)}"
    raise SafetensorsError(f"{where} has dtype {brief(dtype_str)}, which is not a safetensors dtype name ({hint})")


def checked_shape(where: str, shape: object) -> tuple[int, ...]:
    # type() rather than isinstance(): JSON true/false arrive as bool, an int subclass.
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise SafetensorsError(f"{where} has shape {brief(shape)}, not a list of non-negative integers")
    numel = 1
    for s in shape:  # checked as it grows, as the safetensors package does: [2**40, 2**40, 0] is refused too
        numel *= s
        if numel > MAX_NUMEL:
            raise SafetensorsError(
                f"{where} has shape {brief(shape)}, more elements than a tensor can hold (2**63 - 1)"
            )
    return tuple(shape)


def checked_offsets(where: str, offsets: object, data_size: int) -> tuple[int, int]:
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise SafetensorsError(f"{where} has data_offsets {brief(offsets)} outside the {data_size} data bytes")
    return offsets[0], offsets[1]


def check_contiguous(p: Path, ranges: list[tuple[int, int, str]], data_size: int) -> None:
    """The tensors must cover the data bytes one after another, with no overlap, gap
    or trailing bytes: the format requires it and the safetensors package refuses
    anything else. Overlapping ranges would also let a small file declare any number
    of tensors over the same bytes."""
    end_so_far, previous = 0, None
    for begin, end, name in sorted(ranges):
        if begin != end_so_far:
            where = f"{p}: corrupt safetensors header: tensor {brief(name)} (data bytes {begin} to {end})"
            if previous is None:
                problem = "starts after the first data byte, leaving a gap"
            elif begin < end_so_far:
                problem = f"overlaps tensor {brief(previous)}, which ends at {end_so_far}"
            else:
                problem = f"leaves a gap after tensor {brief(previous)}, which ends at {end_so_far}"
            raise SafetensorsError(
                f"{where} {problem} (safetensors tensors lie one after another, without overlaps or gaps)"
            )
        end_so_far, previous = end, name
    if end_so_far != data_size:
        raise SafetensorsError(
            f"{p}: corrupt safetensors header: the tensors cover {end_so_far} of the {data_size} data bytes "
            "(a safetensors file holds no bytes outside its tensors)"
        )


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
        header = parse_header_json(raw)
    except HeaderError as e:
        raise SafetensorsError(f"{p}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{p}: corrupt safetensors header: a JSON {type(header).__name__}, not an object")
    data_start = 8 + n
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{p}: corrupt safetensors header: __metadata__ is not an object")
    slots: dict[str, SafetensorsSlot] = {}
    for name, info in header.items():
        where = f"{p}: corrupt safetensors header: tensor {brief(name)}"
        if not isinstance(info, dict):
            raise SafetensorsError(f"{where} is described by a {type(info).__name__}, not an object")
        dtype_str = checked_dtype(where, info.get("dtype"))
        shape = checked_shape(where, info.get("shape"))
        begin, end = checked_offsets(where, info.get("data_offsets"), data_size)
        bits = math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype_str]
        if bits % 8 or end - begin != bits // 8:
            need = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits, not a whole number of bytes"
            raise SafetensorsError(
                f"{where} spans {end - begin} bytes, but {dtype_str}{brief(list(shape))} needs {need}"
            )
        dtype = SAFETENSORS_DTYPES.get(dtype_str)
        slots[name] = SafetensorsSlot(dtype_str, dtype, shape, data_start + begin, end - begin)
    check_contiguous(p, [(s.start - data_start, s.start - data_start + s.nbytes, name) for name, s in slots.items()],
                     data_size)
    in_file_order = dict(sorted(slots.items(), key=lambda item: item[1].start))  # stable: ties keep header order
    return in_file_order, {str(k): str(v) for k, v in metadata.items()}


def map_safetensors_file(f: io.RawIOBase) -> np.memmap:
    """The whole open file `f` mapped copy-on-write, once for all its tensors
    (one mapping holds one file descriptor, however many tensors it serves):
    reads fault pages in on demand, and a write (zeroscan makes none) never
    reaches the file. A tensor read from a mapping dies with SIGBUS if the file
    is truncated meanwhile; scans read with read calls instead
    (zeroscan.checkpoint_reads)."""
    return np.memmap(f, dtype=np.uint8, mode="c")


def map_safetensors_slot(mapped: np.memmap, p: Path, name: str, slot: SafetensorsSlot) -> torch.Tensor:
    """One tensor of the file `p`, a view of its bytes in `mapped` (map_safetensors_file)."""
    if slot.dtype is None:
        raise SafetensorsError(f"{p}: tensor {name!r} has dtype {slot.file_dtype}, which this torch cannot represent")
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the mapping is writable only copy-on-write
        flat = torch.frombuffer(mapped[slot.start : slot.start + slot.nbytes], dtype=torch.uint8)
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
