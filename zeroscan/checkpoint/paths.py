"""What the paths given to `zeroscan scan` name: checkpoint files, model
folders, torch.distributed.checkpoint folders, plain folders and globs.

A large model's checkpoint is rarely one file. A folder's own files make
one model when they are one of these (model_kind):

* a torch.distributed.checkpoint (DCP) folder: a `.metadata` file beside
  `__R_K.distcp` files;
* a sharded model: an index file (`model.safetensors.index.json`,
  `pytorch_model.bin.index.json`) naming the shard of every tensor, or,
  without one, the complete set of shards `NAME-0000k-of-0000n.EXT`;
* a folder holding a single checkpoint file (a model folder with one
  `model.safetensors` beside its config).

The folder is that one checkpoint (Folder.kind) only when nothing else
in it is or holds a checkpoint: no checkpoint file the model does not read
(an optimizer.pt beside an index, a shard the index does not name) and no
sub-folder holding checkpoints (step_100/ beside llama.pt). Any other folder
is a plain folder of separate checkpoints, which expand_paths lists one by
one: its model by the path that opens it alone (the index file, the DCP
`.metadata`), its other checkpoint files, its checkpoint folders, and what
its plain sub-folders hold, at any depth. A folder is scanned whole, never
in part; the one exception is a model saved in two formats, each with its
index, whose safetensors copy alone is read (index_files). So a folder
holding, at any depth, an entry named like a checkpoint that is no regular
file (a FIFO, a socket, a device, a link to nothing) is refused with a
CheckpointError naming every such entry of its folder, as the entry alone
would be refused (refuse_unreadable_entries).

What a folder is, is worked out once (classify_folder: a Folder) and handed
on: expand_paths gives each checkpoint folder it finds as a CheckpointPath
carrying its Folder, which open_checkpoint opens without classifying it
again.
"""

from __future__ import annotations

import glob
import json
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zeroscan.checkpoint.table import SPECIAL_FILE_KINDS, CheckpointError, regular_file_size
from zeroscan.words import brief

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
INDEX_SUFFIX = ".index.json"
DCP_METADATA = ".metadata"
# The shard files' names: model-00002-of-00005.safetensors, pytorch_model-00001-of-00002.bin
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d+)-of-(?P<count>\d+)(?P<suffix>\.[A-Za-z]+)$")
GLOB_CHARS = frozenset("*?[")
MAX_INDEX_BYTES = 256 << 20  # an index of a million tensor names is about 100 MB


def named_like_checkpoint(name: str) -> bool:
    """Whether a folder entry's name is a checkpoint file's, a shard index's or a DCP `.metadata`."""
    return name.endswith(CHECKPOINT_SUFFIXES + (INDEX_SUFFIX,)) or name == DCP_METADATA


def unreadable_entries(folder: Path) -> list[str]:
    """The entries of `folder` named like a checkpoint (named_like_checkpoint)
    that are neither a regular file nor a folder, each as "NAME (what it
    is)": a FIFO, a socket, a device, a link to nothing. Decided by stat()
    alone: nothing is opened (a FIFO would wait for a writer forever). A
    folder that cannot be listed holds none here: listing it fails where
    its checkpoints are looked for."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for n in names:
        if not named_like_checkpoint(n):
            continue
        try:
            mode = (folder / n).stat().st_mode
        except FileNotFoundError:
            found.append(f"{n} (a link to nothing)")
            continue
        except OSError as e:
            found.append(f"{n} (cannot be looked at: {e.strerror or e})")
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = next((name for test, name in SPECIAL_FILE_KINDS if test(mode)), "special file")
            found.append(f"{n} (a link to a {kind})" if (folder / n).is_symlink() else f"{n} (a {kind})")
    return found


def refuse_unreadable_entries(folder: Path) -> None:
    """Raises CheckpointError naming every entry of `folder` that is named like
    a checkpoint but cannot be read as one (unreadable_entries): a scan of the
    rest would pass over them in silence."""
    found = unreadable_entries(folder)
    if not found:
        return
    listed = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
    what = (
        "is named like a checkpoint but is not a regular file"
        if len(found) == 1
        else "are named like checkpoints but are not regular files"
    )
    raise CheckpointError(
        f"{folder}: {listed} {what}; zeroscan reads checkpoint files only, and scans a folder whole or not at all"
    )


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


@dataclass(frozen=True)
class Folder:
    """What a folder holds, worked out once (classify_folder) and handed to
    whatever lists its checkpoints or opens it, so that none works it out
    again: its model (model_kind) and the files that model reads, and what
    else in it is or holds a checkpoint (extras)."""

    path: Path
    model: str | None  # model_kind: "dcp", "index", "shards", "single"; None without a model
    model_path: Path | None  # the index file or DCP `.metadata` that opens the model alone
    weight_map: dict[str, str] | None  # an "index" model's index as read (read_index)
    reads: tuple[Path, ...]  # the checkpoint files the model reads, in its order ("dcp": none by name)
    accounted: frozenset[Path]  # reads, and the files a second index names (model_files)
    extras: tuple[Path, ...]

    @property
    def kind(self) -> str | None:
        """What the folder is as one checkpoint: "dcp", "index", "shards" (a
        complete set of shard files without an index) or "single" (one
        checkpoint file); None for a plain folder of separate checkpoints,
        which is also what a folder is whose model leaves something out
        (extras)."""
        return None if self.extras else self.model


def classify_folder(folder: Path) -> Folder:
    """What `folder` holds (Folder): its model_kind, and when it has a model,
    the files the model reads (an index read and checked: its errors are
    CheckpointErrors here) and its extras."""
    model = model_kind(folder)
    if model is None:
        return Folder(folder, None, None, None, (), frozenset(), ())
    opens = None  # the model's own files open it: a shard set, the one file
    weight_map = None
    reads: tuple[Path, ...] = ()  # a DCP model's .distcp files are not checkpoint files by name
    if model == "dcp":
        opens = folder / DCP_METADATA
    elif model == "index":
        opens = index_files(folder)[0]
        weight_map = read_index(opens)
        reads = tuple(index_shards(opens, weight_map))
    else:
        reads = tuple(sorted(checkpoint_files(folder), key=lambda f: shard_order(f.name)))
    accounted = model_files(folder, model, reads)
    return Folder(folder, model, opens, weight_map, reads, accounted, tuple(extras(folder, accounted)))


def classified(folder: Path, known: dict[Path, Folder]) -> Folder:
    """The Folder of `folder`: from `known` (the folders classified so far,
    each under its path), else classified now (classify_folder) and added
    to it."""
    if folder not in known:
        known[folder] = classify_folder(folder)
    return known[folder]


def model_kind(folder: Path) -> str | None:
    """What the folder's own files make of it as one model, whatever else it
    holds: "dcp", "index", "shards" or "single" (Folder.kind's words);
    None. A folder holding some shards of a model but not all, and no index,
    is a CheckpointError: scanning the shards there would pass over the
    missing ones in silence. So is a folder holding an entry named like a
    checkpoint that is no regular file (a FIFO, a socket, a device, a link
    to nothing): each is named (refuse_unreadable_entries)."""
    refuse_unreadable_entries(folder)
    if is_regular_file(folder / DCP_METADATA):
        return "dcp"
    if index_files(folder):
        return "index"
    files = checkpoint_files(folder)
    groups = shard_sets(files)
    for key, shards in groups.items():
        if not complete(key, shards):
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


def model_files(folder: Path, kind: str, reads: tuple[Path, ...]) -> frozenset[Path]:
    """The checkpoint files (by suffix) that the folder's model of this kind
    accounts for: those it `reads` (a DCP model's .distcp files are not
    checkpoint files by name), and for an index model those a second index
    names (the same weights in another format, index_files), whose own
    errors are left to whoever opens it."""
    files = set(reads)
    if kind == "index":
        for other in index_files(folder)[1:]:
            try:
                files |= set(index_shards(other, read_index(other)))
            except CheckpointError:
                pass
    return frozenset(files)


def sorted_names(folder: Path) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot list ({e.strerror or e})") from None


def identity(folder: Path) -> tuple[int, int]:
    st = folder.stat()
    return st.st_dev, st.st_ino


def holds_checkpoints(folder: Path, seen: set[tuple[int, int]]) -> bool:
    """Whether the folder or a sub-folder of it, at any depth, holds a
    checkpoint file, a shard index or a DCP `.metadata`. `seen` holds the
    folders already looked into: a link back up the tree is followed once."""
    try:
        ident = identity(folder)
        if ident in seen:
            return False
        names = sorted(os.listdir(folder))
    except OSError:
        return False
    seen.add(ident)
    # The name first: a stat call only for a name that could be a checkpoint.
    # An entry so named that is no regular file counts too (not a folder:
    # a FIFO, a link to nothing): the scan of the folder then names it.
    if any(named_like_checkpoint(n) and not (folder / n).is_dir() for n in names):
        return True
    return any((folder / n).is_dir() and holds_checkpoints(folder / n, seen) for n in names)


def extras(folder: Path, accounted: frozenset[Path]) -> list[Path]:
    """What the folder holds beside its model (model_kind), whose files are
    `accounted` (model_files), that is or holds a checkpoint: checkpoint
    files the model does not read and sub-folders holding checkpoints, by
    name."""
    out = []
    for n in sorted_names(folder):
        p = folder / n
        if n.endswith(CHECKPOINT_SUFFIXES) and is_regular_file(p):
            if p not in accounted:
                out.append(p)
        elif p.is_dir() and holds_checkpoints(p, {identity(folder)}):
            out.append(p)
    return out


@dataclass(frozen=True, eq=False)  # hashed and compared by identity: its Folder holds a dict
class CheckpointPath:
    """A checkpoint that expand_paths found: its path, as given or as found in
    a folder, and for a folder what classifying it found (Folder), so that
    opening it (open_checkpoint) does not classify it again. It is an
    os.PathLike, and str() of it is its path."""

    text: str
    folder: Folder | None = None

    def __fspath__(self) -> str:
        return self.text

    def __str__(self) -> str:
        return self.text


def expand_paths(paths: Sequence[str]) -> list[CheckpointPath]:
    """The checkpoints that `paths` name, each a path open_checkpoint opens,
    in the order given:

    * a file is itself, and a folder that is one checkpoint (Folder.kind)
      itself;
    * any other folder is its checkpoints (folder_contents): its model by the
      path that opens it alone, its other checkpoint files and checkpoint
      folders, and what its plain sub-folders hold, by name;
    * a pattern with * ? or [ that names no existing path is the paths it
      matches, by name, each expanded as above;
    * the complete set of one model's shard files, all named (say by
      `dir/*.safetensors`), is their folder when the folder is that model.

    Each folder is classified once (classify_folder), and a checkpoint
    folder found carries its Folder. Raises CheckpointError for a pattern
    that matches nothing and for a folder that holds no checkpoint; anything
    else wrong with a path is reported when it is opened."""
    known: dict[Path, Folder] = {}
    out: list[CheckpointPath] = []
    for text in paths:
        if GLOB_CHARS & set(text) and not os.path.lexists(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise CheckpointError(f"{text}: matches no file")
            out.extend(grouped([CheckpointPath(m) for m in matches], known))
        elif os.path.isdir(text):
            folder = classified(Path(text), known)
            if folder.kind is not None:
                out.append(CheckpointPath(text, folder))
                continue
            inside = folder_contents(folder, known)
            if not inside:
                raise CheckpointError(
                    f"{text}: holds no checkpoint (no {', '.join(CHECKPOINT_SUFFIXES)} file, "
                    f"shard index or {DCP_METADATA})"
                )
            out.extend(inside)
        else:
            out.append(CheckpointPath(text))
    return out


def folder_contents(folder: Folder, known: dict[Path, Folder]) -> list[CheckpointPath]:
    """A plain folder's checkpoints, by name: its model by the path that opens
    it alone (an index file, a DCP `.metadata`) in place of the files the
    model reads, its other checkpoint files (shard sets as one), its
    sub-folders that are checkpoints, and the checkpoints of its other
    sub-folders, at any depth. `known` as classified's."""
    return grouped(contents(folder, known, set()), known)


def contents(folder: Folder, known: dict[Path, Folder], seen: set[tuple[int, int]]) -> list[CheckpointPath]:
    """folder_contents before shard sets are grouped; `seen` as holds_checkpoints'."""
    ident = identity(folder.path)
    if ident in seen:
        return []
    seen.add(ident)
    model = folder.model_path
    accounted = folder.accounted if model is not None else frozenset()
    entries = []
    for n in sorted_names(folder.path):
        p = folder.path / n
        if p == model or (n.endswith(CHECKPOINT_SUFFIXES) and is_regular_file(p) and p not in accounted):
            entries.append(CheckpointPath(str(p)))
        elif p.is_dir():
            sub = classified(p, known)
            if sub.kind is not None:
                entries.append(CheckpointPath(str(p), sub))
            else:
                entries.extend(contents(sub, known, seen))
    return entries


def grouped(paths: Sequence[CheckpointPath], known: dict[Path, Folder]) -> list[CheckpointPath]:
    """`paths` with each complete set of one model's shards replaced by their
    folder, where the folder opens as exactly that model; the rest as given.
    `known` as classified's."""
    files = [Path(p.text) for p in paths]
    replace: dict[Path, CheckpointPath] = {}
    for key, shards in shard_sets([f for f in files if is_regular_file(f)]).items():
        if not complete(key, shards):
            continue
        folder = classified(key[0], known)
        if folder.kind == "shards":
            target = CheckpointPath(str(folder.path), folder)
        elif folder.model == "index" and set(shards.values()) <= folder.accounted:
            # the folder when it is the model alone, else its index file
            target = CheckpointPath(str(folder.path), folder) if folder.kind == "index" else CheckpointPath(
                str(folder.model_path))
        else:
            continue
        for f in shards.values():
            replace[f] = target
    out: list[CheckpointPath] = []
    named: set[str] = set()
    for p, f in zip(paths, files):
        target = replace.get(f, p)
        if target.text not in named:  # a glob may match an index file and the shards it stands for
            named.add(target.text)
            out.append(target)
    return out


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


