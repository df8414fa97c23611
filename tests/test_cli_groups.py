"""Reading a checkpoint of thousands of tensors: the worst-first order, --limit,
--group-by layer/module/shard (zeroscan.checkpoint.groups), folders and globs as
PATHs, progress over a whole checkpoint, and --diff saying which tensors
became NaN/Inf or all zero, counted exactly."""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fresh_generator, run_cli, run_cli_json
from safetensors.torch import save_file

from zeroscan import checkpoint
from zeroscan.cli.progress import LARGE_LOG_BYTES, Progress
from zeroscan.checkpoint import paths
from zeroscan.checkpoint.groups import diff_groups, group_of, layer_of, module_of, scan_groups, worst_first

GROUP_KEYS = {"group", "tensors", "elements", "zeros", "zero_fraction", "subnormal", "near_zero", "nan", "inf",
              "skipped", "findings", "severity", "worst_tensor"}
DIFF_GROUP_KEYS = {"group", "tensors", "changed", "identical", "added", "removed", "reshaped", "retyped", "unread",
                   "became_nan", "became_zero", "findings", "severity", "worst_tensor"}




def table_names(out: str, prefix: str) -> list[str]:
    """The first cell of each table line whose first cell starts with `prefix`."""
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


# --- the group of a name ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "layer", "module"),
    [
        ("model.layers.17.self_attn.q_proj.weight", "model.layers.17", "model.layers.17.self_attn.q_proj"),
        ("transformer.h.3.mlp.c_fc.weight", "transformer.h.3", "transformer.h.3.mlp.c_fc"),
        ("model.embed_tokens.weight", "model.embed_tokens", "model.embed_tokens"),  # no index: its module
        ("lm_head.weight", "lm_head", "lm_head"),
        ("layer1.0.conv1.weight", "layer1.0", "layer1.0.conv1"),  # "layer1" has a digit but is not an index
        ("0.weight", "0", "0"),  # nn.Sequential at the top level
        ("blocks.03.attn.qkv", "blocks.03", "blocks.03.attn"),  # leading zeros are still an index
        ("optimizer.state.3.exp_avg", "optimizer.state.3", "optimizer.state.3"),
        ("params.0", "params.0", "params"),  # a ParameterList entry ends in its index
        ("h.\u00b2.attn.w", "h.\u00b2.attn", "h.\u00b2.attn"),  # a superscript two: str.isdigit, not an index
        ("x.1e5.attn.y", "x.1e5.attn", "x.1e5.attn"),
        ("a.-1.attn.b", "a.-1.attn", "a.-1.attn"),
        ("a..b", "a.", "a."),  # an empty component is not an index
        ("weight", "", ""),  # one component: the top level
    ],
)
def test_layer_and_module_of_a_name(name: str, layer: str, module: str) -> None:
    assert layer_of(name) == layer
    assert module_of(name) == module
    assert group_of({"name": name}, "layer") == layer and group_of({"name": name}, "module") == module


def test_shard_of_a_row() -> None:
    assert group_of({"name": "w", "shard": "model-00002-of-00003.safetensors"}, "shard", "x") == (
        "model-00002-of-00003.safetensors"
    )
    assert group_of({"name": "w", "shard": ""}, "shard", "model.pt") == "model.pt"  # a one-file checkpoint
    assert group_of({"name": "w"}, "shard", "model.pt") == "model.pt"
    assert group_of({"name": "w", "shard": "__0_0.distcp,__1_0.distcp"}, "shard") == "__0_0.distcp,__1_0.distcp"
    with pytest.raises(ValueError, match="by must be one of layer, module, shard, got 'file'"):
        group_of({"name": "w"}, "file")


def scan_row(name: str, numel: int, severity: str = "ok", zeros: int = 0, nan: int = 0, posinf: int = 0,
             **extra: Any) -> dict[str, Any]:
    return {"name": name, "numel": numel, "zeros": zeros, "subnormal": extra.pop("subnormal", 0),
            "near_zero": extra.pop("near_zero", 0), "nan": nan, "posinf": posinf, "neginf": 0,
            "severity": severity, **extra}


def test_scan_groups_sum_and_order_worst_first() -> None:
    rows = [
        scan_row("embed.weight", 100),
        scan_row("layers.0.q.weight", 50, zeros=5),
        scan_row("layers.0.k.weight", 50, "warning", zeros=50),
        scan_row("layers.1.q.weight", 50, subnormal=3, near_zero=7),
        scan_row("layers.1.k.weight", 50, "error", nan=2, posinf=1),
        scan_row("layers.1.v.weight", 50, "error", nan=4),
        scan_row("layers.2.q.weight", 50),
        scan_row("head.weight", 10, zeros=1),
    ]
    skipped = [{"name": "layers.2.v.weight", "dtype": "float32", "shape": [5], "reason": "missing",
                "severity": "error"},
               {"name": "head.scale", "dtype": "uint16", "shape": [1], "reason": "a dtype not scanned"}]
    groups = scan_groups(rows, "layer", skipped=skipped)
    assert all(set(g) == GROUP_KEYS for g in groups)
    by_name = {g["group"]: g for g in groups}
    # errors (layers.1 has 7 NaN/Inf elements, layers.2 none), the warning, then by zero fraction, ties as they came
    assert [g["group"] for g in groups] == ["layers.1", "layers.2", "layers.0", "head", "embed"]
    assert by_name["layers.1"] == {
        "group": "layers.1", "tensors": 3, "elements": 150, "zeros": 0, "zero_fraction": 0.0, "subnormal": 3,
        "near_zero": 7, "nan": 6, "inf": 1, "skipped": 0, "findings": 2, "severity": "error",
        "worst_tensor": "layers.1.v.weight",  # 4 NaN/Inf elements against k's 3
    }  # fmt: skip
    assert by_name["layers.0"]["zero_fraction"] == pytest.approx(55 / 100)
    assert by_name["layers.0"]["worst_tensor"] == "layers.0.k.weight" and by_name["layers.0"]["findings"] == 1
    # a skipped entry's severity is the group's; one without a severity is info
    assert by_name["layers.2"]["severity"] == "error" and by_name["layers.2"]["worst_tensor"] == "layers.2.v.weight"
    assert by_name["layers.2"]["skipped"] == 1 and by_name["layers.2"]["findings"] == 0
    assert by_name["head"]["severity"] == "info" and by_name["head"]["tensors"] == 1
    assert by_name["embed"]["severity"] == "ok" and by_name["embed"]["worst_tensor"] == "embed.weight"
    modules = scan_groups(rows, "module")
    assert {g["group"] for g in modules} == {"embed", "layers.0.q", "layers.0.k", "layers.1.q", "layers.1.k",
                                             "layers.1.v", "layers.2.q", "head"}
    shards = scan_groups([dict(r, shard=f"s{i % 2}") for i, r in enumerate(rows)], "shard")
    # both hold an error: s1 has 4 NaN/Inf elements (layers.1.v), s0 3 (layers.1.k)
    assert [(g["group"], g["tensors"], g["nan"] + g["inf"]) for g in shards] == [("s1", 4, 4), ("s0", 4, 3)]


def test_worst_first_breaks_ties_in_file_order() -> None:
    rows = [scan_row(f"t{i}", 10, sev, zeros=z, nan=n) for i, (sev, z, n) in enumerate(
        [("ok", 0, 0), ("warning", 10, 0), ("ok", 3, 0), ("error", 0, 1), ("ok", 0, 0), ("warning", 10, 0),
         ("error", 0, 4), ("info", 0, 0)])]
    assert [r["name"] for r in worst_first(rows)] == ["t6", "t3", "t1", "t5", "t7", "t2", "t0", "t4"]


def test_diff_groups_count_statuses_and_what_tensors_became() -> None:
    def row(name: str, status: str, severity: str = "ok", became: str = "", **extra: Any) -> dict[str, Any]:
        return {"name": name, "status": status, "severity": severity, "became": became, **extra}

    rows = [
        row("layers.0.q", "changed", changed_fraction=0.5),
        row("layers.0.k", "identical", "info"),
        row("layers.1.q", "changed", "warning", "zero", changed_fraction=1.0),
        row("layers.1.k", "changed", "error", "nan", changed_fraction=0.1),
        row("layers.1.v", "changed", "error", "nan", changed_fraction=0.2),
        row("layers.2.q", "removed", "info"),
        row("layers.2.k", "added", "info"),
        row("layers.2.v", "reshaped", "info"),
        row("head", "unread", "info"),
    ]
    groups = diff_groups(rows, "layer")
    assert all(set(g) == DIFF_GROUP_KEYS for g in groups)
    assert [g["group"] for g in groups] == ["layers.1", "layers.0", "layers.2", ""]
    first = groups[0]
    assert (first["tensors"], first["changed"], first["identical"]) == (3, 3, 0)
    assert (first["became_nan"], first["became_zero"], first["findings"]) == (2, 1, 3)
    assert first["severity"] == "error" and first["worst_tensor"] == "layers.1.v"  # the larger changed fraction
    assert {s: groups[2][s] for s in ("removed", "added", "reshaped", "changed")} == {
        "removed": 1, "added": 1, "reshaped": 1, "changed": 0}
    assert groups[1]["became_nan"] == 0 and groups[1]["severity"] == "info"


# --- --sort worst and --limit on real checkpoints --------------------------------------------


def planted_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Healthy, NaN-poisoned, all-zero and underflowed tensors, and the order --sort worst gives them."""
    g = fresh_generator()
    n = int(torch.randint(40, 200, (), generator=g))

    def poisoned(count: int) -> torch.Tensor:
        x = torch.randn(n, 4, generator=g)
        x.view(-1)[torch.randperm(4 * n, generator=g)[:count]] = math.nan
        return x

    some_zeros = torch.randn(n, 4, generator=g)
    some_zeros.view(-1)[torch.randperm(4 * n, generator=g)[: n // 4]] = 0.0  # 1/16 zero: still healthy
    tensors = {
        "h0.weight": torch.randn(n, 4, generator=g),
        "nan_few.weight": poisoned(1),
        "zero.weight": torch.zeros(n, 4),
        "h1.weight": some_zeros,
        "nan_many.weight": poisoned(5),
        "tiny.weight": torch.randn(n, 4, generator=g) * 1e-41,
        "h2.weight": torch.randn(n, 4, generator=g),
    }
    save_file(tensors, str(path))
    # errors by NaN count, the all-zero warning before the underflow (zero fraction), the healthy by zero
    # fraction, then in file order (safetensors keeps names sorted)
    return tensors, ["nan_many.weight", "nan_few.weight", "zero.weight", "tiny.weight", "h1.weight", "h0.weight",
                     "h2.weight"]


def test_sort_worst_is_the_default_in_tables(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "planted.safetensors"
    tensors, want = planted_checkpoint(path)
    rc, doc = run_cli_json(capsys, "scan", str(path), "--sort", "worst")
    assert rc == 1 and [r["name"] for r in doc["files"][0]["tensors"]] == want
    rc, out, _ = run_cli(capsys, "scan", str(path))
    names = [line.split()[0] for line in out.splitlines()[2:] if line.split() and line.split()[0] in tensors]
    assert names == want
    findings = [line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("  ")]
    assert findings == ["nan_many.weight", "nan_few.weight", "zero.weight", "tiny.weight"]
    _, doc = run_cli_json(capsys, "scan", str(path))  # JSON keeps file order unless --sort says otherwise
    assert [r["name"] for r in doc["files"][0]["tensors"]] == sorted(tensors)


@pytest.fixture
def many(tmp_path: Path) -> Path:
    """1,100 small tensors in 110 layers: layer k % 11 == 3 all zero (a warning each), the rest healthy."""
    g = fresh_generator()
    tensors = {f"model.layers.{k}.w{j}": torch.zeros(4) if k % 11 == 3 else torch.randn(4, generator=g) + 3
               for k in range(110) for j in range(10)}
    path = tmp_path / "many.safetensors"
    save_file(tensors, str(path))
    return path


def test_limit_caps_tables_and_findings(capsys: pytest.CaptureFixture[str], many: Path) -> None:
    rc, out, _ = run_cli(capsys, "scan", str(many), "--fail-on", "none")
    assert rc == 0
    assert len(table_names(out, "model.layers.")) == 50
    assert "… 1,050 more tensors not shown (--limit 0 shows all)\n" in out
    warnings = [line for line in out.splitlines() if line.startswith("  WARNING ")]
    assert len(warnings) == 50 and "  … 50 more findings not shown (--limit 0 shows all)\n" in out
    assert out.rstrip().endswith("1100 tensors scanned, 100 findings (100 warnings)")

    rc, out, _ = run_cli(capsys, "scan", str(many), "--limit", "7")
    shown = table_names(out, "model.layers.")
    assert len(shown) == 7 and all(int(n.split(".")[2]) % 11 == 3 for n in shown)  # all-zero layers first
    assert "… 1,093 more tensors not shown" in out and "… 93 more findings not shown" in out

    rc, out, _ = run_cli(capsys, "scan", str(many), "--limit", "0")
    assert len(table_names(out, "model.layers.")) == 1100 and "more" not in out
    assert sum(line.startswith("  WARNING ") for line in out.splitlines()) == 100

    rc, out, _ = run_cli(capsys, "scan", str(many), "--limit", "1", "--only-findings")
    assert len(table_names(out, "model.layers.")) == 1 and "… 99 more tensors not shown" in out
    assert "… 99 more findings not shown" in out

    _, doc = run_cli_json(capsys, "scan", str(many), "--limit", "3")  # JSON has every row
    assert len(doc["files"][0]["tensors"]) == 1100


def test_limit_one_more_agrees_in_number(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "two.safetensors"
    save_file({"a": torch.ones(3), "b": torch.ones(3)}, str(path))
    _, out, _ = run_cli(capsys, "scan", str(path), "--limit", "1")
    assert "… 1 more tensor not shown (--limit 0 shows all)" in out


# --- --group-by ---------------------------------------------------------------------------


def test_group_by_layer_on_a_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    layers = int(torch.randint(4, 9, (), generator=g))
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(30, 8, generator=g)}
    for k in range(layers):
        tensors[f"model.layers.{k}.self_attn.q_proj.weight"] = torch.randn(8, 8, generator=g)
        tensors[f"model.layers.{k}.mlp.up_proj.weight"] = torch.randn(16, 8, generator=g)
        tensors[f"model.layers.{k}.input_layernorm.weight"] = torch.ones(8)
    bad, dead = sorted(torch.randperm(layers, generator=g)[:2].tolist())
    poisoned = tensors[f"model.layers.{bad}.mlp.up_proj.weight"].view(-1)
    poisoned[torch.randperm(128, generator=g)[: int(torch.randint(1, 9, (), generator=g))]] = math.inf
    tensors[f"model.layers.{dead}.self_attn.q_proj.weight"].zero_()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))

    rc, doc = run_cli_json(capsys, "scan", str(path), "--group-by", "layer")
    groups = doc["files"][0]["groups"]
    assert rc == 1 and all(set(grp) == GROUP_KEYS for grp in groups)
    assert [grp["group"] for grp in groups[:2]] == [f"model.layers.{bad}", f"model.layers.{dead}"]
    assert {grp["group"] for grp in groups} == {"model.embed_tokens"} | {f"model.layers.{k}" for k in range(layers)}
    for grp in groups:
        members = {n: x for n, x in tensors.items() if layer_of(n) == grp["group"]}
        assert grp["tensors"] == len(members)
        assert grp["elements"] == sum(x.numel() for x in members.values())
        assert grp["zeros"] == sum(int((x == 0).sum()) for x in members.values())
        assert grp["inf"] == sum(int(x.isinf().sum()) for x in members.values()) and grp["nan"] == 0
    assert groups[0]["severity"] == "error" and groups[0]["worst_tensor"] == f"model.layers.{bad}.mlp.up_proj.weight"
    assert groups[1]["severity"] == "warning" and groups[1]["findings"] == 1
    assert len(doc["files"][0]["tensors"]) == len(tensors)  # the rows are all still there

    rc, out, _ = run_cli(capsys, "scan", str(path), "--group-by", "layer")
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["group", "tensors", "elements"]
    assert lines[2].split()[0] == f"model.layers.{bad}" and lines[2].split()[-2:] == ["error", "mlp.up_proj.weight"]
    assert not any(line.startswith("model.layers.") and "float32" in line for line in lines)  # no tensor table
    assert lines[2 + layers].split()[-2:] == ["ok", "-"]  # the last group: healthy, no tensor to point at
    assert "findings:" in out and f"ERROR model.layers.{bad}.mlp.up_proj.weight: nonfinite" in out

    _, doc = run_cli_json(capsys, "scan", str(path), "--group-by", "module")
    assert len(doc["files"][0]["groups"]) == len(tensors)  # every tensor here is the only one of its module
    _, doc = run_cli_json(capsys, "scan", str(path), "--group-by", "shard")
    (whole,) = doc["files"][0]["groups"]
    assert whole["group"] == "model.safetensors" and whole["tensors"] == len(tensors)
    assert whole["elements"] == sum(x.numel() for x in tensors.values())
    _, doc = run_cli_json(capsys, "scan", str(path), "--group-by", "layer", "--only-findings")
    assert [grp["group"] for grp in doc["files"][0]["groups"]] == [f"model.layers.{bad}", f"model.layers.{dead}"]
    _, doc = run_cli_json(capsys, "scan", str(path))
    assert "groups" not in doc["files"][0]


def test_group_table_stops_at_the_limit(capsys: pytest.CaptureFixture[str], many: Path) -> None:
    rc, out, _ = run_cli(capsys, "scan", str(many), "--group-by", "layer", "--limit", "12")
    shown = table_names(out, "model.layers.")
    # the ten all-zero layers first, in file order (safetensors sorts names: 102 before 14)
    assert shown[:10] == sorted(f"model.layers.{k}" for k in range(110) if k % 11 == 3)
    assert len(shown) == 12 and "… 98 more groups not shown (--limit 0 shows all)" in out


def test_a_skipped_error_fails_and_shards_are_counted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An index that names a tensor its shard lacks: a skipped entry of severity error."""
    path = tmp_path / "model.safetensors"
    save_file({f"layers.{k}.w": torch.randn(4, generator=fresh_generator()) + 3 for k in range(3)}, str(path))
    real = checkpoint.scan_checkpoint

    def sharded_scan(*args: Any, **kwargs: Any) -> checkpoint.CheckpointScan:
        result = real(*args, **kwargs)
        for i, row in enumerate(result.rows):
            row["shard"] = f"model-0000{i + 1}-of-00003.safetensors"
        shard = "model-00002-of-00003.safetensors"
        result.skipped.append({"name": "layers.1.b", "dtype": "float32", "shape": [4], "severity": "error",
                               "reason": f"{shard} lacks it", "shard": shard})
        return result

    monkeypatch.setattr(checkpoint, "scan_checkpoint", sharded_scan)
    rc, out, _ = run_cli(capsys, "scan", str(path))
    assert rc == 1  # no tensor has a finding, but the missing one is an error
    assert "(safetensors, 4 tensors, 48 B, 3 shard files)" in out.splitlines()[0]
    assert "  ERROR skipped layers.1.b (float32): model-00002-of-00003.safetensors lacks it" in out
    assert out.rstrip().endswith("3 tensors scanned, no findings, 1 skipped (1 error)")
    rc, doc = run_cli_json(capsys, "scan", str(path), "--group-by", "shard")
    assert rc == 1 and doc["summary"]["worst"] == "error" and doc["summary"]["findings"]["error"] == 0
    assert doc["files"][0]["skipped"][0]["severity"] == "error"
    assert [(grp["group"], grp["severity"], grp["skipped"]) for grp in doc["files"][0]["groups"]][0] == (
        "model-00002-of-00003.safetensors", "error", 1)
    assert run_cli(capsys, "scan", str(path), "--fail-on", "none")[0] == 0


# --- paths: folders and globs ----------------------------------------------------------------


def test_folders_and_globs_scan_each_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    folder = tmp_path / "steps"
    folder.mkdir()
    for step in (100, 200, 300):
        save_file({"w": torch.randn(8, generator=g)}, str(folder / f"step{step}.safetensors"))
    (folder / "notes.txt").write_text("not a checkpoint")
    _, doc = run_cli_json(capsys, "scan", str(folder))
    assert [f["path"] for f in doc["files"]] == [str(folder / f"step{s}.safetensors") for s in (100, 200, 300)]
    _, doc = run_cli_json(capsys, "scan", str(folder / "step[12]00.safetensors"))
    assert [Path(f["path"]).name for f in doc["files"]] == ["step100.safetensors", "step200.safetensors"]
    rc, out, err = run_cli(capsys, "scan", str(folder), "--progress")
    assert [line for line in err.splitlines() if line.endswith("100% (32 B of 32 B)")] == [
        f"scanning step{s}.safetensors: 100% (32 B of 32 B)" for s in (100, 200, 300)]  # a bar per checkpoint
    rc, out, err = run_cli(capsys, "scan", str(tmp_path / "nothing*.pt"))
    assert rc == 2 and "matches no file" in err and err.count("\n") == 1


def test_diff_needs_paths_that_name_two_checkpoints(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    for name in ("a", "b", "c"):
        save_file({"w": torch.randn(8, generator=g)}, str(tmp_path / f"{name}.safetensors"))
    rc, out, err = run_cli(capsys, "scan", str(tmp_path), "--diff")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "exactly two checkpoints; the paths given name 3: " in err and "c.safetensors" in err
    rc, doc = run_cli_json(capsys, "scan", str(tmp_path / "[ab].safetensors"), "--diff")
    assert rc == 0 and (Path(doc["a"]).name, Path(doc["b"]).name) == ("a.safetensors", "b.safetensors")
    assert doc["summary"]["changed"] == 1


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, str(path))
    for argv in (["scan", str(path), "--limit", "-1"], ["scan", str(path), str(path), "--diff", "--limit", "-5"]):
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("zeroscan: error: --limit ") and f"got {argv[-1]}" in err
    rc, out, err = run_cli(capsys, "scan", str(path), "--group-by", "file")
    assert rc == 2 and "--group-by" in err and "invalid choice" in err


# --- progress: its total from the scan ------------------------------------------------------


def test_progress_takes_its_total_from_the_first_call() -> None:
    log = io.StringIO()  # not a terminal: a line per 10 %
    progress = Progress("scanning m", enabled=True, stream=log)
    for done in range(0, 1001, 50):
        progress(done, 1000)
    progress.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 11 and lines[0] == "scanning m: 0% (0 B of 1000 B)"
    assert lines[-1] == "scanning m: 100% (1000 B of 1000 B)" and progress.total == 1000

    quiet = io.StringIO()
    small = Progress("scanning m", stream=quiet)  # enabled=None: only for a large checkpoint
    small(10, 1000)
    small(1000, 1000)
    assert quiet.getvalue() == "" and not small.enabled

    big = Progress("scanning m", stream=quiet)
    big(0, LARGE_LOG_BYTES)
    big(LARGE_LOG_BYTES, LARGE_LOG_BYTES)
    assert big.enabled and quiet.getvalue().splitlines()[-1] == "scanning m: 100% (1.0 GiB of 1.0 GiB)"

    known = Progress("scanning m", 1000, True, io.StringIO())  # a total given up front is kept
    assert known.enabled and known.total == 1000


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_starts_at_the_first_call() -> None:
    pytest.importorskip("tqdm")
    term = Terminal()
    progress = Progress("scanning \x1b[2Jm", enabled=True, stream=term)
    assert progress.bar is None  # no total yet: nothing drawn
    progress(512, 2048)
    assert progress.bar is not None and progress.bar.total == 2048 and progress.bar.n == 512
    progress(2048, 2048)
    assert progress.bar.n == 2048
    progress.close()
    assert "\x1b[2J" not in term.getvalue() and "scanning \\x1b[2Jm" in term.getvalue()


# --- --diff: what tensors became -------------------------------------------------------------


def test_diff_counts_what_became_nan_or_zero(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    n = int(torch.randint(500, 3000, (), generator=g))
    before = {
        "layers.0.w": torch.randn(n, generator=g),
        "layers.0.b": torch.randn(n, generator=g).to(torch.bfloat16),
        "layers.1.w": torch.randn(n, generator=g),
        "layers.1.b": torch.zeros(n),
        "layers.1.c": torch.zeros(n),  # all zero in both: did not become zero
        "layers.2.w": torch.randn(n, generator=g).to(torch.float8_e4m3fn),
        "layers.2.b": torch.randn(n, generator=g),
        "head": torch.randn(n, generator=g),
    }
    before["layers.0.w"][torch.randperm(n, generator=g)[:7]] = math.nan  # NaN before: not "became"
    after = {k: v.clone() for k, v in before.items()}

    def plant(x: torch.Tensor, value: float) -> None:
        x[torch.randperm(n, generator=g)[: int(torch.randint(1, n // 10, (), generator=g))]] = value

    plant(after["layers.0.w"], math.nan)  # may hit some of the 7 NaNs: those did not become NaN
    plant(after["layers.0.w"], -math.inf)
    plant(after["layers.0.b"], math.inf)
    after["layers.1.w"] = torch.zeros(n)
    after["layers.1.b"][0] = 1.0  # zero before, no longer: no finding
    after["layers.2.w"] = after["layers.2.w"].float()
    plant(after["layers.2.w"], math.nan)
    after["layers.2.w"] = after["layers.2.w"].to(torch.float8_e4m3fn)
    after["layers.2.b"] += 1.0
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(before, str(pa))
    save_file(after, str(pb))

    def became_nonfinite(name: str) -> int:
        a, b = before[name].float(), after[name].float()
        return int((a.isfinite() & ~b.isfinite()).sum())

    rc, doc = run_cli_json(capsys, "scan", str(pa), str(pb), "--diff", "--group-by", "layer")
    rows = {r["name"]: r for r in doc["tensors"]}
    assert rc == 1 and all("became" in r and "shard" in r for r in rows.values())
    for name in ("layers.0.w", "layers.0.b", "layers.2.w"):
        want = became_nonfinite(name)
        assert want > 0
        assert (rows[name]["became"], rows[name]["severity"]) == ("nan", "error"), name
        assert rows[name]["reason"] == f"became NaN/Inf at {want} element{'s' if want > 1 else ''}", name
    assert (rows["layers.1.w"]["became"], rows["layers.1.w"]["severity"]) == ("zero", "warning")
    assert rows["layers.1.w"]["reason"] == "became all zero"
    assert rows["layers.1.b"]["became"] == "" and rows["layers.1.b"]["status"] == "changed"
    assert rows["layers.1.c"]["became"] == "" and rows["layers.1.c"]["status"] == "identical"
    assert rows["layers.2.b"]["became"] == "" and rows["layers.2.b"]["severity"] == "ok"
    assert rows["head"]["became"] == "" and rows["head"]["status"] == "identical"
    assert doc["summary"]["became_nan"] == 3 and doc["summary"]["became_zero"] == 1
    groups = {grp["group"]: grp for grp in doc["groups"]}
    assert all(set(grp) == DIFF_GROUP_KEYS for grp in doc["groups"])
    # errors by the tensors that became NaN/Inf, the warning, then "head" (one component: the top level)
    assert [grp["group"] for grp in doc["groups"]] == ["layers.0", "layers.2", "layers.1", ""]
    assert (groups["layers.0"]["became_nan"], groups["layers.1"]["became_zero"]) == (2, 1)
    assert groups["layers.1"]["severity"] == "warning" and groups["layers.1"]["changed"] == 2

    rc, out, _ = run_cli(capsys, "scan", str(pa), str(pb), "--diff")
    assert rc == 1 and "3 tensors became NaN/Inf; 1 tensor became all zero" in out
    shown = table_names(out, "layers.")
    assert set(shown[:3]) == {"layers.0.w", "layers.0.b", "layers.2.w"} and shown[3] == "layers.1.w"
    assert run_cli(capsys, "scan", str(pa), str(pb), "--diff", "--fail-on", "none")[0] == 0


def test_diff_counts_an_expanded_view_without_expanding_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch.save keeps a stride-0 view as one row of storage; each NaN in it counts as often as it repeats."""
    g = fresh_generator()
    rows, cols = int(torch.randint(100, 1000, (), generator=g)), 64
    base = torch.randn(1, cols, generator=g)
    poisoned = base.clone()
    k = int(torch.randint(1, 10, (), generator=g))
    poisoned[0, torch.randperm(cols, generator=g)[:k]] = math.nan
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": base.expand(rows, cols)}, pa)
    torch.save({"w": poisoned.expand(rows, cols)}, pb)
    _, doc = run_cli_json(capsys, "scan", str(pa), str(pb), "--diff")
    (row,) = doc["tensors"]
    assert row["changed"] == k * rows and row["reason"] == f"became NaN/Inf at {k * rows} elements"


# --- a sharded model folder ----------------------------------------------------------------


def sharded_model(folder: Path, g: torch.Generator) -> dict[str, dict[str, torch.Tensor]]:
    """Three shards of six layers and their index, which also names a tensor the third shard lacks."""
    folder.mkdir()
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for k in range(6):
        shard = shards.setdefault(f"model-{k // 2 + 1:05d}-of-00003.safetensors", {})
        shard[f"model.layers.{k}.q_proj.weight"] = torch.randn(8, 8, generator=g)
        shard[f"model.layers.{k}.norm.weight"] = torch.ones(8)
    weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
    weight_map["model.layers.5.v_proj.weight"] = "model-00003-of-00003.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


def save_shards(folder: Path, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / shard))


def test_a_sharded_folder_is_one_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    folder = tmp_path / "model"
    shards = sharded_model(folder, g)
    poisoned = shards["model-00002-of-00003.safetensors"]["model.layers.3.q_proj.weight"].view(-1)
    nans = int(torch.randint(1, 10, (), generator=g))
    poisoned[torch.randperm(64, generator=g)[:nans]] = math.nan
    save_shards(folder, shards)

    for path in (folder, folder / "model.safetensors.index.json", folder / "*.safetensors"):
        rc, doc = run_cli_json(capsys, "scan", str(path), "--group-by", "shard")
        (f,) = doc["files"]  # one checkpoint, however it is named
        assert rc == 1, path
        assert {r["name"]: r["shard"] for r in f["tensors"]} == {
            name: shard for shard, tensors in shards.items() for name in tensors}
        (missing,) = f["skipped"]
        assert missing["name"] == "model.layers.5.v_proj.weight" and missing["severity"] == "error"
        groups = {grp["group"]: grp for grp in f["groups"]}
        assert [grp["group"] for grp in f["groups"]] == [
            "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors", "model-00001-of-00003.safetensors"]
        assert groups["model-00002-of-00003.safetensors"]["nan"] == nans
        assert (groups["model-00003-of-00003.safetensors"]["severity"],
                groups["model-00003-of-00003.safetensors"]["skipped"]) == ("error", 1)
        assert all(grp["tensors"] == 4 and grp["elements"] == 2 * (64 + 8) for grp in f["groups"])
    rc, out, _ = run_cli(capsys, "scan", str(folder))
    assert out.splitlines()[0].endswith(", 13 tensors, 1.7 KiB, 3 shard files)")
    assert "ERROR skipped model.layers.5.v_proj.weight: " in out

    after = tmp_path / "after"
    after.mkdir()
    (after / "model.safetensors.index.json").write_text((folder / "model.safetensors.index.json").read_text())
    changed = {shard: {n: x.clone() for n, x in tensors.items()} for shard, tensors in shards.items()}
    changed["model-00001-of-00003.safetensors"]["model.layers.1.q_proj.weight"].zero_()
    save_shards(after, changed)
    rc, doc = run_cli_json(capsys, "scan", str(folder), str(after), "--diff", "--group-by", "shard")
    assert rc == 0 and doc["summary"]["became_zero"] == 1  # a warning: below --fail-on error
    assert [(grp["group"], grp["became_zero"], grp["severity"]) for grp in doc["groups"]][0] == (
        "model-00001-of-00003.safetensors", 1, "warning")


def test_each_folder_is_classified_once(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`zeroscan scan FOLDER` works out what each folder is once, whether it
    lists the folder's checkpoints or opens the folder as one; so does
    `zeroscan diff A B` for each of its folders. Every classification runs
    paths.model_kind, which is counted here, folder by folder."""
    g = fresh_generator()
    root = tmp_path / "runs"
    root.mkdir()
    for step in (100, 200, 300):
        save_file({"w": torch.randn(8, generator=g)}, str(root / f"step{step}.safetensors"))
    model = root / "model"
    save_shards(model, sharded_model(model, g))
    after = tmp_path / "after"
    after.mkdir()
    for name in ("model.safetensors.index.json", *(f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3))):
        (after / name).write_bytes((model / name).read_bytes())

    classified: Counter[Path] = Counter()
    classify = paths.model_kind

    def counted(folder: Path) -> str | None:
        classified[folder] += 1
        return classify(folder)

    monkeypatch.setattr(paths, "model_kind", counted)
    _, doc = run_cli_json(capsys, "scan", str(root))
    steps = [str(root / f"step{s}.safetensors") for s in (100, 200, 300)]
    assert [f["path"] for f in doc["files"]] == [str(model), *steps]
    assert doc["files"][0]["shards"] == 3  # the model folder opened as one checkpoint
    assert classified == {root: 1, model: 1}

    classified.clear()
    _, doc = run_cli_json(capsys, "diff", str(model), str(after))
    assert doc["summary"]["identical"] == 12
    assert classified == {model: 1, after: 1}
