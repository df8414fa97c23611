"""torch.distributed.checkpoint folders, saved here by DCP itself (one
process, and two ranks on a gloo group): every tensor reads back bit for
bit, scans agree with the float64 reference whether read whole, in batches
or in blocks of rows, and a hostile folder is refused with one line naming
the file, running nothing it holds."""

from __future__ import annotations

import builtins
import dataclasses
import json
import math
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_matches_reference, fresh_generator, make_values
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

import zeroscan
from zeroscan.checkpoint import CheckpointError, TensorEntry, dtype_name, scan_checkpoint
from zeroscan.checkpoint.dcp import MetadataReader, looks_like_dcp, open_dcp
from zeroscan.checkpoint.dcp_metadata import Box, first_overlap, read_metadata
from zeroscan.checkpoint.files import TensorPiece
from zeroscan.cli import main


def save_one_process(folder: Path, state_dict: dict[str, object]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state_dict, checkpoint_id=folder, no_dist=True)


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, so that NaN compares equal to the same NaN."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def originals(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and shapes, random with planted specials,
    plus an all-zero matrix and a NaN vector."""
    nan_bias = make_values(9, torch.float32, g, specials=False)
    nan_bias[torch.randint(0, 9, (2,), generator=g)] = math.nan
    return {
        "layers.0.weight": make_values(60, torch.float32, g).reshape(6, 10),
        "layers.0.bias": nan_bias,
        "layers.1.weight": torch.zeros(5, 7),
        "layers.1.norm.weight": make_values(7, torch.bfloat16, g),
        "embed.weight": make_values(5 * 3 * 4, torch.float16, g).reshape(5, 3, 4),
        "tokens": make_values(11, torch.int64, g),
        "mask": make_values(13, torch.bool, g),
        "step_scale": make_values(1, torch.float32, g, specials=False).reshape(()),
        "empty": torch.zeros(0, 3),
    }


# --- one process -------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = originals(fresh_generator())
    folder = tmp_path / "ckpt"
    # Items DCP stores as bytes: left out of the entries.
    save_one_process(folder, {**tensors, "epoch": 3, "config": {"lr": 0.1, "name": "run"}})
    return folder, tensors


def test_entries_name_every_tensor_with_its_dtype_shape_and_file(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, tensors = saved
    assert looks_like_dcp(folder)
    with open_dcp(folder) as ckpt:
        assert ckpt.format == "dcp"
        assert ckpt.names() == list(tensors)
        assert len(ckpt) == len(tensors) and "epoch" not in ckpt and "config.lr" not in ckpt
        for name, t in tensors.items():
            assert name in ckpt
            want = TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), "__0_0.distcp")
            assert ckpt.entry(name) == want
            assert ckpt.shard_of(name) == "__0_0.distcp"
        assert ckpt.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
        assert ckpt.shards == 1
        with pytest.raises(KeyError, match=f"{folder}.*'epoch'"):
            ckpt.entry("epoch")


def test_read_gives_each_tensor_bit_for_bit(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, tensors = saved
    with open_dcp(folder) as ckpt:
        for name, t in tensors.items():
            got = ckpt.read(name)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(bits(got), bits(t)), name
            assert torch.equal(bits(ckpt.tensor(name)), bits(t)), name
        (folder / ".metadata").write_bytes(b"rewritten")  # read once, on opening
        listed = list(ckpt.tensors())
        assert [n for n, _ in listed] == list(tensors)
        assert all(torch.equal(bits(x), bits(tensors[n])) for n, x in listed)


def joined(items: list[tuple[TensorEntry, object]]) -> dict[str, torch.Tensor]:
    """scan_items' tensors by name, the pieces of one concatenated in order
    (checked to come one after another, numbered from 0 to count - 1)."""
    out: dict[str, torch.Tensor] = {}
    pieces: list[torch.Tensor] = []
    for entry, source in items:
        if isinstance(source, TensorPiece):
            assert source.index == len(pieces) and source.shape == entry.shape, entry.name
            pieces.append(source.tensor.reshape(-1))
            if source.index == source.count - 1:
                out[entry.name] = torch.cat(pieces)
                pieces = []
        elif isinstance(source, torch.Tensor):
            assert not pieces, f"{entry.name} came between the pieces of another tensor"
            out[entry.name] = source
    assert not pieces, "a tensor's last piece never came"
    return out


@pytest.mark.parametrize("batch_bytes", [1 << 20, 64, 40, 3])
def test_scan_items_batches_and_pieces_match_the_reference(
    saved: tuple[Path, dict[str, torch.Tensor]], batch_bytes: int
) -> None:
    folder, tensors = saved
    with open_dcp(folder) as ckpt:
        items = list(ckpt.scan_items(batch_bytes))
        assert [e.name for e, s in items if not isinstance(s, TensorPiece) or s.index == 0] == ckpt.names()
        for entry, source in items:
            if isinstance(source, TensorPiece):
                # a block of rows, or of one row's elements, within the batch (one element at least)
                piece = source.tensor
                assert entry.nbytes > batch_bytes
                assert piece.numel() * piece.element_size() <= max(batch_bytes, piece.element_size())
            elif isinstance(source, torch.Tensor):
                assert entry.nbytes <= batch_bytes
        if batch_bytes < 64:
            assert any(isinstance(s, TensorPiece) for _, s in items)
        got = joined(items)
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert torch.equal(bits(got[name]), bits(t)), name
        if t.numel():
            assert_matches_reference(zeroscan.stats(got[name]), t)


def test_scan_items_reads_one_batch_at_a_time(
    saved: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One DCP read per batch, of at most batch_bytes, and each batch given
    out before the next is read."""
    folder, tensors = saved
    reads: list[set[str]] = []
    read_data = MetadataReader.read_data

    def counting(self: MetadataReader, plan: object, planner: object) -> object:
        reads.append({item.dest_index.fqn for item in plan.items})  # type: ignore[attr-defined]
        return read_data(self, plan, planner)  # type: ignore[arg-type]

    monkeypatch.setattr(MetadataReader, "read_data", counting)
    batch_bytes = 200
    with open_dcp(folder) as ckpt:
        items = ckpt.scan_items(batch_bytes)
        first, _ = next(items)
        assert len(reads) == 1 and first.name in reads[0]
        list(items)
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    assert len(reads) < len(tensors)  # small tensors shared reads
    for names in reads:
        assert sum(sizes[n] for n in names) <= batch_bytes or len(names) == 1, names


def test_scan_checkpoint_rows_match_the_reference(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, tensors = saved
    for batch_bytes in (64 << 20, 48):
        result = scan_checkpoint(folder, batch_bytes=batch_bytes)
        assert result.format == "dcp"
        rows = {r["name"]: r for r in result.rows}
        assert set(rows) == set(tensors)
        for name, t in tensors.items():
            assert_row_matches_reference(rows[name], t)
        assert rows["layers.1.weight"]["verdict"] == "exact_zero" and rows["layers.1.weight"]["severity"] == "warning"
        assert rows["layers.0.bias"]["severity"] == "error"


def assert_row_matches_reference(row: dict[str, object], t: torch.Tensor) -> None:
    want = zeroscan.reference_stats(t)
    name = row["name"]
    for field in ("numel", "zeros", "nan", "negative", "subnormal", "near_zero", "posinf", "neginf"):
        assert row[field] == want[field], f"{name} {field}: {row[field]} != {want[field]}"
    for field in ("min_abs", "max_abs"):
        got, w = float(row[field]), float(want[field])  # type: ignore[arg-type]
        assert got == w or (math.isnan(got) and math.isnan(w)), f"{name} {field}: {got} != {w}"
    for field in ("mean", "std"):
        got, w = float(row[field]), float(want[field])  # type: ignore[arg-type]
        assert math.isclose(got, w, rel_tol=1e-6, abs_tol=1e-12) or (math.isnan(got) and math.isnan(w)), (
            f"{name} {field}: {got} != {w}"
        )


def test_dtypes_zeroscan_does_not_scan_are_listed_not_read(tmp_path: Path) -> None:
    g = fresh_generator()
    x = make_values(8, torch.float32, g)
    folder = tmp_path / "ckpt"
    save_one_process(folder, {"u16": torch.zeros(4, dtype=torch.uint16), "x": x})
    with open_dcp(folder) as ckpt:
        items = list(ckpt.scan_items(1 << 20))
        assert [e.name for e, _ in items] == ["u16", "x"]
        assert isinstance(items[0][1], str) and "uint16" in items[0][1]
        assert torch.equal(bits(items[1][1]), bits(x))  # type: ignore[arg-type]
    result = scan_checkpoint(folder)
    assert [s["name"] for s in result.skipped] == ["u16"] and [r["name"] for r in result.rows] == ["x"]


# --- two ranks -----------------------------------------------------------------------

RANK_SCRIPT = """
    import sys
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, folder, store, originals = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    tensors = torch.load(originals)
    mesh = init_device_mesh("cpu", (2,))
    # embed.weight sharded across both ranks; each rank's own layers only in its file
    state = {"embed.weight": distribute_tensor(tensors.pop("embed.weight"), mesh, [Shard(0)])}
    state.update({k: v for k, v in tensors.items() if k.startswith(f"layers.{rank}.")})
    dcp.save(state, checkpoint_id=folder)
    dist.barrier()  # neither rank tears the group down while the other still uses it (gloo aborts then)
    dist.destroy_process_group()
"""


def two_rank_originals(g: torch.Generator) -> dict[str, torch.Tensor]:
    nan_bias = make_values(6, torch.float32, g, specials=False)
    nan_bias[torch.randint(0, 6, (1,), generator=g)] = math.nan
    return {
        "embed.weight": make_values(10 * 7, torch.float32, g).reshape(10, 7),
        "layers.0.weight": make_values(4 * 6, torch.bfloat16, g).reshape(4, 6),
        "layers.1.weight": torch.zeros(6, 5),
        "layers.1.bias": nan_bias,
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint saved by two processes on a gloo group: two .distcp files."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    tensors = two_rank_originals(fresh_generator())
    torch.save(tensors, tmp / "originals.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    script = textwrap.dedent(RANK_SCRIPT)
    for attempt in range(3):
        # gloo now and then aborts a rank while tearing the group down, after the save
        # ("terminate called without an active exception"); a save that fails so is made again
        folder = tmp / f"ckpt{attempt}"
        args = [str(folder), str(tmp / f"store{attempt}"), str(tmp / "originals.pt")]
        ranks = [
            subprocess.Popen([sys.executable, "-c", script, str(r), *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for r in range(2)
        ]
        outputs = [p.communicate(timeout=120)[0] for p in ranks]
        codes = [p.returncode for p in ranks]
        if not any(c < 0 for c in codes):
            break
    assert codes == [0, 0], outputs
    return folder, tensors


def test_two_ranks_entries_name_their_files_and_read_back(two_ranks: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, tensors = two_ranks
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    with open_dcp(folder) as ckpt:
        assert sorted(ckpt.names()) == sorted(tensors)
        assert ckpt.shards == 2
        assert ckpt.shard_of("embed.weight") == "__0_0.distcp,__1_0.distcp"
        assert ckpt.shard_of("layers.0.weight") == "__0_0.distcp"
        assert ckpt.shard_of("layers.1.weight") == "__1_0.distcp"
        assert ckpt.shard_of("layers.1.bias") == "__1_0.distcp"
        for name, t in tensors.items():
            assert ckpt.entry(name).shape == tuple(t.shape) and ckpt.entry(name).dtype == dtype_name(t.dtype)
            assert torch.equal(bits(ckpt.read(name)), bits(t)), name
        # blocks of 3 rows of embed.weight: one straddles the two ranks' chunks (rows 0-4 and 5-9)
        got = joined(list(ckpt.scan_items(3 * 7 * 4)))
        assert torch.equal(bits(got["embed.weight"]), bits(tensors["embed.weight"]))


@pytest.mark.parametrize("batch_bytes", [64 << 20, 20])
def test_two_ranks_scan_finds_the_zero_matrix_and_the_nan(
    two_ranks: tuple[Path, dict[str, torch.Tensor]], batch_bytes: int
) -> None:
    folder, tensors = two_ranks
    result = zeroscan.checkpoint.scan_checkpoint(folder, batch_bytes=batch_bytes)
    rows = {r["name"]: r for r in result.rows}
    assert set(rows) == set(tensors)
    for name, t in tensors.items():
        assert_row_matches_reference(rows[name], t)
    zero, nan = rows["layers.1.weight"], rows["layers.1.bias"]
    assert (zero["verdict"], zero["severity"], zero["shard"]) == ("exact_zero", "warning", "__1_0.distcp")
    assert (nan["verdict"], nan["severity"], nan["shard"]) == ("nonfinite", "error", "__1_0.distcp")
    # an error only for a non-finite value (make_values plants NaN and ±inf; an inf may land on the NaN)
    assert rows["embed.weight"]["severity"] != "error" or not tensors["embed.weight"].isfinite().all()


def test_cli_scan_json_of_a_dcp_folder_exits_1_on_the_nan(
    two_ranks: tuple[Path, dict[str, torch.Tensor]], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, tensors = two_ranks
    status = main(["scan", str(folder), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 1
    (file,) = doc["files"]
    rows = {r["name"]: r for r in file["tensors"]}
    assert set(rows) == set(tensors)
    assert rows["layers.1.bias"]["severity"] == "error" and rows["layers.1.bias"]["nan"] >= 1
    assert rows["layers.1.weight"]["zeros"] == 30 and rows["layers.1.weight"]["severity"] == "warning"
    assert doc["summary"]["worst"] == "error"


# --- hostile folders -------------------------------------------------------------------


class RunsCommand:
    """Pickles as a call: os.system(command), or exec(code)."""

    def __init__(self, call: Callable[[str], object], arg: str) -> None:
        self.call, self.arg = call, arg

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return self.call, (self.arg,)


def hostile_calls(marker: Path) -> list[RunsCommand]:
    return [RunsCommand(os.system, f"touch {marker}"), RunsCommand(builtins.exec, f"open({str(marker)!r}, 'w')")]


def rewrite_metadata(folder: Path, change: Callable[[Metadata], object]) -> None:
    """Changes the folder's metadata (read safely) and pickles it back as DCP does."""
    md = read_metadata(folder / ".metadata")
    change(md)
    (folder / ".metadata").write_bytes(pickle.dumps(md))


def test_a_folder_without_metadata_is_not_dcp(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    assert not looks_like_dcp(tmp_path)
    (tmp_path / ".metadata").mkdir()
    assert not looks_like_dcp(tmp_path)
    with pytest.raises(CheckpointError, match=f"^{tmp_path}: not a torch.distributed.checkpoint folder"):
        open_dcp(tmp_path)


@pytest.mark.parametrize("index", [0, 1])
def test_a_metadata_pickle_that_runs_a_command_is_refused_and_runs_nothing(tmp_path: Path, index: int) -> None:
    marker = tmp_path / "ran"
    call = hostile_calls(marker)[index]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(call))
    with pytest.raises(CheckpointError) as refused:
        open_dcp(folder)
    assert str(refused.value) == (
        f"{folder / '.metadata'}: refuses to unpickle {call.call.__module__}.{call.call.__name__} "
        "(only DCP metadata classes are read)"
    )
    assert not marker.exists()


@pytest.mark.parametrize("index", [0, 1])
def test_a_command_hidden_in_real_metadata_is_refused(saved: tuple[Path, dict[str, torch.Tensor]], index: int) -> None:
    folder, _ = saved
    marker = folder.parent / "ran"
    rewrite_metadata(folder, lambda md: setattr(md, "planner_data", {"x": hostile_calls(marker)[index]}))
    with pytest.raises(CheckpointError, match=r"\.metadata: refuses to unpickle (posix|builtins)\.(system|exec) "):
        open_dcp(folder)
    assert not marker.exists()


def build_on(module: str, name: str, state: bytes) -> bytes:
    """A pickle that sets the state of the global module.name itself (BUILD)."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + state + b"b."


def pickled_str(text: str) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text.encode()


@pytest.mark.parametrize(
    "module, name, state, kind",
    [
        # setattr(Metadata, attr, 1), through a (None, {attr: 1}) state
        ("torch.distributed.checkpoint.metadata", "Metadata", b"N}" + pickled_str("zeroscan_probe") + b"K\x01s\x86",
         "builtins.type"),
        # _get_layout.__dict__.update({attr: 1})
        ("torch.serialization", "_get_layout", b"}" + pickled_str("zeroscan_probe") + b"K\x01s", "builtins.function"),
    ],
)
def test_metadata_may_not_change_an_allowed_class_or_function(
    tmp_path: Path, module: str, name: str, state: bytes, kind: str
) -> None:
    """Allowing a class to be built must not allow its pickle to rewrite it
    for the whole process."""
    (tmp_path / ".metadata").write_bytes(build_on(module, name, state))
    with pytest.raises(CheckpointError, match=f": refuses to set the state of a {kind} "):
        open_dcp(tmp_path)
    target = getattr(__import__(module, fromlist=[name]), name)
    assert not hasattr(target, "zeroscan_probe")
    # the pickle is well formed: plain pickle does change the target (undone here)
    assert pickle.loads(build_on(module, name, state)) is target
    try:
        assert getattr(target, "zeroscan_probe") == 1
    finally:
        delattr(target, "zeroscan_probe")


@pytest.mark.parametrize(
    "content, why",
    [
        (pickle.dumps({"model.weight": 1}), r"not DCP metadata \(it holds a dict, not a Metadata\)"),
        (b"\x80\x04\x95\x00garbage", r"not DCP metadata \(a damaged pickle: "),
        (b"", r"not DCP metadata \(a damaged pickle: EOFError"),
    ],
)
def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path: Path, content: bytes, why: str) -> None:
    (tmp_path / ".metadata").write_bytes(content)
    with pytest.raises(CheckpointError, match=f"^{tmp_path / '.metadata'}: {why}"):
        open_dcp(tmp_path)


def drop_chunks(md: Metadata) -> None:
    del md.state_dict_metadata["layers.1.weight"].chunks  # type: ignore[union-attr]


def chunk_past_the_end(md: Metadata) -> None:
    md.state_dict_metadata["layers.1.weight"].chunks[0].sizes = torch.Size([6, 7])  # type: ignore[union-attr]


def dtype_by_name(md: Metadata) -> None:
    md.state_dict_metadata["layers.1.weight"].properties.dtype = "float32"  # type: ignore[union-attr]


def no_storage_table(md: Metadata) -> None:
    md.storage_data = None


def a_number_for_a_tensor(md: Metadata) -> None:
    md.state_dict_metadata["layers.1.weight"] = 5  # type: ignore[assignment]


@pytest.mark.parametrize(
    "change, why",
    [
        (drop_chunks, r"tensor 'layers.1.weight' has no valid shape and chunk list"),
        (chunk_past_the_end, r"tensor 'layers.1.weight' \(5, 7\) has a chunk outside it"),
        (dtype_by_name, r"tensor 'layers.1.weight' has no torch dtype \(got 'float32'\)"),
        (no_storage_table, r"not DCP metadata \(no table of tensors and of where their chunks lie\)"),
        (a_number_for_a_tensor, r"not DCP metadata \('layers.1.weight' is a int\)"),
    ],
)
def test_metadata_records_that_do_not_hold_together_are_refused(
    saved: tuple[Path, dict[str, torch.Tensor]], change: Callable[[Metadata], None], why: str
) -> None:
    folder, _ = saved
    rewrite_metadata(folder, change)
    with pytest.raises(CheckpointError, match=f"^{folder / '.metadata'}: {why}"):
        open_dcp(folder)


def test_truncated_metadata_is_refused(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, _ = saved
    whole = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match=r"\.metadata: not DCP metadata \(a damaged pickle: ") as refused:
        open_dcp(folder)
    assert "\n" not in str(refused.value)


def test_bytes_items_are_never_unpickled(tmp_path: Path) -> None:
    """DCP stores a non-tensor item as a pickle, which its own planner loads
    with weights_only=False; zeroscan never asks for one."""
    marker = tmp_path / "ran"
    g = fresh_generator()
    x = make_values(20, torch.float32, g)
    folder = tmp_path / "ckpt"
    save_one_process(folder, {"x": x, "hook": hostile_calls(marker)[0], "code": hostile_calls(marker)[1]})
    with open_dcp(folder) as ckpt:
        assert ckpt.names() == ["x"]
        assert torch.equal(bits(ckpt.read("x")), bits(x))
        assert len(list(ckpt.scan_items(32))) == 3  # x in three pieces
    assert [r["name"] for r in scan_checkpoint(folder).rows] == ["x"]
    assert not marker.exists()


def test_a_missing_distcp_file_is_named_when_read(two_ranks: tuple[Path, dict[str, torch.Tensor]],
                                                   tmp_path: Path) -> None:
    folder = copy_folder(two_ranks[0], tmp_path)
    (folder / "__1_0.distcp").unlink()
    with open_dcp(folder) as ckpt:
        assert ckpt.read("layers.0.weight").shape == (4, 6)  # rank 0's file is whole
        with pytest.raises(CheckpointError, match=f"^{folder / '__1_0.distcp'}: no such file"):
            ckpt.read("layers.1.weight")
    with pytest.raises(CheckpointError, match="__1_0.distcp: no such file"):
        scan_checkpoint(folder)


def test_a_truncated_distcp_file_is_named_when_read(two_ranks: tuple[Path, dict[str, torch.Tensor]],
                                                     tmp_path: Path) -> None:
    folder = copy_folder(two_ranks[0], tmp_path)
    shard = folder / "__1_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    with open_dcp(folder) as ckpt:
        with pytest.raises(CheckpointError, match=f"^{shard}: truncated \\({size - 100:,} bytes") as refused:
            list(ckpt.scan_items(1 << 20))
    assert "\n" not in str(refused.value)


def test_a_damaged_chunk_is_named_when_read(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, _ = saved
    md = read_metadata(folder / ".metadata")
    info = next(v for k, v in md.storage_data.items() if k.fqn == "layers.1.weight")
    shard = folder / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.seek(info.offset + info.length - 22)  # the zip's end record
        f.write(b"\0" * 22)
    with open_dcp(folder) as ckpt:
        assert ckpt.read("layers.0.weight").shape == (6, 10)
        damaged = f"^{shard}: the chunk at byte {info.offset:,} is not a torch.save archive"
        with pytest.raises(CheckpointError, match=damaged):
            ckpt.read("layers.1.weight")


def test_a_chunk_holding_a_hostile_pickle_runs_nothing(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """A chunk is loaded by DCP with torch.load(weights_only=True)."""
    folder, _ = saved
    marker = folder.parent / "ran"
    archive = folder / "__9_0.distcp"
    torch.save(hostile_calls(marker)[0], archive)
    point_chunk_at(folder, "layers.1.weight", archive.name, 0, archive.stat().st_size)
    with open_dcp(folder) as ckpt:
        assert ckpt.shard_of("layers.1.weight") == "__9_0.distcp"
        with pytest.raises(CheckpointError, match=f"^{archive}: cannot read the chunks of \\['layers.1.weight'\\] "
                                                  r"\(refused: the pickle asks for posix.system"):
            ckpt.read("layers.1.weight")
    assert not marker.exists()


def test_a_compressed_chunk_is_refused_before_it_inflates(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, tensors = saved
    plain = folder.parent / "plain.pt"
    torch.save(tensors["layers.1.weight"], plain)
    archive = folder / "__9_0.distcp"
    with zipfile.ZipFile(plain) as z, zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as out:
        for entry in z.infolist():
            out.writestr(entry.filename, z.read(entry))
    point_chunk_at(folder, "layers.1.weight", archive.name, 0, archive.stat().st_size)
    with open_dcp(folder) as ckpt:
        with pytest.raises(CheckpointError, match=f"^{archive}: the chunk at byte 0 holds a compressed entry"):
            ckpt.read("layers.1.weight")


@pytest.mark.parametrize("name", ["../outside.distcp", "/dev/zero", "", "sub/__0_0.distcp"])
def test_a_chunk_placed_outside_the_folder_is_refused_on_opening(
    saved: tuple[Path, dict[str, torch.Tensor]], name: str
) -> None:
    folder, _ = saved
    point_chunk_at(folder, "layers.1.weight", name, 0, 10)
    placed = r"\.metadata: tensor 'layers.1.weight': its chunk at \(0, 0\) has no valid place in a file"
    with pytest.raises(CheckpointError, match=placed):
        open_dcp(folder)


def test_a_fifo_in_place_of_a_file_is_refused_without_waiting(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, _ = saved
    os.mkfifo(folder / "__9_0.distcp")
    point_chunk_at(folder, "layers.1.weight", "__9_0.distcp", 0, 0)
    with open_dcp(folder) as ckpt:
        with pytest.raises(CheckpointError, match=r"__9_0.distcp: not a regular file"):
            ckpt.read("layers.1.weight")


def test_chunks_that_do_not_cover_a_tensor_are_an_error(two_ranks: tuple[Path, dict[str, torch.Tensor]],
                                                        tmp_path: Path) -> None:
    folder = copy_folder(two_ranks[0], tmp_path)

    def drop_second_chunk(md: Metadata) -> None:
        md.state_dict_metadata["embed.weight"].chunks.pop()  # type: ignore[union-attr]

    rewrite_metadata(folder, drop_second_chunk)
    with open_dcp(folder) as ckpt:
        assert ckpt.shard_of("embed.weight") == "__0_0.distcp"
        with pytest.raises(CheckpointError, match=r"the chunks of tensor 'embed.weight' give 35 elements of the 70"):
            ckpt.read("embed.weight")


def test_transformed_chunks_are_refused(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, _ = saved

    def compress(md: Metadata) -> None:
        for index, info in md.storage_data.items():
            if index.fqn == "layers.1.weight":
                md.storage_data[index] = dataclasses.replace(info, transform_descriptors=["stream.zstd/1"])

    rewrite_metadata(folder, compress)
    with open_dcp(folder) as ckpt:
        with pytest.raises(CheckpointError, match=r"chunks stored through \['stream.zstd/1'\]"):
            ckpt.read("layers.1.weight")


def point_chunk_at(folder: Path, fqn: str, file: str, offset: int, length: int) -> None:
    def change(md: Metadata) -> None:
        for index, info in md.storage_data.items():
            if index.fqn == fqn:
                md.storage_data[index] = dataclasses.replace(info, relative_path=file, offset=offset, length=length)

    rewrite_metadata(folder, change)


def copy_folder(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / folder.name
    out.mkdir()
    for name in os.listdir(folder):
        (out / name).write_bytes((folder / name).read_bytes())
    return out


# --- chunks that overlap, shapes no tensor can have, torch's warnings ------------------------------


def set_chunks(folder: Path, fqn: str, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
               size: tuple[int, ...] | None = None) -> None:
    """The metadata of tensor `fqn` rewritten to list `boxes` (offsets, sizes)
    as its chunks, each stored where its first chunk was, and `size` as its
    shape where given."""

    def change(md: Metadata) -> None:
        entry = md.state_dict_metadata[fqn]
        stored = [index for index in md.storage_data if index.fqn == fqn]
        info = md.storage_data[stored[0]]
        for index in stored:
            del md.storage_data[index]
        entry.chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in boxes]  # type: ignore[union-attr]
        for offsets, _ in boxes:
            md.storage_data[MetadataIndex(fqn, torch.Size(offsets))] = info
        if size is not None:
            entry.size = torch.Size(size)  # type: ignore[union-attr]

    rewrite_metadata(folder, change)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    folder = tmp_path / "small"
    save_one_process(folder, {"w": torch.tensor([1.0, 2.0, 3.0, 4.0]), "m": torch.arange(8.0).reshape(4, 2),
                              "r": torch.arange(8.0).reshape(2, 4)})
    return folder


# label: a tensor of `small` and chunks for it, (offsets, sizes) each, whose sizes add up to its numel
OVERLAPPING_CHUNKS: dict[str, tuple[str, list[Box]]] = {
    "listed twice": ("w", [((0,), (2,)), ((0,), (2,))]),  # elements 2 and 3 never read
    "one inside another": ("w", [((0,), (3,)), ((1,), (1,))]),
    "rows": ("m", [((0, 0), (2, 2)), ((1, 0), (2, 2))]),  # rows 0-1 and 1-2 of a 4x2 tensor
    "columns": ("r", [((0, 0), (2, 3)), ((0, 2), (2, 1))]),  # columns 0-2 and 2 of a 2x4 tensor
}


@pytest.mark.parametrize("label", list(OVERLAPPING_CHUNKS))
def test_chunks_that_overlap_are_refused_naming_the_metadata_and_the_tensor(
    capsys: pytest.CaptureFixture[str], small: Path, label: str
) -> None:
    """Elements read twice made the copied count match, so the elements never
    read were scanned as whatever memory held (min_abs 3e-41 of [1, 2])."""
    fqn, boxes = OVERLAPPING_CHUNKS[label]
    set_chunks(small, fqn, boxes)
    capsys.readouterr()
    assert main(["scan", str(small)]) == 2
    out, err = capsys.readouterr()
    where = f"{small / '.metadata'}: tensor {fqn!r} "
    assert out == "" and err.startswith(f"zeroscan: error: {where}") and err.count("\n") == 1, err
    twice = boxes[0] == boxes[1]
    assert ("lists its chunk at (0,) twice" if twice else "has chunks that overlap") in err
    with pytest.raises(CheckpointError, match=f"^{small / '.metadata'}: tensor {fqn!r}"):
        open_dcp(small)


def brute_overlap(boxes: list[Box]) -> bool:
    return any(all(o < p + m and p < o + n for o, n, p, m in zip(a[0], a[1], b[0], b[1]))
               and all(n > 0 for n in a[1]) and all(m > 0 for m in b[1])
               for i, a in enumerate(boxes) for b in boxes[i + 1:])


def random_grid(g: torch.Generator, rank: int) -> list[Box]:
    """The boxes of a tensor cut at random places along each dim: a partition, some boxes empty."""
    cuts = []
    for _ in range(rank):
        size = int(torch.randint(0, 9, (), generator=g))
        inner = sorted({int(c) for c in torch.randint(0, size + 1, (3,), generator=g)})
        cuts.append(sorted({0, size, *inner}) if size else [0, 0])
    boxes: list[Box] = [((), ())]
    for points in cuts:
        boxes = [(o + (a,), n + (b - a,)) for o, n in boxes for a, b in zip(points, points[1:])]
    return boxes


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_first_overlap_agrees_with_comparing_every_pair(rank: int) -> None:
    g = fresh_generator()
    for _ in range(200):
        boxes = random_grid(g, rank)
        assert first_overlap(boxes) is None and not brute_overlap(boxes)
        grown = list(boxes)
        i = int(torch.randint(0, len(grown), (), generator=g))
        offsets, sizes = grown[i]
        grown[i] = (offsets, tuple(n + int(torch.randint(0, 2, (), generator=g)) for n in sizes))  # may reach a neighbour
        pair = first_overlap(grown)
        assert (pair is not None) == brute_overlap(grown), grown
        if pair is not None:
            assert brute_overlap(list(pair)) and grown.index(pair[0]) <= grown.index(pair[1])
    assert first_overlap([((), ()), ((), ())]) == (((), ()), ((), ()))  # both chunks of a scalar hold its element


@pytest.mark.parametrize(
    "size, words",
    [((0, 2**62, 4), "has the shape [0, 4611686018427387904, 4], whose strides or byte size overflow 64 bits"),
     ((2**40, 2**40, 2**40), "whose strides or byte size overflow 64 bits"),
     ((0, 2**61, 1), "whose strides or byte size overflow 64 bits"),  # 2**61 elements of 4 bytes: 2**63
     ((1,) * 2000, "has 2,000 dimensions, more than the 1,024")],
    ids=["zero dim first", "numel", "byte stride", "rank"],
)
def test_shapes_no_tensor_can_have_are_refused_naming_the_metadata(
    capsys: pytest.CaptureFixture[str], small: Path, size: tuple[int, ...], words: str
) -> None:
    set_chunks(small, "m", [((0,) * len(size), size)], size=size)
    capsys.readouterr()
    assert main(["scan", str(small)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"zeroscan: error: {small / '.metadata'}: tensor 'm' ") and words in err, err


def test_a_negative_dim_is_refused_naming_the_metadata(small: Path) -> None:
    set_chunks(small, "m", [((0, 0), (4, 2))], size=(4, -2))
    with pytest.raises(CheckpointError, match=r"\.metadata: tensor 'm' has no valid shape and chunk list"):
        open_dcp(small)


def test_a_chunk_holding_a_sparse_tensor_is_one_line_on_stderr(small: Path) -> None:
    """torch warns as it loads a sparse CSR tensor (once per process: so in a
    fresh one); only zeroscan's error reaches stderr."""
    archive = small / "__9_0.distcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(torch.eye(4).to_sparse_csr(), archive)
    point_chunk_at(small, "w", archive.name, 0, archive.stat().st_size)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-m", "zeroscan", "scan", str(small)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"zeroscan: error: {archive}: cannot read the chunks of ['w'] ")
