"""A torch.distributed.checkpoint (DCP) folder's `.metadata`, read without
running its pickle.

FSDP2 and torchtitan save a folder: a `.metadata` pickle that gives every
tensor's dtype, shape and chunks (a shard of a DTensor is one chunk) and
where each chunk lies, beside `__R_K.distcp` files that hold the chunks,
each chunk a small torch.save archive.

torch's FileSystemReader.read_metadata unpickles `.metadata` with plain
pickle.load, which runs whatever a hostile file asks for. So zeroscan
unpickles it itself, allowing only the classes DCP metadata is made of
(METADATA_GLOBALS), then checks what it says (sizes, file names, chunks
that overlap) before zeroscan.checkpoint.dcp hands it to DCP's reader.

Every problem with `.metadata` raises CheckpointError, one line naming the file.
"""

from __future__ import annotations

import importlib
import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from zeroscan.checkpoint.files import shape_problem
from zeroscan.checkpoint.table import CheckpointError
from zeroscan.checkpoint.torch_file import one_line
from zeroscan.words import brief

METADATA_FILE = ".metadata"

# --- the metadata pickle -------------------------------------------------------

_DCP = "torch.distributed.checkpoint.metadata"
_SHARD = "torch.distributed._shard.sharded_tensor.metadata"  # where torch 2.0 and 2.1 kept TensorProperties

# The globals a DCP metadata pickle names, found by listing what the pickles
# of real checkpoints ask for (one process, and two ranks with FSDP2; model
# and optimizer state; every dtype), with torch 2.0's TensorProperties. The
# records are dataclasses, the only objects whose state a pickle may set
# (its BUILD opcode); the others are an enum, a lookup of a layout by name
# and a plain container. torch's dtypes and torch.Size are allowed apart.
METADATA_RECORDS = frozenset({
    (_DCP, "Metadata"),
    (_DCP, "TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"),
    (_DCP, "TensorProperties"),
    (_DCP, "MetadataIndex"),
    (_DCP, "StorageMeta"),
    (_SHARD, "TensorProperties"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
})
METADATA_GLOBALS = METADATA_RECORDS | {
    (_DCP, "_MEM_FORMAT_ENCODING"),
    (_SHARD, "MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),  # torch.strided, by its name
    ("collections", "OrderedDict"),
}
# StorageMeta.checkpoint_id, the path a checkpoint was saved to, is read as a
# pure path, which touches nothing (a WindowsPath cannot even be built here).
PATH_CLASSES = {
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
}
# By vars(), not getattr(): torch's module __getattr__ imports submodules by name.
TORCH_GLOBALS = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)} | {"Size": torch.Size}


class MetadataUnpickler(pickle._Unpickler):
    """An unpickler that builds only the objects of a DCP metadata pickle:
    it refuses any global but those above before importing or looking it up,
    and sets the state (BUILD) of METADATA_RECORDS instances only, never of
    a class or function, which would change it for the whole process. The
    C unpickler has no hook for BUILD, so this is Python's own, about twice
    as slow."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BufferedReader, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in TORCH_GLOBALS:
            return TORCH_GLOBALS[name]
        if (module, name) in PATH_CLASSES:
            return PATH_CLASSES[module, name]
        if (module, name) not in METADATA_GLOBALS:
            what = brief(f"{module}.{name}")[1:-1]  # repr's escapes keep it one line, less its quotes
            raise CheckpointError(f"{self.path}: refuses to unpickle {what} (only DCP metadata classes are read)")
        return getattr(importlib.import_module(module), name)

    def load_build(self) -> None:
        kind = type(self.stack[-2])
        if (kind.__module__, kind.__qualname__) not in METADATA_RECORDS:
            what = brief(f"{kind.__module__}.{kind.__qualname__}")[1:-1]
            raise CheckpointError(
                f"{self.path}: refuses to set the state of a {what} (only DCP metadata records are built)"
            )
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def read_metadata(p: Path) -> Metadata:
    """The DCP Metadata in the file p, unpickled by MetadataUnpickler."""
    try:
        with open(p, "rb") as f:
            md = MetadataUnpickler(f, p).load()  # type: ignore[arg-type]
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # pickle raises many types for a damaged or truncated stream
        raise CheckpointError(f"{p}: not DCP metadata (a damaged pickle: {one_line(e)})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{p}: not DCP metadata (it holds a {type(md).__name__}, not a Metadata)")
    if not isinstance(getattr(md, "state_dict_metadata", None), dict) or not isinstance(
        getattr(md, "storage_data", None), dict
    ):
        raise CheckpointError(f"{p}: not DCP metadata (no table of tensors and of where their chunks lie)")
    return md


def is_size(value: object, rank: int | None = None) -> bool:
    return (
        isinstance(value, torch.Size)
        and all(isinstance(n, int) and n >= 0 for n in value)
        and (rank is None or len(value) == rank)
    )


def is_file_name(name: object) -> bool:
    """A chunk's file must be a plain name in the folder: a hostile
    `../../x` or `/dev/zero` would send the reader anywhere."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )


def tensor_files(p: Path, fqn: str, md: TensorStorageMetadata, storage: dict[Any, Any]) -> list[str]:
    """The files holding the chunks of the tensor `fqn`, sorted, after checking
    its entry in the metadata file p: a dtype, a shape a tensor can have, and
    chunks of that rank inside the shape, no two of them overlapping, each
    with a place in a file. Fields are read with getattr: a pickle can build
    a record without some of them. (Chunks that leave part of the tensor
    uncovered are found when it is read, as DCP copies fewer elements than
    asked for.)"""
    where = f"{p}: tensor {brief(fqn)}"
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where} has no torch dtype (got {brief(dtype)})")
    size, chunks = getattr(md, "size", None), getattr(md, "chunks", None)
    if not is_size(size) or not isinstance(chunks, list):
        raise CheckpointError(f"{where} has no valid shape and chunk list (got {brief(size)})")
    problem = shape_problem(tuple(size), dtype.itemsize)
    if problem is not None:
        raise CheckpointError(f"{where} {problem}")
    files = set()
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (
            is_size(offsets, len(size))
            and is_size(sizes, len(size))
            and all(o + n <= d for o, n, d in zip(offsets, sizes, size))  # type: ignore[arg-type]
        ):
            raise CheckpointError(f"{where} {tuple(size)} has a chunk outside it ({brief(chunk)})")
        info = storage.get(MetadataIndex(fqn, offsets))
        if not (
            isinstance(info, _StorageInfo)
            and is_file_name(getattr(info, "relative_path", None))
            and all(isinstance(getattr(info, f, None), int) and getattr(info, f) >= 0 for f in ("offset", "length"))
            and is_descriptor_list(getattr(info, "transform_descriptors", None))
        ):
            at = tuple(offsets)  # type: ignore[arg-type]
            raise CheckpointError(f"{where}: its chunk at {at} has no valid place in a file (got {brief(info)})")
        files.add(info.relative_path)
    overlap = first_overlap([(tuple(c.offsets), tuple(c.sizes)) for c in chunks])
    if overlap is not None:
        (a, a_sizes), (b, b_sizes) = overlap
        what = (f"lists its chunk at {a} twice" if (a, a_sizes) == (b, b_sizes)
                else f"has chunks that overlap (at {a} of size {a_sizes} and at {b} of size {b_sizes})")
        # Copies counted per read would still add up to the tensor's size, so
        # the elements read twice would hide those never read.
        raise CheckpointError(f"{where} {tuple(size)} {what}: some of its elements would be read twice, others never")
    return sorted(files)


Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, sizes


def first_overlap(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two of the boxes that share an element, the earlier-listed first, or
    None. A sweep along the dimension where the boxes start at the most
    places (the one a tensor was split along) compares each box only with
    those still open there: about n log n for the chunks of a real
    checkpoint, rather than n**2 comparisons."""
    order = {box: i for i, box in reversed(list(enumerate(boxes)))}  # each box's first listing
    solid = [box for box in boxes if all(n > 0 for n in box[1])]  # an empty box holds no element
    if len(solid) < 2:
        return None
    rank = len(solid[0][0])
    if rank == 0:  # two chunks of a scalar both hold its one element
        return solid[0], solid[1]
    dim = max(range(rank), key=lambda d: len({box[0][d] for box in solid}))
    open_boxes: list[Box] = []
    for box in sorted(solid, key=lambda b: b[0][dim]):
        start = box[0][dim]
        open_boxes = [o for o in open_boxes if o[0][dim] + o[1][dim] > start]
        for other in open_boxes:
            if all(o < b + m and b < o + n for o, n, b, m in zip(other[0], other[1], box[0], box[1])):
                return (other, box) if order[other] <= order[box] else (box, other)
        open_boxes.append(box)
    return None


def is_descriptor_list(value: object) -> bool:
    """None, or the names of the stream transforms a chunk was saved through."""
    return value is None or (isinstance(value, (list, tuple)) and all(isinstance(d, str) for d in value))


# --- reading chunks through DCP ------------------------------------------------
