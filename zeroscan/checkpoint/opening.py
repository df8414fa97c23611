"""Opening a checkpoint: where its format is picked, by what the path is
(a folder, a shard index, a DCP `.metadata`) and by what a file holds (its
first bytes), never by a file's name alone. A folder is opened as what
classifying it found (zeroscan.checkpoint.paths.Folder): a CheckpointPath
from expand_paths carries it, any other folder is classified here.
"""

from __future__ import annotations

import os
from pathlib import Path

from zeroscan.checkpoint.paths import (
    DCP_METADATA,
    INDEX_SUFFIX,
    CheckpointPath,
    Folder,
    classify_folder,
    folder_contents,
    index_shards,
    read_index,
    shard_order,
)
from zeroscan.checkpoint.safetensors_file import looks_like_safetensors, open_safetensors
from zeroscan.checkpoint.sharded import ShardedCheckpoint, assemble
from zeroscan.checkpoint.single import Checkpoint
from zeroscan.checkpoint.table import CheckpointError, TensorTable, checked_path, regular_file_size
from zeroscan.checkpoint.torch_file import looks_like_torch, open_torch
def open_checkpoint(path: str | os.PathLike[str]) -> TensorTable:
    """Opens a checkpoint: a torch.save file or a .safetensors file
    (recognised by content, not by name); a sharded model's folder or its
    index file (zeroscan.checkpoint.sharded); a torch.distributed.checkpoint
    folder or its `.metadata` file (zeroscan.checkpoint.dcp). Each has the
    same interface: entries, entry(), read(), scan_items(), close(). Raises
    CheckpointError with a one-line reason."""
    p = checked_path("zeroscan.open_checkpoint", "path", path)
    if isinstance(path, CheckpointPath) and path.folder is not None:
        return open_folder(path.folder)
    if p.is_dir():
        return open_folder(classify_folder(p))
    if p.name.endswith(INDEX_SUFFIX) and p.is_file():
        return open_index(p)
    if p.name == DCP_METADATA and p.is_file():  # the DCP checkpoint alone, in a folder holding others too
        from zeroscan.checkpoint.dcp import open_dcp  # torch.distributed.checkpoint: imported only for a DCP folder

        return open_dcp(p.parent)
    return open_file(p)


def open_folder(folder: Folder) -> TensorTable:
    """A folder that is one checkpoint (Folder.kind), opened as its model;
    any other folder is a CheckpointError."""
    if folder.kind is not None:
        return open_model(folder)
    if folder.model == "index":
        # Its index's own errors (a shard unreadable) first: they say more than its other checkpoints.
        open_model(folder).close()
    p = folder.path
    inside = folder_contents(folder, {p: folder})
    if not inside:
        raise CheckpointError(f"{p}: is a folder holding no checkpoint (no shard index, .metadata or checkpoint file)")
    names = ", ".join(os.path.relpath(c, p) for c in inside[:4])
    names += f" and {len(inside) - 4} more" if len(inside) > 4 else ""
    raise CheckpointError(
        f"{p}: is a folder of {len(inside)} separate checkpoints ({names}), not one; name one of them "
        "(`zeroscan scan` scans each of a folder's checkpoints)"
    )


def open_model(folder: Folder) -> TensorTable:
    """The model a folder's own files make (Folder.model), from the files and
    the index that classifying the folder found."""
    if folder.model == "dcp":
        from zeroscan.checkpoint.dcp import open_dcp  # torch.distributed.checkpoint: imported only for a DCP folder

        return open_dcp(folder.path)
    if folder.model == "index" and folder.model_path is not None:
        return open_sharded(folder.model_path, list(folder.reads), folder.weight_map, folder.model_path.name)
    if folder.model == "shards":
        return open_shards(folder.path, list(folder.reads))
    if folder.model == "single":
        return open_file(folder.reads[0])
    raise CheckpointError(f"{folder.path}: holds no model (no shard index, .metadata or checkpoint file)")


def open_file(p: Path) -> Checkpoint:
    """A torch.save or .safetensors file, told apart by content: a file is
    read as what it holds, whatever its name says (a torch.save file named
    model.safetensors, a safetensors file named model.bin). Only a file that
    is neither by its first bytes is read as its name says, so that a damaged
    .safetensors file is named as one."""
    size = regular_file_size(p)
    try:
        with open(p, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
    if size == 0:
        raise CheckpointError(f"{p}: empty file, not a checkpoint")
    if looks_like_safetensors(head, size):
        return open_safetensors(p)
    if looks_like_torch(head) or p.suffix != ".safetensors":
        return open_torch(p)
    return open_safetensors(p)


def open_shards(folder: Path, files: list[Path]) -> ShardedCheckpoint:
    """The complete set of shard files `files` (NAME-0000k-of-0000n.EXT), without an index."""
    ordered = sorted(files, key=lambda f: shard_order(f.name))
    return open_sharded(folder, ordered, weight_map=None, index_name="")


def open_index(index: Path) -> ShardedCheckpoint:
    """The shards of the model an index file (model.safetensors.index.json) describes, beside it (index_shards)."""
    weight_map = read_index(index)
    return open_sharded(index, index_shards(index, weight_map), weight_map, index.name)


def open_sharded(path: Path, files: list[Path], weight_map: dict[str, str] | None, index_name: str) -> ShardedCheckpoint:
    """Opens each shard (open_file) and lists their tensors as one checkpoint."""
    shards: list[Checkpoint] = []
    try:
        for f in files:
            shards.append(open_file(f))
    except BaseException:
        for s in shards:
            s.close()
        raise
    return assemble(path, files, shards, weight_map, index_name)
