"""A model saved as several checkpoint files, read as one table of tensors.

A Hugging Face model of more than a few GB is a folder of shards,
`model-00001-of-00004.safetensors` ... `model-00004-of-00004.safetensors`,
and an index, `model.safetensors.index.json`, whose "weight_map" names the
shard of every tensor (`pytorch_model-0000k-of-0000n.bin` and
`pytorch_model.bin.index.json` for torch.save shards). A ShardedCheckpoint
holds every shard, opened by zeroscan.checkpoint.opening (each a
zeroscan.checkpoint.single.Checkpoint: its header or pickle only, no tensor
data), and lists their tensors as one checkpoint, in shard order and within
a shard in file order, each with its shard's name.

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

from collections.abc import Iterator
from pathlib import Path

import torch

from zeroscan.checkpoint.files import ScanSource
from zeroscan.checkpoint.single import Checkpoint
from zeroscan.checkpoint.table import TensorEntry, TensorTable


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


def assemble(path: Path, files: list[Path], shards: list[Checkpoint], weight_map: dict[str, str] | None,
             index_name: str) -> ShardedCheckpoint:
    """The opened shard files as one checkpoint, as the index (if any) says."""
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
