"""The .safetensors file format, read through the safetensors package.

A file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range (and an optional "__metadata__" object
of strings), then the raw bytes. The package decides whether a file is valid
(header length, JSON, dtype names and sizes, offsets that cover the data one
tensor after another); zeroscan then reads the header itself for the one thing
the package keeps to itself, where each tensor's bytes lie, which scans read
with read calls (zeroscan.checkpoint.files). tensor() is the package's own
memory-mapped tensor.
"""

from __future__ import annotations

import json
import os
import re
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from zeroscan.checkpoint.files import contiguous_file_tensor, same_file, shape_problem
from zeroscan.checkpoint.single import Checkpoint, check_unchanged_since_opened, closed_on_failure, open_tensor_file
from zeroscan.checkpoint.table import CheckpointError, TensorEntry, dtype_name
from zeroscan.words import brief

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
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
if hasattr(torch, "float8_e8m0fnu"):  # torch 2.7 and later
    SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu

# Names other writers use for the same dtypes ("float32", "half"), for the hint
# when a header spells one its own way. Keys are lowercase.
DTYPE_ALIASES: dict[str, str] = {
    **{str(dtype).removeprefix("torch."): name for name, dtype in SAFETENSORS_DTYPES.items()},
    "float": "F32", "double": "F64", "half": "F16", "long": "I64", "int": "I32", "short": "I16", "cfloat": "C64",
}


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; str() is one line naming the file."""


class DuplicateKeyError(ValueError):
    """A key given twice in one object of a header's JSON."""


def refuse_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """json.loads' object_pairs_hook. The package keeps the last of a tensor name
    or metadata key given twice, and so would json.loads, while another reader
    may keep the first: a NaN tensor could hide behind a healthy twin."""
    obj = dict(pairs)
    if len(obj) < len(pairs):  # rare: only then look for the key
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return obj


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


def corrupt(p: Path, words: str) -> SafetensorsError:
    return SafetensorsError(f"{p}: corrupt safetensors file: {words}")


def package_open(p: Path) -> safe_open:
    """The package's handle on `p`; its refusal becomes a SafetensorsError in plain words."""
    try:
        return safe_open(p, framework="pt")
    except SafetensorError as e:
        raise corrupt(p, package_reason(p, str(e))) from None
    except OSError as e:
        raise SafetensorsError(f"{p}: cannot read ({e.strerror or e})") from None


def read_safetensors_header(p: Path) -> tuple[dict[str, SafetensorsSlot], dict[str, str]]:
    """The slots by name in file (byte-offset) order, and the __metadata__, of
    a file the package accepts and whose header zeroscan reads the same way."""
    with package_open(p) as handle:
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")  # the package has checked that it fits the file
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=refuse_duplicates)
        except DuplicateKeyError as e:
            raise corrupt(p, f"the key {brief(e.args[0])} appears twice in one JSON object") from None
        except (ValueError, RecursionError) as e:  # what the package reads but Python's json does not
            raise corrupt(p, f"zeroscan cannot parse its header ({str(e).splitlines()[0]})") from None
        metadata = header.pop("__metadata__", None) or {}
        slots: dict[str, SafetensorsSlot] = {}
        try:
            for name, info in header.items():
                begin, end = info["data_offsets"]
                slots[name] = SafetensorsSlot(info["dtype"], SAFETENSORS_DTYPES.get(info["dtype"]),
                                              tuple(info["shape"]), 8 + n + begin, end - begin)
        except (KeyError, TypeError, ValueError):
            raise disagreement(p, f"tensor {brief(name)}") from None
        for name, slot in slots.items():
            # The package checks the byte size, left to right, so [0, 2**62, 4]
            # passes it (0 bytes), but no tensor can have its strides.
            problem = shape_problem(slot.shape, slot.dtype.itemsize if slot.dtype is not None else 1)
            if problem is not None:
                raise corrupt(p, f"tensor {brief(name)} {problem}")
        # The package's reading and ours must describe the same tensors, or the
        # byte ranges scanned would not be those it validated.
        names = handle.keys()
        if len(names) != len(slots):
            raise disagreement(p, f"{len(names)} tensors, not {len(slots)}")
        for name in names:
            view = handle.get_slice(name)
            slot = slots.get(name)
            if slot is None or view.get_dtype() != slot.file_dtype or view.get_shape() != list(slot.shape):
                raise disagreement(p, f"tensor {brief(name)}")
        if (handle.metadata() or {}) != metadata:
            raise disagreement(p, "__metadata__")
    in_file_order = dict(sorted(slots.items(), key=lambda item: item[1].start))  # stable: ties keep header order
    return in_file_order, metadata


def disagreement(p: Path, what: str) -> SafetensorsError:
    return corrupt(p, f"the safetensors package and zeroscan read its header differently ({what})")


class SafetensorsTensors:
    """One file's tensors as the package maps them, its handle opened when a
    tensor is first asked for and held until close(). A mapped tensor dies with
    SIGBUS if the file is truncated meanwhile; scans read with read calls
    instead (zeroscan.checkpoint.files)."""

    def __init__(self, p: Path, slots: dict[str, SafetensorsSlot], opened: os.stat_result) -> None:
        self.p, self.slots, self.opened = p, slots, opened  # opened: the file the slots were read from
        self.handle: safe_open | None = None

    def get(self, name: str) -> torch.Tensor:
        slot = self.slots[name]
        if slot.dtype is None:
            raise SafetensorsError(f"{self.p}: tensor {brief(name)} has dtype {slot.file_dtype}, "
                                   "which has no torch equivalent here")
        if self.handle is None:
            handle = package_open(self.p)
            if not same_file(self.opened, os.stat(self.p)):
                raise SafetensorsError(f"{self.p}: changed since it was opened; open it again once it is written")
            self.handle = handle
        try:
            with warnings.catch_warnings():  # torch's, about the file: never to stderr (zeroscan.checkpoint.torch_file)
                warnings.simplefilter("ignore")
                t = self.handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise SafetensorsError(f"{self.p}: cannot map tensor {brief(name)} ({e})") from None
        return t.clone() if t.data_ptr() % t.element_size() else t  # misaligned: one aligned copy of it alone

    def close(self) -> None:
        self.handle = None  # tensors given out keep the mapping alive; the package holds no descriptor


# --- the package's refusals in plain words ------------------------------------

# By the package's name for a reason (its Debug form, before 0.6) or its own
# words for it (0.6 and later), up to the first "(", ":" or ",".
PACKAGE_REASONS: dict[tuple[str, ...], str] = {
    ("HeaderTooSmall", "header too small"): "the file is {size} bytes, too short for the 8-byte header length",
    ("HeaderTooLarge", "header too large"):
        "header length {length} is more than the 100,000,000 bytes the safetensors package reads",
    ("InvalidHeaderLength", "invalid header length"): "header length {length} does not fit a {size}-byte file",
    ("InvalidHeaderStart", "invalid header start"): "the header does not start with '{{'",
    ("InvalidHeader", "invalid UTF-8 in header"): "the header is not UTF-8 text",
    ("InvalidHeaderDeserialization",): "the header is not valid safetensors JSON",
    ("TensorInvalidInfo", "invalid shape"):
        "a tensor's data_offsets span a different number of bytes than its shape needs in its dtype",
    ("MetadataIncompleteBuffer", "incomplete metadata"):
        "the tensors do not end where the file ends (the file is truncated, or holds bytes outside its tensors)",
    ("ValidationOverflow", "overflow computing buffer size from shape and/or element type"):
        "a tensor's shape has more elements than a tensor can hold (its byte size overflows 64 bits)",
    ("MisalignedSlice", "The slice is slicing for subbytes dtypes"):
        "a tensor of a 4- or 6-bit dtype does not end on a byte boundary",
}

# serde_json's names for what a header holds, and what it expected there.
JSON_WORDS = (("`", ""), ("usize", "a non-negative integer"), ("sequence", "array"), ("a map", "an object"),
              ("string or map", "an object"), ("struct TensorInfo", "a tensor's entry (an object)"))


def package_reason(p: Path, message: str) -> str:
    """The package's SafetensorError message as plain words, naming the tensor
    when the package names one."""
    reason = re.sub(r"^Error while deserializing( header)?: ", "", (message.strip().splitlines() or ["-"])[0])
    named = re.fullmatch(r'InvalidOffset\("(.*)"\)|invalid offset for tensor `(.*)`', reason)
    if named:
        return (f"tensor {brief(named[1] if named[1] is not None else named[2])} does not start where the one "
                "before it ends (its data_offsets overlap another tensor, leave a gap or run backwards)")
    head, detail = (part.strip() for part in (re.split(r"[(:,]", reason, maxsplit=1) + [""])[:2])
    if head == "invalid JSON in header":
        return json_reason(detail)
    words = next((w for names, w in PACKAGE_REASONS.items() if head in names), None)
    if words is None:
        return f"the safetensors package refuses it ({reason})"
    try:  # the numbers the package leaves out
        with open(p, "rb") as f:
            length, size = int.from_bytes(f.read(8), "little"), os.fstat(f.fileno()).st_size
    except OSError:  # gone since
        return f"the safetensors package refuses it ({reason})"
    text = words.format(length=length, size=size)
    return f"{text} ({detail})" if head == "invalid UTF-8 in header" else text


def json_reason(detail: str) -> str:
    """serde_json's refusal of a header, in plain words."""
    variant = re.match(r"unknown variant `(.*)`, expected one of (.*?)(?= at line|$)", detail)
    if variant:
        key = variant[1].strip().lower().removeprefix("torch.")
        key = "f" + key[2:] if key.startswith("fp") else key
        names = re.findall(r"`([^`]*)`", variant[2])
        guess = DTYPE_ALIASES.get(key) or (key.upper() if key.upper() in names else None)
        hint = f"did you mean {guess!r}?" if guess else f"the names are {', '.join(names)}"
        return f"dtype {brief(variant[1])} is not a safetensors dtype name ({hint})"
    twice = re.match(r"duplicate field `(.*)`(.*)", detail)
    if twice:
        return f"the key {brief(twice[1])} appears twice in one JSON object{twice[2]}"
    whole = re.match(r"invalid type: (\w+).*expected struct HashMetadata", detail)
    if whole:
        return f"the header is a JSON {'array' if whole[1] == 'sequence' else whole[1]}, not an object"
    for rust, plain in JSON_WORDS:
        detail = detail.replace(rust, plain)
    if detail.startswith(("invalid type", "invalid value", "invalid length", "missing field", "number out of range")):
        return f"the header's JSON is not a safetensors header ({detail})"
    if detail.startswith("recursion limit exceeded"):
        return f"the header's JSON is nested deeper than the safetensors package reads ({detail})"
    return f"the header is not valid JSON ({detail})"




def open_safetensors(p: Path) -> Checkpoint:
    """A .safetensors file as a Checkpoint. The format's own errors become
    CheckpointError, the one error every caller of open_checkpoint handles.

    The file is opened first and the header then parsed by path: the same
    size, time and inode afterwards show that the header describes the file
    the tensors will be read from."""
    file = open_tensor_file(p)
    with closed_on_failure(file, SafetensorsError):
        slots, metadata = read_safetensors_header(p)
        check_unchanged_since_opened(file, p.stat())
    entries = []
    located = {}
    for name, slot in slots.items():
        label = dtype_name(slot.dtype) if slot.dtype is not None else slot.file_dtype
        entries.append(TensorEntry(name, label, slot.shape, slot.nbytes))
        if slot.dtype is not None:
            located[name] = contiguous_file_tensor(slot.start, slot.dtype, slot.shape)
    mapped = SafetensorsTensors(p, slots, file.opened)  # the package's mapping, opened when a tensor is first asked for

    def get(name: str) -> torch.Tensor:
        try:
            return mapped.get(name)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None

    return Checkpoint(p, "safetensors", entries, get, mapped.close, metadata, file=file, located=located)


# --- scanning ---------------------------------------------------------------

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes in all)

