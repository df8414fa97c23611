"""Reading torch.distributed.checkpoint (DCP) folders tensor by tensor.

FSDP2 and torchtitan save a folder: a `.metadata` pickle that gives every
tensor's dtype, shape and chunks (a shard of a DTensor is one chunk) and
where each chunk lies, beside `__R_K.distcp` files that hold the chunks,
each chunk a small torch.save archive.

torch's FileSystemReader.read_metadata unpickles `.metadata` with plain
pickle.load, which runs whatever a hostile file asks for. So zeroscan
unpickles it itself, allowing only the classes DCP metadata is made of
(METADATA_GLOBALS), and hands the result to the reader. Chunks are read
through DCP's own FileSystemReader, which loads each with
torch.load(weights_only=True), and a LoadPlanner that asks for any box of a
tensor, a whole tensor or a block of its rows (create_read_items_for_chunk_list).
Items DCP stored as bytes (an optimizer's step count, a config) are pickles
that DCP's planners load with weights_only=False: they are never asked for,
and are left out of the entries as a torch.save file's non-tensor leaves are.

A scan holds a batch of tensors at a time, and a tensor larger than a batch
one block of rows at a time. But DCP's reader loads a whole stored chunk for
every request that touches it, then copies the requested box out of it: a
block costs, while it is read, the memory and the read of the chunks it
touches, so a tensor saved as one chunk far larger than a batch is read once
per block.

Every problem with the folder raises CheckpointError, one line naming the
file: `.metadata` on opening, a `.distcp` file when a tensor is read.
"""

from __future__ import annotations

import importlib
import io
import math
import os
import pathlib
import pickle
import stat
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from zeroscan.checkpoint import CheckpointError, TensorEntry, TensorTable, dtype_name, dtype_skip_reason
from zeroscan.checkpoint_reads import (
    ScanSource,
    TensorPiece,
    changed_while_scanned,
    same_file,
    shape_problem,
)
from zeroscan.safetensors_io import brief
from zeroscan.torch_io import one_line, refused_pickle

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


class Region(NamedTuple):
    """A box of one tensor: the whole tensor, or a block of its rows."""

    fqn: str
    dtype: torch.dtype
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class RegionPlanner(LoadPlanner):
    """A LoadPlanner that reads boxes of tensors (Region) into fresh tensors
    of the boxes' shapes; it never asks for an item stored as bytes. DCP
    gives each read item's place relative to the box it was planned for."""

    def __init__(self, regions: list[Region]) -> None:
        self.regions = regions
        self.out = {r.fqn: torch.empty(r.sizes, dtype=r.dtype) for r in regions}
        self.filled = dict.fromkeys(self.out, 0)  # elements copied in, to find boxes the chunks do not cover

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        assert metadata is not None
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for r in self.regions:
            md = self.metadata.state_dict_metadata[r.fqn]
            assert isinstance(md, TensorStorageMetadata)
            box = ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=torch.Size(r.sizes))
            items += create_read_items_for_chunk_list(r.fqn, md, [box])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError(f"zeroscan never asks for bytes items, but got {read_item.dest_index.fqn!r}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.out[read_item.dest_index.fqn]
        for dim, (at, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, at, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.filled[read_item.dest_index.fqn] += tensor.numel()


class FileSlice(io.RawIOBase):
    """Bytes [start, start + length) of an open file as a file of their own:
    a chunk's torch.save archive, for zipfile to list."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self.pos, self.length)[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def check_archive(p: Path, fd: int, info: _StorageInfo) -> None:
    """The chunk's torch.save archive must store its entries uncompressed,
    each inside the chunk: torch.load inflates a compressed entry whole into
    memory, and a few bytes could inflate to any size. torch.save never
    compresses."""
    where = f"{p}: the chunk at byte {info.offset:,}"
    try:
        with zipfile.ZipFile(FileSlice(fd, info.offset, info.length)) as z:
            infos = z.infolist()
    except Exception as e:  # zipfile raises several types for a damaged archive
        raise CheckpointError(f"{where} is not a torch.save archive ({one_line(e)})") from None
    for entry in infos:
        if entry.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"{where} holds a compressed entry {brief(entry.filename)} ({entry.compress_size:,} bytes that "
                f"inflate to {entry.file_size:,}); torch.save never compresses, and zeroscan refuses what could "
                "inflate to any size"
            )
        if entry.file_size != entry.compress_size or entry.header_offset + entry.compress_size > info.length:
            raise CheckpointError(f"{where} declares an entry of {entry.file_size:,} bytes that does not fit it")


class MetadataReader(FileSystemReader):
    """DCP's FileSystemReader, given the metadata zeroscan unpickled, so its
    own pickle.load never runs. Before DCP reads a file, the file is checked
    (a regular file, holding every chunk asked of it, each chunk an
    uncompressed archive), and DCP reads one file at a time so that an error
    names the file. A file that changes after the checkpoint was opened (its
    size or time) is an error naming it, as a changed checkpoint file is."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self.folder = path
        self.metadata = metadata
        self.opened: dict[str, os.stat_result | None] = {}  # file name: its stat on opening; None: absent
        names = {getattr(info, "relative_path", None) for info in metadata.storage_data.values()}
        for name in filter(is_file_name, names):  # only those checked to name a file in the folder
            try:
                st = os.stat(path / name)
            except OSError:  # absent or unreadable: said when a tensor is read from it
                self.opened[name] = None
            else:
                self.opened[name] = st

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            p = self.folder / name
            self.check_file(p, [self.storage_data[i.storage_index] for i in items])
            try:
                with warnings.catch_warnings():  # torch's, about the chunk: never to stderr (zeroscan.torch_io)
                    warnings.simplefilter("ignore")
                    super().read_data(LoadPlan(items), planner).wait()
            except Exception as e:  # torch.load and DCP raise many types for a damaged chunk
                self.check_unchanged(p)
                tensors = brief(sorted({i.dest_index.fqn for i in items}))
                refused = isinstance(e, pickle.UnpicklingError) and "GLOBAL" in str(e)
                why = refused_pickle(str(e)) if refused else one_line(e)
                raise CheckpointError(f"{p}: cannot read the chunks of {tensors} ({why})") from None
            self.check_unchanged(p)  # rewritten in place while it was read: the chunks may mix two saves
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def check_file(self, p: Path, infos: list[_StorageInfo]) -> None:
        if any(info.transform_descriptors for info in infos):
            kinds = sorted({d for info in infos for d in info.transform_descriptors or ()})
            raise CheckpointError(
                f"{p}: chunks stored through {brief(kinds)}; zeroscan reads untransformed DCP files only "
                "(a compressed stream could inflate to any size)"
            )
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO does not wait for a writer
        except FileNotFoundError:
            raise CheckpointError(f"{p}: no such file (the metadata places chunks there)") from None
        except OSError as e:
            raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{p}: not a regular file; zeroscan reads checkpoint files only")
            self.check_unchanged(p, st)
            end = max(info.offset + info.length for info in infos)
            if st.st_size < end:
                raise CheckpointError(
                    f"{p}: truncated ({st.st_size:,} bytes, but the metadata places chunks up to byte {end:,})"
                )
            for info in {(i.offset, i.length): i for i in infos}.values():
                check_archive(p, fd, info)
        finally:
            os.close(fd)

    def check_unchanged(self, p: Path, st: os.stat_result | None = None) -> None:
        """Raises the error of a checkpoint file that changed while it was
        scanned if p's size or time differ from those it had on opening."""
        was = self.opened.get(p.name)
        if was is None:  # absent on opening: checked as it is now
            return
        if st is None:
            try:
                st = os.stat(p)
            except OSError:
                return  # gone: the read that follows says so
        if not same_file(was, st):
            raise CheckpointError(changed_while_scanned(p, st, was))


# --- the checkpoint --------------------------------------------------------------


class DcpCheckpoint(TensorTable):
    """An opened DCP folder: its tensor entries in the metadata's order, each
    tensor read on demand through DCP. Only `.metadata` is read on opening."""

    def __init__(self, path: Path, metadata: Metadata, entries: list[TensorEntry]) -> None:
        self.path = path
        self.format = "dcp"
        self.entries = entries
        self.metadata: dict[str, str] = {}
        self.skipped: list[dict[str, object]] = []  # problems found on opening: none that leave a tensor out
        self.shards = len({f for e in entries for f in e.shard.split(",") if f})  # .distcp files
        self.index_entries()
        self._dcp = metadata
        self._reader: MetadataReader | None = MetadataReader(path, metadata)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, in memory."""
        self.entry(name)
        return self.load([self.region(name)])[0]

    def tensor(self, name: str) -> torch.Tensor:
        """read(name): DCP maps nothing, so there is no lighter way to give it."""
        return self.read(name)

    def scan_items(self, batch_bytes: int) -> Iterator[tuple[TensorEntry, ScanSource]]:
        """Each entry in the metadata's order with what scan_checkpoint scans:
        the tensor read into memory, a TensorPiece of one too large for a
        batch, or the reason it is not scanned. Tensors are read a batch of
        up to `batch_bytes` at a time, one DCP read per batch, and a batch is
        given out before the next is read; a tensor larger than a batch is
        read a block of rows at a time (blocks)."""
        pending: list[tuple[TensorEntry, str | None]] = []  # a skip reason, or None for a tensor to read
        pending_bytes = 0
        for e in self.entries:
            reason = dtype_skip_reason(e.dtype)
            if reason is None and e.nbytes > batch_bytes:
                yield from self.read_batch(pending)
                pending, pending_bytes = [], 0
                yield from self.read_pieces(e, batch_bytes)
                continue
            if reason is None and pending_bytes + e.nbytes > batch_bytes:
                yield from self.read_batch(pending)
                pending, pending_bytes = [], 0
            pending.append((e, reason))
            pending_bytes += e.nbytes if reason is None else 0
        yield from self.read_batch(pending)

    def read_batch(self, items: list[tuple[TensorEntry, str | None]]) -> Iterator[tuple[TensorEntry, ScanSource]]:
        regions = [self.region(e.name) for e, reason in items if reason is None]
        tensors = iter(self.load(regions) if regions else [])
        for e, reason in items:
            yield e, reason if reason is not None else next(tensors)

    def read_pieces(self, e: TensorEntry, batch_bytes: int) -> Iterator[tuple[TensorEntry, TensorPiece]]:
        whole = self.region(e.name)
        itemsize = whole.dtype.itemsize
        count = block_count(e.shape, itemsize, batch_bytes)
        for index, (offsets, sizes) in enumerate(blocks(e.shape, itemsize, batch_bytes)):
            block = self.load([whole._replace(offsets=offsets, sizes=sizes)])[0]
            yield e, TensorPiece(block, index, count, e.shape)

    def region(self, name: str) -> Region:
        md = self._dcp.state_dict_metadata[name]
        assert isinstance(md, TensorStorageMetadata)
        return Region(name, md.properties.dtype, (0,) * len(md.size), tuple(md.size))

    def load(self, regions: list[Region]) -> list[torch.Tensor]:
        """The boxes `regions` (of distinct tensors), read with one DCP read,
        the steps of torch's load_state_dict in one process."""
        reader = self._reader
        if reader is None:
            raise CheckpointError(f"{self.path}: the checkpoint is closed")
        try:
            planner = RegionPlanner(regions)
        except RuntimeError as e:  # a dtype torch cannot hold, or a box too large for memory
            names = brief([r.fqn for r in regions])
            raise CheckpointError(f"{self.path}: cannot hold {names} in memory ({one_line(e)})") from None
        metadata = reader.read_metadata()
        planner.set_up_planner({}, metadata, is_coordinator=True)
        reader.set_up_storage_reader(metadata, True)
        local = reader.prepare_local_plan(planner.create_local_plan())
        plans = reader.prepare_global_plan(planner.create_global_plan([local]))
        reader.read_data(planner.finish_plan(plans[0]), planner).wait()
        for r in regions:
            want = math.prod(r.sizes)
            if planner.filled[r.fqn] != want:
                raise CheckpointError(
                    f"{self.path / METADATA_FILE}: the chunks of tensor {brief(r.fqn)} give "
                    f"{planner.filled[r.fqn]:,} elements of the {want:,} asked for (chunks missing; overlaps are refused at open)"
                )
        return [planner.out[r.fqn] for r in regions]

    def close(self) -> None:
        self._reader = None

    def __repr__(self) -> str:
        return f"DcpCheckpoint({str(self.path)!r}, {len(self)} tensors in {self.shards} files)"


def block_count(shape: tuple[int, ...], itemsize: int, budget: int) -> int:
    """How many boxes blocks() cuts a tensor of `shape` into."""
    if not shape:
        return 1
    row = math.prod(shape[1:]) * itemsize
    if row <= budget or len(shape) == 1:
        return -(-shape[0] // max(1, budget // row))
    return shape[0] * block_count(shape[1:], itemsize, budget)


def blocks(shape: tuple[int, ...], itemsize: int, budget: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of boxes of at most `budget` bytes (or one element)
    that cover a tensor of `shape` in C order: blocks of whole rows, or,
    where one row is larger than the budget, each row cut the same way."""
    if not shape:
        yield (), ()
        return
    row = math.prod(shape[1:]) * itemsize
    if row <= budget or len(shape) == 1:
        step = max(1, budget // row)
        for begin in range(0, shape[0], step):
            yield (begin, *(0,) * (len(shape) - 1)), (min(step, shape[0] - begin), *shape[1:])
        return
    for i in range(shape[0]):
        for offsets, sizes in blocks(shape[1:], itemsize, budget):
            yield (i, *offsets), (1, *sizes)


def looks_like_dcp(path: Path) -> bool:
    """A folder holding a regular file `.metadata` (decided by stat alone)."""
    try:
        return stat.S_ISDIR(path.stat().st_mode) and stat.S_ISREG((path / METADATA_FILE).stat().st_mode)
    except OSError:
        return False


def open_dcp(path: Path) -> DcpCheckpoint:
    """Opens the DCP folder `path`, reading its `.metadata` once. Raises
    CheckpointError with a one-line reason naming the path."""
    if not looks_like_dcp(path):
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint folder (no regular file {METADATA_FILE})")
    p = path / METADATA_FILE
    md = read_metadata(p)
    storage = md.storage_data
    entries = []
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise CheckpointError(f"{p}: not DCP metadata (a key {brief(fqn)} that is not a name)")
        if isinstance(item, BytesStorageMetadata):
            continue  # a pickled object: never read, as a torch file's non-tensor leaves are left out
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"{p}: not DCP metadata ({brief(fqn)} is a {type(item).__name__})")
        files = tensor_files(p, fqn, item, storage)
        dtype = item.properties.dtype
        shape = tuple(item.size)
        entries.append(TensorEntry(fqn, dtype_name(dtype), shape, math.prod(shape) * dtype.itemsize, ",".join(files)))
    return DcpCheckpoint(path, md, entries)
