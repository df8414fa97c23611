"""The torch.save file format, read safely: the checks made before torch.load
opens a file, and the walk that names every tensor of what it loaded.

torch.load runs with weights_only=True, so no pickled code ever runs; its
refusal of a hostile pickle is reworded here so that it names what the file
asked for and never passes on torch's advice to retry with weights_only=False.
A zip file whose entries are compressed is refused before loading (torch.save
never compresses, and an entry could inflate to any size). The loaded object's
dicts, lists and tuples are walked without recursion, with a depth limit and
cycle detection, to dotted names (``model.layer.0.weight``).

Every refusal raises TorchFileError, one line naming the file;
open_torch turns it into a CheckpointError.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import re
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from zeroscan.checkpoint.single import (
    Checkpoint,
    check_unchanged_since_opened,
    closed_on_failure,
    open_tensor_file,
    shape_of,
    stored_bytes,
)
from zeroscan.checkpoint.table import TensorEntry, dtype_name
from zeroscan.words import brief


class TorchFileError(ValueError):
    """A file torch.load refuses, or that zeroscan refuses to give it; str() is one line naming the file."""


def load_torch_file(p: Path, source: str | None = None) -> tuple[dict[str, torch.Tensor], bool]:
    """Every tensor of the torch.save file p by unique dotted name, and whether
    the file is the zip format (its tensors are then memory-mapped). The file
    is read from `source` where given (a path that opens the descriptor
    zeroscan holds, TensorFile.descriptor_path), and named p in errors.
    torch.load reads a path ending in .safetensors as a safetensors file,
    whatever it holds, so a torch.save file of that name is loaded through
    `source`."""
    where = p if source is None else source
    zipped = zipfile.is_zipfile(where)
    if zipped:
        check_zip_entries(p, where)
    try:
        with warnings.catch_warnings():
            # Whatever torch says while it loads a file is about the file, and
            # a file's problems reach the user as one line or a skipped
            # tensor's reason, never as warnings with torch's source lines:
            # torch.save(pickle_protocol=3) files, quantized tensors and their
            # TypedStorage (deprecated), sparse CSR, CSC, BSR and BSC tensors
            # ("in beta state") all warn. The pickle runs no code of the file's,
            # so every warning here is torch's own.
            warnings.simplefilter("ignore")
            obj = torch.load(where, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as e:
        raise TorchFileError(f"{p}: {refused_pickle(str(e))}") from None
    except Exception as e:  # torch.load raises many types for a file that is not its own
        why = one_line(e).replace(str(where), str(p))  # the file by its name, not by its descriptor
        raise TorchFileError(f"{p}: not a PyTorch checkpoint or a safetensors file ({why})") from None
    tensors: dict[str, torch.Tensor] = {}
    last_suffix: dict[str, int] = {}
    try:
        for name, t in flatten(obj):
            unique, n = name, last_suffix.get(name, 1)
            while unique in tensors:  # a key "a.b" beside a nested {"a": {"b": ...}}
                n += 1
                unique = f"{name}#{n}"
            last_suffix[name] = n  # the next clash of this name resumes here, not at #2
            tensors[unique] = t
    except ContainerError as e:
        raise TorchFileError(f"{p}: {e}") from None
    return tensors, zipped


# torch.save's pickler recurses, and under Python's default recursion limit stops
# near 500 levels of nesting; 1000 admits files saved with a raised limit and
# stops a hand-built pickle (torch.load reads any depth) long before it costs much.
MAX_NESTING = 1000
# A container reached again by another path (one dict saved under two keys) is
# walked again, so each path keeps its names; lists that each hold the previous
# one twice would make that exponential in a file of a few hundred bytes. A real
# checkpoint rewalks a state_dict saved twice (thousands of items); a million
# costs about three seconds before the refusal.
MAX_REWALKED_ITEMS = 1_000_000


class ContainerError(ValueError):
    """A loaded object flatten refuses to walk; str() names where it stopped."""


def items_of(obj: dict[object, object] | list[object] | tuple[object, ...]) -> Iterator[tuple[object, object]]:
    return iter(obj.items()) if isinstance(obj, dict) else enumerate(obj)


def flatten(obj: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor in nested dicts, lists and tuples,
    depth first in container order. Iterative, so depth costs no Python stack;
    raises ContainerError for a container that contains itself, nesting deeper
    than MAX_NESTING, or shared containers that expand without bound."""
    if isinstance(obj, torch.Tensor):
        yield (prefix or "tensor"), obj
        return
    if not isinstance(obj, (dict, list, tuple)):
        return
    # One frame per open container: its dotted name, its remaining items, its id,
    # and whether it (or a container around it) was already walked by another path.
    stack = [(prefix, items_of(obj), id(obj), False)]
    open_names = {id(obj): prefix}  # the containers on the current path, by id
    walked = {id(obj)}
    rewalked = 0
    while stack:
        where, items, ident, again = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            del open_names[ident]
            continue
        key, value = item
        name = f"{where}.{key}" if where else str(key)
        rewalked += again
        if rewalked > MAX_REWALKED_ITEMS:
            raise ContainerError(
                f"shared containers expand to more than {MAX_REWALKED_ITEMS:,} items (stopped at {short_path(name)})"
            )
        if isinstance(value, torch.Tensor):
            yield (name or "tensor"), value
        elif isinstance(value, (dict, list, tuple)):
            child = id(value)
            if child in open_names:
                around = f"the one at {short_path(open_names[child])}" if open_names[child] else "the top-level object"
                raise ContainerError(
                    f"the container at {short_path(name)} is {around} again (a container that contains itself)"
                )
            if len(stack) >= MAX_NESTING:
                raise ContainerError(f"containers nested more than {MAX_NESTING} deep (stopped at {short_path(name)})")
            stack.append((name, items_of(value), child, again or child in walked))
            open_names[child] = name
            walked.add(child)


def short_path(name: str) -> str:
    """A dotted path cut to its ends: one nested a thousand deep is thousands of characters."""
    return name if len(name) <= 120 else f"{name[:60]}...{name[-50:]}"


ZIP_METHODS = {zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}


def check_zip_entries(p: Path, source: str | Path) -> None:
    """torch.save stores every entry of its zip uncompressed, but torch.load
    inflates a compressed one whole into memory: a 1 MB file could expand to
    gigabytes before a tensor is read. So every entry must be stored and its
    declared size must fit the file, both read from the zip's directory before
    torch.load opens the file. It is read from `source`, and named p."""
    size = os.stat(source).st_size
    try:
        with zipfile.ZipFile(source) as z:
            infos = z.infolist()
    except Exception as e:  # zipfile raises several types for a damaged directory
        raise TorchFileError(
            f"{p}: not a PyTorch checkpoint or a safetensors file (a damaged zip: {one_line(e)})"
        ) from None
    for info in infos:
        entry = f"{p}: zip entry {brief(info.filename)}"
        if info.compress_type != zipfile.ZIP_STORED:
            method = ZIP_METHODS.get(info.compress_type, f"method {info.compress_type}")
            raise TorchFileError(
                f"{entry} is compressed ({method}, {info.compress_size:,} bytes that inflate to {info.file_size:,}); "
                "torch.save never compresses, and zeroscan refuses what could inflate to any size"
            )
        if info.file_size != info.compress_size or info.header_offset + info.compress_size > size:
            raise TorchFileError(f"{entry} declares {info.file_size:,} bytes, which do not fit the {size:,}-byte file")


def refused_pickle(text: str) -> str:
    """What torch's weights_only unpickler refused (from its message), in one line.
    torch's message advises retrying with weights_only=False, which would run the
    code a hostile file holds, so none of its advice is passed on."""
    nothing_ran = "zeroscan loads with weights_only=True, so nothing in the file ran"
    blocked = re.search(r"GLOBAL (\S+) whose module (\S+) is blocked", text)
    if blocked:
        return (f"refused: the pickle asks for {blocked[1]}, from module {blocked[2]}, which torch's weights_only "
                f"loader blocks because it can run commands; {nothing_ran}")
    found = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    if found:
        name = found[1] if "." in found[1] else f"builtins.{found[1]}"  # torch drops the "builtins." of eval, exec
        if name.startswith("builtins."):
            return (f"refused: the pickle asks for {name}, a builtin that torch's weights_only loader does not "
                    f"allow; {nothing_ran}")
        return (f"the pickle holds a {name} object, not only tensors and plain containers; {nothing_ran} "
                "(if the file is your own, save the state_dict alone to scan it)")
    detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    why = detail[1].strip() if detail else one_line(pickle.UnpicklingError(text))
    operand = re.fullmatch(r"Unsupported operand (\d+)", why)
    if operand:
        code = int(operand[1])
        op = next((op for op in pickletools.opcodes if ord(op.code) == code), None)
        why = (f"the pickle uses opcode {op.name} (pickle protocol {op.proto}), which torch's weights_only loader "
               "does not read" if op else f"byte {code:#04x} is not a pickle opcode")
    return f"not a PyTorch checkpoint or a safetensors file ({why})"


def one_line(e: BaseException) -> str:
    """The type and the first line of e's message that says what is wrong. Lines
    naming weights_only are left out: torch.load's advice to retry with
    weights_only=False would run whatever code the pickle holds."""
    lines = (line.strip() for line in str(e).splitlines())
    msg = next((line for line in lines if line and "weights_only" not in line), "")
    msg = msg if len(msg) <= 300 else msg[:300] + "..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


# How torch.save files begin: a zip's first local header, or (the legacy
# format) a pickle's PROTO opcode and protocol, then torch's magic number as
# a 10-byte LONG1. Neither can begin a safetensors file whose header length
# is within the 100 MB the package reads.
ZIP_MAGIC = b"PK\x03\x04"
LEGACY_MAGIC_AT_2 = b"\x8a\x0a\x6c\xfc\x9c\x46\xf9"


def looks_like_torch(head: bytes) -> bool:
    return head.startswith(ZIP_MAGIC) or (head[:1] == b"\x80" and head[2:9] == LEGACY_MAGIC_AT_2)




# --- opening a torch.save file as a Checkpoint -----------------------------


def open_torch(p: Path) -> Checkpoint:
    """A torch.save file. It is opened before torch.load maps it, and torch
    loads it through that descriptor (TensorFile.descriptor_path): the file
    that scans read from and check for changes is the one torch mapped, so a
    file truncated after torch.load is a changed file to the scan, not a
    SIGBUS when torch's mapping is read. The same size and time after
    torch.load show that it did not change while torch read it."""
    file = open_tensor_file(p)
    with closed_on_failure(file, TorchFileError):
        tensors, zipped = load_torch_file(p, file.descriptor_path)
        check_unchanged_since_opened(file, os.fstat(file.raw.fileno()))
    if not zipped:  # the legacy format: torch.load read it whole, so nothing more is read from the file
        file.close()
    entries = [TensorEntry(name, dtype_name(t.dtype), shape_of(t), stored_bytes(t)) for name, t in tensors.items()]
    return Checkpoint(p, "torch" if zipped else "torch-legacy", entries, tensors.__getitem__, tensors.clear,
                      file=file if zipped else None)

