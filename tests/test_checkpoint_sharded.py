"""Checkpoints of several files: a Hugging Face folder of safetensors shards
(with or without its index), the index file itself, globs, folders of
separate checkpoints; --diff between two shard layouts of one model. Built on
the fly with safetensors' save_file, with an all-zero and a NaN tensor
planted in the middle shard."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_matches_reference, fresh_generator, make_values
from safetensors.torch import save_file

from zeroscan.checkpoint import CheckpointError, open_checkpoint, scan_checkpoint
from zeroscan.checkpoint.diff import diff_checkpoints
from zeroscan.checkpoint.paths import expand_paths
from zeroscan.cli import main

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ZERO, NAN = "model.layers.1.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"


def as_record(row: dict[str, object]) -> dict[str, object]:
    """A scan row with the two fields of a Stats record that it leaves out."""
    finite = int(row["numel"]) - int(row["nan"]) - int(row["posinf"]) - int(row["neginf"])  # type: ignore[call-overload]
    return {**row, "finite": finite, "sum": float(row["mean"]) * finite if finite else 0.0}  # type: ignore[arg-type]


def layer(i: int, dtype: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    n = int(torch.randint(8, 40, (), generator=g))
    return {
        f"model.layers.{i}.self_attn.o_proj.weight": torch.randn(n, 16, generator=g).to(dtype),  # healthy
        f"model.layers.{i}.mlp.down_proj.weight": make_values(n * 24, dtype, g).reshape(24, n),
        f"model.layers.{i}.input_layernorm.weight": torch.ones(16, dtype=dtype),
    }


def model(g: torch.Generator, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Three shards' tensors: embeddings, layer 0; layer 1 (with the planted problems); layer 2, head."""
    shards = [
        {"model.embed_tokens.weight": make_values(64 * 16, dtype, g).reshape(64, 16), **layer(0, dtype, g)},
        layer(1, dtype, g),
        {**layer(2, dtype, g), "lm_head.weight": make_values(64 * 16, dtype, g).reshape(64, 16)},
    ]
    shards[1][ZERO] = torch.zeros_like(shards[1][ZERO])
    poisoned = shards[1][NAN].clone()
    poisoned.view(-1)[torch.randint(0, poisoned.numel(), (3,), generator=g)] = math.nan
    shards[1][NAN] = poisoned
    return shards


def save_sharded(folder: Path, shards: list[dict[str, torch.Tensor]], index: bool = True,
                 stem: str = "model") -> dict[str, str]:
    """The shards as NAME-0000k-of-0000n.safetensors in `folder`, with the index file when `index`."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, tensors in enumerate(shards, 1):
        name = f"{stem}-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in tensors})
    if index:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(doc))
    return weight_map


def check_scan(path: Path | str, shards: list[dict[str, torch.Tensor]], weight_map: dict[str, str],
               batch_bytes: int = 64 << 20) -> None:
    """Every tensor of every shard scanned once, named with its shard, and
    agreeing with the float64 reference; the planted problems found."""
    result = scan_checkpoint(path, batch_bytes=batch_bytes)
    tensors = {k: v for s in shards for k, v in s.items()}
    assert sorted(r["name"] for r in result.rows) == sorted(tensors), "each tensor exactly once"
    assert result.shards == len(shards) and result.skipped == []
    assert result.format == "safetensors-sharded"
    assert result.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    for row in result.rows:
        x = tensors[str(row["name"])]
        assert row["shard"] == weight_map[str(row["name"])]
        assert row["shape"] == list(x.shape)
        assert_matches_reference(as_record(row), x)
    by_name = {r["name"]: r for r in result.rows}
    assert by_name[ZERO]["verdict"] == "exact_zero" and by_name[ZERO]["severity"] == "warning"
    assert by_name[NAN]["nan"] == int(tensors[NAN].isnan().sum()) > 0 and by_name[NAN]["severity"] == "error"
    # o_proj and the norms hold no planted specials; the other tensors have NaN and Inf among their values
    healthy = [r for r in result.rows if r["name"] != NAN and ("o_proj" in r["name"] or "layernorm" in r["name"])]
    assert len(healthy) == 5
    assert all(r["severity"] == "ok" for r in healthy), [r["name"] for r in healthy if r["severity"] != "ok"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["folder", "index file", "folder without index", "glob"])
def test_a_three_shard_model_scans_as_one_checkpoint(tmp_path: Path, how: str, dtype: torch.dtype) -> None:
    shards = model(fresh_generator(), dtype)
    folder = tmp_path / "llama"
    weight_map = save_sharded(folder, shards, index=how != "folder without index")
    (folder / "config.json").write_text("{}")  # a model folder's other files are not checkpoints
    path = {
        "folder": str(folder),
        "index file": str(folder / "model.safetensors.index.json"),
        "folder without index": str(folder),
        "glob": str(folder / "*.safetensors"),
    }[how]
    (expanded,) = expand_paths([path])
    assert expanded.text in (str(folder), path)
    check_scan(expanded, shards, weight_map)


def test_tensors_larger_than_a_batch_are_scanned_in_pieces_across_shards(tmp_path: Path) -> None:
    shards = model(fresh_generator(), torch.float32)
    weight_map = save_sharded(tmp_path, shards)
    check_scan(tmp_path, shards, weight_map, batch_bytes=256)


def test_the_index_decides_which_copy_is_scanned_and_what_is_missing(tmp_path: Path) -> None:
    g = fresh_generator()
    shards = model(g, torch.float32)
    shards[2]["model.layers.0.input_layernorm.weight"] = torch.full((16,), math.nan)  # a stale copy
    weight_map = save_sharded(tmp_path, shards)
    index = tmp_path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.layers.0.input_layernorm.weight"] = "model-00001-of-00003.safetensors"
    doc["weight_map"]["model.layers.9.lost.weight"] = "model-00002-of-00003.safetensors"
    index.write_text(json.dumps(doc))
    result = scan_checkpoint(tmp_path)
    row = {r["name"]: r for r in result.rows}["model.layers.0.input_layernorm.weight"]
    assert row["shard"] == "model-00001-of-00003.safetensors" and row["nan"] == 0
    skipped = {(s["name"], s["shard"]): s for s in result.skipped}
    stale = skipped[("model.layers.0.input_layernorm.weight", "model-00003-of-00003.safetensors")]
    assert stale["severity"] == "info" and "index does not use" in str(stale["reason"])
    lost = skipped[("model.layers.9.lost.weight", "model-00002-of-00003.safetensors")]
    assert lost["severity"] == "error" and "does not hold it" in str(lost["reason"])
    assert len(result.skipped) == 2
    del weight_map


def test_a_tensor_in_two_shards_without_an_index_is_scanned_once(tmp_path: Path) -> None:
    shards = model(fresh_generator(), torch.float32)
    shards[2][ZERO] = torch.ones(3)
    save_sharded(tmp_path, shards, index=False)
    result = scan_checkpoint(tmp_path)
    assert [r["shard"] for r in result.rows if r["name"] == ZERO] == ["model-00002-of-00003.safetensors"]
    (dup,) = result.skipped
    assert dup["name"] == ZERO and dup["severity"] == "warning" and "model-00002-of-00003" in str(dup["reason"])


@pytest.mark.parametrize(
    "weight_map, words",
    [
        ({"a": "../outside.safetensors"}, "not a file name in the index's folder"),
        ({"a": "/dev/zero"}, "not a file name in the index's folder"),
        ({"a": 3}, "is int, not a file name"),
        ({"a": "model-00009-of-00009.safetensors"}, "which is missing"),
        ("not a map", "no \"weight_map\" object"),
    ],
)
def test_a_hostile_or_broken_index_is_a_one_line_error(tmp_path: Path, weight_map: object, words: str) -> None:
    save_sharded(tmp_path, model(fresh_generator(), torch.float32))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(tmp_path)
    assert words in str(err.value) and str(index) in str(err.value) and "\n" not in str(err.value)


def test_an_index_that_is_not_json_is_a_one_line_error(tmp_path: Path) -> None:
    save_sharded(tmp_path, model(fresh_generator(), torch.float32))
    (tmp_path / "model.safetensors.index.json").write_bytes(b"{\"weight_map\": {\xff")
    with pytest.raises(CheckpointError, match="not a shard index"):
        open_checkpoint(tmp_path / "model.safetensors.index.json")


def test_an_incomplete_set_of_shards_is_an_error(tmp_path: Path) -> None:
    save_sharded(tmp_path, model(fresh_generator(), torch.float32), index=False)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    for call in (lambda: expand_paths([str(tmp_path)]), lambda: open_checkpoint(tmp_path)):
        with pytest.raises(CheckpointError, match=r"shard 2 of model-\*-of-00003.safetensors is missing"):
            call()


def test_a_plain_folder_lists_its_checkpoints_and_checkpoint_folders(tmp_path: Path) -> None:
    g = fresh_generator()
    torch.save({"w": torch.randn(3, generator=g)}, tmp_path / "b.pt")
    save_file({"w": torch.randn(3, generator=g)}, str(tmp_path / "a.safetensors"))
    save_sharded(tmp_path / "step_200", model(g, torch.float32))
    save_sharded(tmp_path / "step_100", model(g, torch.float32), index=False)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "empty").mkdir()
    assert [c.text for c in expand_paths([str(tmp_path)])] == [
        str(tmp_path / n) for n in ("a.safetensors", "b.pt", "step_100", "step_200")
    ]
    with pytest.raises(CheckpointError, match="separate checkpoints"):
        open_checkpoint(tmp_path)
    for bad, words in ((tmp_path / "empty", "holds no checkpoint"), (tmp_path / "nothing-*.pt", "matches no file")):
        with pytest.raises(CheckpointError, match=words):
            expand_paths([str(bad)])


def test_diff_matches_tensors_by_name_whatever_the_shard_layout(tmp_path: Path) -> None:
    g = fresh_generator()
    shards = model(g, torch.bfloat16)
    save_sharded(tmp_path / "a", shards)
    merged = {k: v for s in shards for k, v in s.items()}
    changed = "model.layers.2.mlp.down_proj.weight"
    after = dict(merged, **{changed: merged[changed] * 2 + 1})
    names = list(after)
    save_sharded(tmp_path / "b", [{k: after[k] for k in names[:5]}, {k: after[k] for k in names[5:]}])
    rows = {r["name"]: r for r in diff_checkpoints(tmp_path / "a", tmp_path / "b")}
    assert set(rows) == set(merged)
    assert rows[changed]["status"] == "changed"
    want = int((merged[changed].view(torch.int16) != after[changed].view(torch.int16)).sum())
    assert rows[changed]["changed"] == want > 0
    assert all(r["status"] == "identical" for n, r in rows.items() if n != changed)


def test_the_cli_scans_a_sharded_folder_and_names_each_tensors_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = model(fresh_generator(), torch.float32)
    weight_map = save_sharded(tmp_path / "m", shards)
    capsys.readouterr()  # the seed line
    assert main(["scan", str(tmp_path / "m"), "--json"]) == 1  # the NaN is an error
    (f,) = json.loads(capsys.readouterr().out)["files"]
    assert f["format"] == "safetensors-sharded" and f["shards"] == 3
    assert {r["name"]: r["shard"] for r in f["tensors"]} == weight_map


def test_a_copy_of_the_shards_in_a_second_folder_scans_alike(tmp_path: Path) -> None:
    shards = model(fresh_generator(), torch.float16)
    weight_map = save_sharded(tmp_path / "a", shards)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    one, two = (scan_checkpoint(tmp_path / n) for n in ("a", "b"))
    assert one.rows == two.rows
    check_scan(tmp_path / "b", shards, weight_map)


# --- an index that leaves shards out ------------------------------------------------------------


def rewrite_weight_map(index: Path, change: Callable[[dict[str, str]], dict[str, str]]) -> None:
    doc = json.loads(index.read_text())
    doc["weight_map"] = change(doc["weight_map"])
    index.write_text(json.dumps(doc))


@pytest.mark.parametrize("how", ["folder", "index file"])
@pytest.mark.parametrize("shards_beside", [True, False], ids=["shards beside it", "alone"])
def test_an_index_naming_no_tensor_is_an_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, how: str, shards_beside: bool
) -> None:
    """It once scanned as "0 tensors ... no findings" beside an all-NaN shard."""
    save_sharded(tmp_path, [{"w": torch.full((4,), math.nan)}])
    index = tmp_path / "model.safetensors.index.json"
    rewrite_weight_map(index, lambda weight_map: {})
    if not shards_beside:
        (tmp_path / "model-00001-of-00001.safetensors").unlink()
    path = tmp_path if how == "folder" else index
    with pytest.raises(CheckpointError) as refused:
        open_checkpoint(path)
    message = str(refused.value)
    assert message.startswith(f"{index}: names no tensor (its \"weight_map\" is empty)") and "\n" not in message
    assert ("model-00001-of-00001.safetensors" in message) == shards_beside
    capsys.readouterr()
    assert main(["scan", str(path)]) == 2
    assert capsys.readouterr() == ("", f"zeroscan: error: {message}\n")


@pytest.mark.parametrize("how", ["folder", "index file"])
def test_shards_of_a_set_the_index_leaves_out_are_scanned(tmp_path: Path, how: str) -> None:
    """An index naming shards 1 and 3 of model-*-of-00003 beside shard 2 (which holds the NaN)."""
    shards = model(fresh_generator(), torch.float32)
    weight_map = save_sharded(tmp_path, shards)
    index = tmp_path / "model.safetensors.index.json"
    rewrite_weight_map(index, lambda wm: {k: v for k, v in wm.items() if v != "model-00002-of-00003.safetensors"})
    check_scan(tmp_path if how == "folder" else index, shards, weight_map)


@pytest.mark.parametrize("count", ["00003", "999999999999"])
def test_the_shard_count_an_index_names_is_not_counted_through(tmp_path: Path, count: str) -> None:
    """The index names shards 1 and 3 of model-*-of-COUNT; shard 2 lies beside
    them. COUNT is the index's word: "-of-999999999999" once meant a stat call
    for every k up to it, hours before the scan began. Shard 2 is found from
    the folder's listing and scanned, in a process with a time limit."""
    shards = model(fresh_generator(), torch.float32)
    weight_map = {}
    for k, tensors in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{count}.safetensors"
        save_file(tensors, str(tmp_path / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in tensors})
    named = {t: f for t, f in weight_map.items() if "-00002-" not in f}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": named}))
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "zeroscan", "scan", "--json", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # the NaN planted in shard 2
    (scanned,) = json.loads(proc.stdout)["files"]
    assert {row["name"]: row["shard"] for row in scanned["tensors"]} == weight_map
    check_scan(tmp_path, shards, weight_map)  # and each row against the float64 reference


def test_files_beside_an_index_that_it_does_not_name_are_scanned_too(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A trainer's checkpoint folder: the model's shards and index, and an optimizer.pt beside them."""
    g = fresh_generator()
    shards = model(g, torch.float32)
    folder = tmp_path / "checkpoint-500"
    save_sharded(folder, shards)
    poisoned = make_values(40, torch.float32, g, specials=False)
    poisoned[int(torch.randint(0, 40, (), generator=g))] = math.nan
    torch.save({"state": {"0": {"exp_avg": poisoned}}}, folder / "optimizer.pt")
    index, optimizer = folder / "model.safetensors.index.json", folder / "optimizer.pt"
    assert [c.text for c in expand_paths([str(folder)])] == [str(index), str(optimizer)]
    # the shards named by their index
    assert [c.text for c in expand_paths([str(folder / "*.safetensors")])] == [str(index)]
    capsys.readouterr()
    assert main(["scan", str(folder), "--json"]) == 1
    model_file, optimizer_file = json.loads(capsys.readouterr().out)["files"]
    assert model_file["path"] == str(index) and len(model_file["tensors"]) == sum(map(len, shards))
    (row,) = optimizer_file["tensors"]
    assert row["name"] == "state.0.exp_avg" and row["severity"] == "error"
    assert_matches_reference(as_record(row), poisoned)
    with pytest.raises(CheckpointError, match=r"is a folder of 2 separate checkpoints \(model.safetensors.index.json, "
                                              r"optimizer.pt\), not one"):
        open_checkpoint(folder)


# --- a folder is scanned whole, or refused ------------------------------------------------------


def dcp_folder(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=folder, no_dist=True)


def nan_tensor(g: torch.Generator) -> dict[str, torch.Tensor]:
    x = make_values(30, torch.float32, g, specials=False)
    x[int(torch.randint(0, 30, (), generator=g))] = math.nan
    return {"hidden.weight": x}


def layout_of(kind: str, root: Path, g: torch.Generator) -> list[str]:
    """A folder whose one checkpoint of its own sits beside more checkpoints, the
    NaN in one of those; the paths expand_paths must list for it, relative to root."""
    root.mkdir()
    if kind == "one file, checkpoint folders":  # the runs/
        torch.save({"w": torch.randn(8, generator=g)}, root / "llama.pt")
        save_sharded(root / "step_100", [nan_tensor(g)])
        save_sharded(root / "step_200", [{"w": torch.randn(8, generator=g)}], index=False)
        return ["llama.pt", "step_100", "step_200"]
    if kind == "one file, a plain folder of checkpoints":
        save_file({"w": torch.randn(8, generator=g)}, str(root / "model.safetensors"))
        (root / "old" / "deeper").mkdir(parents=True)
        torch.save(nan_tensor(g), root / "old" / "deeper" / "a.pt")
        torch.save({"w": torch.randn(8, generator=g)}, root / "old" / "deeper" / "b.pt")
        return ["model.safetensors", "old/deeper/a.pt", "old/deeper/b.pt"]
    if kind == "an index, a sub-folder":  # Meta's original/ weights beside the converted shards
        save_sharded(root, [{"w": torch.randn(8, generator=g)}, {"v": torch.randn(8, generator=g)}])
        (root / "original").mkdir()
        torch.save(nan_tensor(g), root / "original" / "consolidated.00.pth")
        return ["model.safetensors.index.json", "original"]
    if kind == "shards, a sub-folder":
        save_sharded(root, [{"a": torch.ones(3)}, {"b": torch.ones(3)}], index=False)
        save_sharded(root / "ema", [nan_tensor(g)], index=False)
        return ["ema", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert kind == "DCP, a file"
    dcp_folder(root, {"w": torch.randn(8, generator=g)})
    torch.save(nan_tensor(g), root / "train_state.pt")
    return [".metadata", "train_state.pt"]


LAYOUTS = ["one file, checkpoint folders", "one file, a plain folder of checkpoints", "an index, a sub-folder",
           "shards, a sub-folder", "DCP, a file"]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_a_folder_is_scanned_whole_never_in_part(capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str) -> None:
    """A folder with one checkpoint of its own once scanned as that one alone,
    passing over the rest (the NaN here) in silence."""
    root = tmp_path / "runs"
    want = [str(root / p) for p in layout_of(kind, root, fresh_generator())]
    assert [c.text for c in expand_paths([str(root)])] == want
    capsys.readouterr()
    assert main(["scan", str(root), "--json"]) == 1
    files = json.loads(capsys.readouterr().out)["files"]
    assert [f["path"] for f in files] == want
    nan = [(f["path"], r["name"]) for f in files for r in f["tensors"] if r["nan"]]
    assert len(nan) == 1 and nan[0][1] == "hidden.weight"
    with pytest.raises(CheckpointError, match=f"^{root}: is a folder of {len(want)} separate checkpoints"):
        open_checkpoint(root)


def test_a_link_back_up_the_tree_is_followed_once(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    torch.save({"w": torch.ones(2)}, root / "a.pt")
    (root / "sub").mkdir()
    torch.save({"w": torch.ones(2)}, root / "sub" / "b.pt")
    (root / "sub" / "up").symlink_to(root)
    assert [c.text for c in expand_paths([str(root)])] == [str(root / "a.pt"), str(root / "sub" / "b.pt")]
