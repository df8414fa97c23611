"""A model saved as several checkpoint files, read as one table of tensors.

A Hugging Face model of more than a few GB is a folder of shards,
`model-00001-of-00004.safetensors` ... `model-00004-of-00004.safetensors`,
and an index, `model.safetensors.index.json`, whose "weight_map" names the
shard of every tensor (`pytorch_model-0000k-of-0000n.bin` and
`pytorch_model.bin.index.json` for torch.save shards). A ShardedCheckpoint
opens every shard (each a zeroscan.checkpoint.Checkpoint: its header or
pickle only, no tensor data) and lists their tensors as one checkpoint,
in shard order and within a shard in file order, each with its shard's name.

Without an index, the complete set of shards is the model. With one, the
index decides: a tensor it names that its shard lacks is reported (severity
error, as a model loader would fail on it), a copy of a tensor in a shard the
index does not name for it is left out with the reason, and a tensor only the
shards know is scanned. The shards are those the index names and the other
members of their sets present beside them (an index naming shards 1 and 2 of
model-*-of-00003 while shard 3 is there): a shard of the model is never passed
over because its index forgot it. An index naming no tensor is an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from zeroscan.checkpoint import Checkpoint, CheckpointError, TensorEntry, TensorTable, open_file, regular_file_size
from zeroscan.checkpoint_paths import SHARD_NAME, checkpoint_files, shard_sets
from zeroscan.checkpoint_reads import ScanSource
from zeroscan.safetensors_io import brief

MAX_INDEX_BYTES = 256 << 20  # an index of a million tensor names is about 100 MB


class ShardedCheckpoint(TensorTable):
    """Several checkpoint files as one: entries, entry(), read(), scan_items()
    and close() as a Checkpoint's, each delegated to the tensor's shard."""

    def __init__(self, path: Path, shards: list[Checkpoint], skipped: list[dict[str, object]],
                 owner: dict[str, Checkpoint], entries: list[TensorEntry]) -> None:
        self.path = path  # the folder, or the index file when opened by it
        formats = sorted({s.format for s in shards})
        self.format = "+".join(formats) + "-sharded"  # "safetensors-sharded", "torch-sharded"
        self.shards = len(shards)
        self.metadata: dict[str, str] = {}
        self.skipped = skipped
        self.entries = entries
        self._shards = shards
        self._owner = owner
        self.index_entries()

    def read(self, name: str) -> torch.Tensor:
        self.entry(name)
        return self._owner[name].read(name)

    def tensor(self, name: str) -> torch.Tensor:
        self.entry(name)
        return self._owner[name].tensor(name)

    def scan_items(self, batch_bytes: int) -> Iterator[tuple[TensorEntry, ScanSource]]:
        """Each shard's scan items in turn, those of the tensors this checkpoint lists."""
        for shard in self._shards:
            for entry, source in shard.scan_items(batch_bytes):
                if self._owner.get(entry.name) is shard:
                    yield self._by_name[entry.name], source

    def close(self) -> None:
        for shard in self._shards:
            shard.close()

    def __repr__(self) -> str:
        return f"ShardedCheckpoint({str(self.path)!r}, {self.shards} shards, {len(self)} tensors)"


def open_shards(folder: Path, files: list[Path]) -> ShardedCheckpoint:
    """The complete set of shard files `files` (NAME-0000k-of-0000n.EXT), without an index."""
    ordered = sorted(files, key=lambda f: shard_order(f.name))
    return assemble(folder, ordered, weight_map=None, index_name="")


def open_index(index: Path) -> ShardedCheckpoint:
    """The shards of the model an index file (model.safetensors.index.json) describes, beside it (index_shards)."""
    weight_map = read_index(index)
    return assemble(index, index_shards(index, weight_map), weight_map, index.name)


def index_shards(index: Path, weight_map: dict[str, str]) -> list[Path]:
    """The files of the index's model, in shard order: those its weight_map
    names, and the other members of each shard set it names
    (NAME-0000k-of-0000n.EXT) that are present in its folder. A file it names
    that is missing is a CheckpointError."""
    folder = index.parent
    names = set(weight_map.values())
    for name in sorted(names):
        if not (folder / name).exists():
            holds = sum(1 for v in weight_map.values() if v == name)
            raise CheckpointError(f"{index}: names shard {name!r} (for {holds} tensors), which is missing")
    # From the folder's listing, not by trying each k up to n: n is the
    # index's word, and "-of-10000000000" must not mean ten billion stat calls.
    named = {(m["stem"], m["count"], m["suffix"]) for n in names if (m := SHARD_NAME.match(n))}
    for (_, stem, count, suffix), members in shard_sets(checkpoint_files(folder)).items():
        if (stem, count, suffix) in named:
            names.update(f.name for f in members.values())
    return [folder / n for n in sorted(names, key=shard_order)]


def shard_order(name: str) -> tuple[int, str]:
    """A shard file's place among its model's: k of NAME-0000k-of-0000n.EXT, then its name."""
    m = SHARD_NAME.match(name)
    return (int(m["index"]) if m else 0), name


def read_index(index: Path) -> dict[str, str]:
    """The index's weight_map {tensor name: shard file name}, checked: every
    shard a plain file name in the index's folder (an index is a file from
    elsewhere, and "../../secret" or "/dev/zero" must not be opened)."""
    size = regular_file_size(index)
    if size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{index}: a {size:,}-byte shard index, larger than the {MAX_INDEX_BYTES:,} read")
    try:
        doc = json.loads(index.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{index}: not a shard index (not JSON: {str(e).splitlines()[0][:200]})") from None
    except OSError as e:
        raise CheckpointError(f"{index}: cannot read ({e.strerror or e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: not a shard index (no \"weight_map\" object of tensor names to files)")
    if not weight_map:
        # A scan of it would read nothing and pass, whatever its folder's shards hold.
        beside = [f.name for f in checkpoint_files(index.parent)]
        files = f"{len(beside)} checkpoint file{'s' if len(beside) > 1 else ''}"
        held = f"; its folder holds {files} it does not name ({brief(beside)})" if beside else ""
        raise CheckpointError(f"{index}: names no tensor (its \"weight_map\" is empty){held}")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index}: weight_map[{name!r}] is {type(file).__name__}, not a file name")
        if file in ("", ".", "..") or "/" in file or "\\" in file or "\0" in file:
            raise CheckpointError(
                f"{index}: weight_map[{name!r}] is {file!r}, not a file name in the index's folder"
            )
    return weight_map


def assemble(path: Path, files: list[Path], weight_map: dict[str, str] | None, index_name: str) -> ShardedCheckpoint:
    """Opens each shard and lists their tensors as one checkpoint."""
    shards: list[Checkpoint] = []
    try:
        for f in files:
            shards.append(open_file(f))
    except BaseException:
        for s in shards:
            s.close()
        raise
    owner: dict[str, Checkpoint] = {}
    entries: list[TensorEntry] = []
    skipped: list[dict[str, object]] = []
    for f, shard in zip(files, shards):
        for e in shard.entries:
            named = weight_map.get(e.name) if weight_map is not None else None
            if named is not None and named != f.name:
                skipped.append(skip_row(e, f.name, f"a copy the index does not use: {index_name} names "
                                                   f"shard {named!r} for it", "info"))
                continue
            if e.name in owner:
                first = owner[e.name].path.name
                skipped.append(skip_row(e, f.name, f"also in shard {first!r}, which is the one scanned", "warning"))
                continue
            owner[e.name] = shard
            entries.append(TensorEntry(e.name, e.dtype, e.shape, e.nbytes, f.name))
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in owner:
                skipped.append({"name": name, "dtype": "", "shape": [], "shard": file, "severity": "error",
                                "reason": f"{index_name} names shard {file!r} for it, which does not hold it"})
    return ShardedCheckpoint(path, shards, skipped, owner, entries)


def skip_row(e: TensorEntry, shard: str, reason: str, severity: str) -> dict[str, object]:
    return {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "shard": shard, "reason": reason,
            "severity": severity}
