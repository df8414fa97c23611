"""What the paths given to `zeroscan scan` name: checkpoint files, model
folders, torch.distributed.checkpoint folders, plain folders and globs.

A large model's checkpoint is rarely one file. A folder is one checkpoint
when it is one of these (checkpoint_kind):

* a torch.distributed.checkpoint (DCP) folder: a `.metadata` file beside
  `__R_K.distcp` files;
* a sharded model: an index file (`model.safetensors.index.json`,
  `pytorch_model.bin.index.json`) naming the shard of every tensor, or,
  without one, the complete set of shards `NAME-0000k-of-0000n.EXT`;
* a folder holding a single checkpoint file (a model folder with one
  `model.safetensors` beside its config).

Any other folder is a plain folder of separate checkpoints, which
expand_paths lists one by one (with the checkpoint folders directly inside
it, such as one per saved step).
"""

from __future__ import annotations

import glob
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
INDEX_SUFFIX = ".index.json"
DCP_METADATA = ".metadata"
# The shard files' names: model-00002-of-00005.safetensors, pytorch_model-00001-of-00002.bin
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d+)-of-(?P<count>\d+)(?P<suffix>\.[A-Za-z]+)$")
GLOB_CHARS = frozenset("*?[")


def is_regular_file(p: Path) -> bool:
    try:
        return stat.S_ISREG(p.stat().st_mode)
    except OSError:
        return False


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoint files directly in `folder` (by suffix), sorted by name."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [folder / n for n in names if n.endswith(CHECKPOINT_SUFFIXES) and is_regular_file(folder / n)]


def index_files(folder: Path) -> list[Path]:
    """The shard index files in `folder`, a safetensors one first: a Hugging
    Face folder often holds both model.safetensors.index.json and
    pytorch_model.bin.index.json, for the same weights in two formats."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = [folder / n for n in names if n.endswith(INDEX_SUFFIX) and is_regular_file(folder / n)]
    return sorted(found, key=lambda p: not p.name.endswith(".safetensors" + INDEX_SUFFIX))


ShardSet = tuple[Path, str, str, str]  # folder, NAME, n as written ("00003"), EXT


def shard_sets(files: Sequence[Path]) -> dict[ShardSet, dict[int, Path]]:
    """Files named NAME-0000k-of-0000n.EXT grouped by (folder, NAME, n, EXT):
    {group: {k: file}}."""
    groups: dict[ShardSet, dict[int, Path]] = {}
    for f in files:
        m = SHARD_NAME.match(f.name)
        if m and m["suffix"] in CHECKPOINT_SUFFIXES:
            key = (f.parent, m["stem"], m["count"], m["suffix"])
            groups.setdefault(key, {})[int(m["index"])] = f
    return groups


def complete(key: ShardSet, shards: dict[int, Path]) -> bool:
    return sorted(shards) == list(range(1, int(key[2]) + 1))


def checkpoint_kind(folder: Path) -> str | None:
    """What the folder is as one checkpoint: "dcp", "index", "shards" (a
    complete set of shard files without an index) or "single" (one checkpoint
    file); None for a plain folder of separate checkpoints. A folder holding
    some shards of a model but not all, and no index, is a CheckpointError:
    scanning the shards there would pass over the missing ones in silence."""
    if is_regular_file(folder / DCP_METADATA):
        return "dcp"
    if index_files(folder):
        return "index"
    files = checkpoint_files(folder)
    groups = shard_sets(files)
    for key, shards in groups.items():
        if not complete(key, shards):
            from zeroscan.checkpoint import CheckpointError

            missing = [k for k in range(1, int(key[2]) + 1) if k not in shards]
            listed = ", ".join(map(str, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointError(
                f"{folder}: shard {listed} of {key[1]}-*-of-{key[2]}{key[3]} is missing "
                f"({len(shards)} of {int(key[2])} present)"
            )
    if len(groups) == 1:
        (key, shards), = groups.items()
        if complete(key, shards) and len(shards) == len(files):
            return "shards"
    if len(files) == 1:
        return "single"
    return None


def expand_paths(paths: Sequence[str]) -> list[str]:
    """The checkpoints that `paths` name, each a path open_checkpoint opens,
    in the order given:

    * a file is itself, and a folder that is one checkpoint (checkpoint_kind)
      itself;
    * any other folder is its checkpoint files and the checkpoint folders
      directly inside it, by name;
    * a pattern with * ? or [ that names no existing path is the paths it
      matches, by name, each expanded as above;
    * the complete set of one model's shard files, all named (say by
      `dir/*.safetensors`), is their folder when the folder is that model.

    Raises CheckpointError for a pattern that matches nothing and for a folder
    that holds no checkpoint; anything else wrong with a path is reported
    when it is opened."""
    from zeroscan.checkpoint import CheckpointError

    out: list[str] = []
    for text in paths:
        if GLOB_CHARS & set(text) and not os.path.lexists(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise CheckpointError(f"{text}: matches no file")
            out.extend(grouped(matches))
        elif os.path.isdir(text) and checkpoint_kind(Path(text)) is None:
            inside = folder_contents(Path(text))
            if not inside:
                raise CheckpointError(
                    f"{text}: holds no checkpoint (no {', '.join(CHECKPOINT_SUFFIXES)} file, "
                    f"shard index or {DCP_METADATA})"
                )
            out.extend(inside)
        else:
            out.append(text)
    return out


def folder_contents(folder: Path) -> list[str]:
    """A plain folder's checkpoints: its files (shard sets as one) and its
    sub-folders that are checkpoints, by name."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        from zeroscan.checkpoint import CheckpointError

        raise CheckpointError(f"{folder}: cannot list ({e.strerror or e})") from None
    entries = []
    for n in names:
        p = folder / n
        if n.endswith(CHECKPOINT_SUFFIXES) and is_regular_file(p):
            entries.append(str(p))
        elif p.is_dir() and checkpoint_kind(p) is not None:
            entries.append(str(p))
    return grouped(entries)


def grouped(paths: Sequence[str]) -> list[str]:
    """`paths` with each complete set of one model's shards replaced by their
    folder, where the folder opens as exactly that model; the rest as given."""
    files = [Path(p) for p in paths]
    replace: dict[Path, str] = {}
    for key, shards in shard_sets([f for f in files if is_regular_file(f)]).items():
        folder = key[0]
        if complete(key, shards) and checkpoint_kind(folder) in ("shards", "index"):
            if checkpoint_kind(folder) == "index" or len(checkpoint_files(folder)) == len(shards):
                for f in shards.values():
                    replace[f] = str(folder)
    out: list[str] = []
    for p, f in zip(paths, files):
        target = replace.get(f, p)
        if target not in out or target == p:
            out.append(target)
    return out
