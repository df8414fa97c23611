"""The `zeroscan` command and zeroscan.checkpoint: every subcommand and flag,
exit codes, the JSON schema, planted zero/NaN tensors in real torch.save and
safetensors files, and one-line errors for unreadable files."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import fresh_generator, save_file_in_order
from safetensors.torch import save_file

import zeroscan
from zeroscan import checkpoint
from zeroscan.checkpoint import CheckpointError, open_checkpoint
from zeroscan.cli import main

ROW_KEYS = {
    "name", "dtype", "shape", "numel", "zeros", "zero_fraction", "subnormal", "near_zero", "nan", "posinf",
    "neginf", "negative", "min_abs", "min_abs_nonzero", "max_abs", "mean", "std", "norm", "verdict", "role",
    "severity", "reason", "shard",
}  # fmt: skip


def planted(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random healthy tensors plus one all-zero weight matrix, one NaN-poisoned and one underflowed tensor."""
    n = int(torch.randint(50, 400, (), generator=g))
    poisoned = torch.randn(n, 3, generator=g)
    k = int(torch.randint(1, 5, (), generator=g))
    poisoned.view(-1)[torch.randperm(3 * n, generator=g)[:k]] = math.nan
    return {
        "encoder.weight": torch.zeros(n, 8),
        "encoder.bias": torch.randn(n, generator=g),
        "decoder.weight": poisoned,
        "decoder.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "tiny.weight": torch.randn(7, 5, generator=g) * 1e-41,
        "steps": torch.randint(1, 100, (4,), generator=g),
    }


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what came before (the printed test seed)
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def scan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    rc, out, err = run(capsys, "scan", "--json", *argv)
    assert err == "" or "scanning" in err
    return rc, json.loads(out)


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return planted(fresh_generator())


@pytest.fixture
def ckpt(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / "model.pt"
    torch.save({"model": tensors, "epoch": 7, "note": "not a tensor"}, path)
    return path


def assert_row_matches(row: dict, x: torch.Tensor) -> None:
    want = zeroscan.reference_stats(x)
    assert set(row) == ROW_KEYS
    assert row["shape"] == list(x.shape)
    for field in ("numel", "zeros", "subnormal", "near_zero", "nan", "posinf", "neginf", "negative"):
        assert row[field] == want[field], field
    assert row["zero_fraction"] == pytest.approx(want["zeros"] / max(want["numel"], 1))


# --- scan ---------------------------------------------------------------------------


def test_scan_table_names_every_tensor_and_verdict(capsys: pytest.CaptureFixture[str], ckpt: Path) -> None:
    rc, out, err = run(capsys, "scan", str(ckpt))
    assert rc == 1 and err == ""  # the NaN fails the default --fail-on error
    for name in ("model.encoder.weight", "model.encoder.bias", "model.decoder.weight", "model.tiny.weight"):
        assert name in out
    header = out.splitlines()[1]
    for column in ("name", "dtype", "shape", "numel", "zero %", "subnormal", "near-zero", "nan/inf", "|x| range",
                   "mean", "std", "verdict"):
        assert column in header
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("model.")}
    assert lines["model.encoder.weight"].rstrip().endswith("exact_zero")
    assert lines["model.decoder.weight"].rstrip().endswith("nonfinite")
    assert lines["model.tiny.weight"].rstrip().endswith("underflow")
    assert lines["model.encoder.bias"].rstrip().endswith("healthy")
    assert "findings:" in out and "ERROR model.decoder.weight" in out
    assert "epoch" not in lines and "note" not in out


def test_scan_json_schema_and_values(capsys: pytest.CaptureFixture[str], ckpt: Path, tensors: dict) -> None:
    rc, doc = scan_json(capsys, str(ckpt))
    assert rc == 1
    assert doc["command"] == "scan" and doc["zeroscan"] == zeroscan.__version__ and doc["tol"] is None
    (f,) = doc["files"]
    assert f["path"] == str(ckpt) and f["format"] == "torch" and f["skipped"] == []
    assert f["nbytes"] == sum(x.numel() * x.element_size() for x in tensors.values())
    assert [r["name"] for r in f["tensors"]] == [f"model.{k}" for k in tensors]
    for row in f["tensors"]:
        assert_row_matches(row, tensors[row["name"].removeprefix("model.")])
    verdicts = {r["name"]: (r["verdict"], r["severity"]) for r in f["tensors"]}
    assert verdicts["model.encoder.weight"] == ("exact_zero", "warning")
    assert verdicts["model.decoder.weight"] == ("nonfinite", "error")
    assert verdicts["model.tiny.weight"] == ("underflow", "warning")
    assert verdicts["model.encoder.bias"] == ("healthy", "ok")
    assert {r["name"]: r["role"] for r in f["tensors"]}["model.encoder.bias"] == "bias"
    summary = doc["summary"]
    assert summary == {"files": 1, "tensors": len(tensors), "skipped": 0,
                       "findings": {"info": 0, "warning": 2, "error": 1}, "worst": "error"}
    # strict JSON: the NaN tensor's mean/std are null, not a NaN literal
    json.dumps(doc, allow_nan=False)
    poisoned = next(r for r in f["tensors"] if r["name"] == "model.decoder.weight")
    assert poisoned["nan"] > 0 and poisoned["mean"] is not None


@pytest.mark.parametrize(
    ("fail_on", "want"), [([], 1), (["--fail-on", "none"], 0), (["--fail-on", "error"], 1),
                          (["--fail-on", "warning"], 1), (["--fail-on", "info"], 1)]
)
def test_fail_on_with_findings(capsys: pytest.CaptureFixture[str], ckpt: Path, fail_on: list[str], want: int) -> None:
    assert run(capsys, "scan", str(ckpt), *fail_on)[0] == want  # the default is error: the NaN fails


def test_fail_on_gates_on_the_worst_finding(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    path = tmp_path / "warn.pt"
    torch.save({"w": torch.randn(30, generator=g), "b": torch.zeros(5)}, path)  # a warning, no error
    assert run(capsys, "scan", str(path))[0] == 0
    assert run(capsys, "scan", str(path), "--fail-on", "error")[0] == 0
    assert run(capsys, "scan", str(path), "--fail-on", "warning")[0] == 1
    healthy = tmp_path / "healthy.pt"
    torch.save({"w": torch.randn(30, generator=g) + 5}, healthy)
    assert run(capsys, "scan", str(healthy), "--fail-on", "info")[0] == 0


def test_only_findings(capsys: pytest.CaptureFixture[str], ckpt: Path) -> None:
    rc, doc = scan_json(capsys, str(ckpt), "--only-findings")
    names = {r["name"] for r in doc["files"][0]["tensors"]}
    assert names == {"model.encoder.weight", "model.decoder.weight", "model.tiny.weight"}
    assert doc["summary"]["tensors"] == 6  # the summary counts every tensor
    rc, out, _ = run(capsys, "scan", str(ckpt), "--only-findings")
    assert "model.encoder.bias " not in out and "model.encoder.weight" in out


def test_only_findings_on_a_healthy_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "ok.pt"
    torch.save({"w": torch.randn(10, generator=fresh_generator()) + 5}, path)
    rc, out, _ = run(capsys, "scan", str(path), "--only-findings")
    assert rc == 0 and "no tensor has a finding" in out and "no findings" in out


@pytest.mark.parametrize(
    ("saved", "want"),
    [({"w": torch.zeros(3, 3)}, ["(torch, 1 tensor, 36 B)", "1 tensor scanned, 1 finding (1 warning)"]),
     ({"w": torch.zeros(3, 3), "v": torch.zeros(2, 2), "x": torch.full((4,), 2.0)},
      ["(torch, 3 tensors, 68 B)", "3 tensors scanned, 3 findings (2 warnings, 1 info)"])],
)
def test_counts_in_the_text_agree_in_number(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, saved: dict[str, torch.Tensor], want: list[str]
) -> None:
    path = tmp_path / "t.pt"
    torch.save(saved, path)
    rc, out, _ = run(capsys, "scan", str(path))
    for text in want:
        assert text in out


@pytest.mark.parametrize(
    "key", ["worst", "order", "name", "numel", "zeros", "subnormal", "near-zero", "nan", "severity"]
)
def test_sort(capsys: pytest.CaptureFixture[str], ckpt: Path, tensors: dict, key: str) -> None:
    _, doc = scan_json(capsys, str(ckpt), "--sort", key)
    rows = doc["files"][0]["tensors"]
    names = [r["name"] for r in rows]
    if key == "order":
        assert names == [f"model.{k}" for k in tensors]
    elif key == "name":
        assert names == sorted(names)
    elif key == "numel":
        assert [r["numel"] for r in rows] == sorted((r["numel"] for r in rows), reverse=True)
    elif key == "zeros":
        assert names[0] == "model.encoder.weight"
    elif key in ("subnormal", "near-zero"):
        assert names[0] == "model.tiny.weight"
    elif key == "nan":
        assert names[0] == "model.decoder.weight"
    elif key == "worst":  # the error, then the all-zero warning, then the underflowed one
        assert names[:3] == ["model.decoder.weight", "model.encoder.weight", "model.tiny.weight"]
    else:
        assert rows[0]["severity"] == "error" and rows[-1]["severity"] == "ok"
    rc, out, _ = run(capsys, "scan", str(ckpt), "--sort", key)
    table = [line.split()[0] for line in out.splitlines()[2:] if line.startswith("model.")][: len(names)]
    assert table == names


def test_tol_and_mostly_zero(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    x = (torch.rand(200, generator=g) + 0.5) * 1e-3  # |x| in [5e-4, 1.5e-3]
    y = torch.randn(100, generator=g)
    y[:95] = 0.0
    path = tmp_path / "t.pt"
    torch.save({"x": x, "y": y}, path)
    _, doc = scan_json(capsys, str(path))
    assert [r["verdict"] for r in doc["files"][0]["tensors"]] == ["healthy", "mostly_zero"]
    _, doc = scan_json(capsys, str(path), "--tol", "1e-2", "--mostly-zero", "0.99")
    rows = doc["files"][0]["tensors"]
    assert doc["tol"] == 1e-2
    assert rows[0]["near_zero"] == 200 and rows[0]["verdict"] == "underflow"
    assert rows[1]["verdict"] != "mostly_zero"
    for bad in (["--tol", "-1"], ["--tol", "x"], ["--tol", "nan"], ["--tol", "-inf"],
                ["--mostly-zero", "0"], ["--mostly-zero", "2"]):
        code, _, err = run(capsys, "scan", str(path), *bad)
        assert code == 2 and "internal error" not in err and f"argument {bad[0]}" in err
    _, doc = scan_json(capsys, str(path), "--tol", "-0")
    assert math.copysign(1.0, doc["tol"]) == 1.0 and doc["files"][0]["tensors"][0]["near_zero"] == 0


def test_nested_containers_lists_and_legacy_format(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    obj = {
        "model": {"layers": [torch.randn(3, generator=g), {"w": torch.zeros(2)}]},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(3, generator=g)}}, "param_groups": [{"lr": 0.1}]},
        "pair": (torch.ones(1), 5),
    }
    for legacy in (False, True):
        path = tmp_path / f"nested{legacy}.pt"
        torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
        _, doc = scan_json(capsys, str(path))
        f = doc["files"][0]
        assert f["format"] == ("torch-legacy" if legacy else "torch")
        assert [r["name"] for r in f["tensors"]] == [
            "model.layers.0", "model.layers.1.w", "optimizer.state.0.exp_avg", "pair.0"
        ]
        assert f["tensors"][1]["verdict"] == "exact_zero"


def test_a_bare_tensor_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save(torch.zeros(4, 4), path)
    _, doc = scan_json(capsys, str(path))
    assert [(r["name"], r["verdict"]) for r in doc["files"][0]["tensors"]] == [("tensor", "exact_zero")]


def test_integer_all_zero_is_only_info_and_odd_dtypes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    c = torch.randn(6, dtype=torch.complex64, generator=g)
    path = tmp_path / "odd.pt"
    torch.save({"token_type_ids": torch.zeros(2, 7, dtype=torch.int64), "c": c,
                "u": torch.zeros(3, dtype=torch.uint16), "mask": torch.zeros(4, dtype=torch.bool)}, path)
    rc, doc = scan_json(capsys, str(path), "--fail-on", "warning")
    f = doc["files"][0]
    rows = {r["name"]: r for r in f["tensors"]}
    assert rc == 0
    assert rows["token_type_ids"]["severity"] == "info" and "integer" in rows["token_type_ids"]["reason"]
    assert rows["mask"]["severity"] == "info"
    assert rows["c"]["numel"] == 12  # real and imaginary parts
    assert rows["c"]["zeros"] == int((torch.view_as_real(c) == 0).sum())
    assert [s["name"] for s in f["skipped"]] == ["u"] and "uint16" in f["skipped"][0]["reason"]
    rc, out, _ = run(capsys, "scan", str(path))
    assert "skipped u (uint16)" in out


def test_several_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path) -> None:
    other = tmp_path / "other.pt"
    torch.save({"w": torch.randn(9, generator=fresh_generator())}, other)
    rc, doc = scan_json(capsys, str(ckpt), str(other), "--fail-on", "error")
    assert rc == 1 and [f["path"] for f in doc["files"]] == [str(ckpt), str(other)]
    assert doc["summary"]["files"] == 2 and doc["summary"]["tensors"] == 7
    rc, out, _ = run(capsys, "scan", str(ckpt), str(other))
    assert str(ckpt) in out and str(other) in out


# --- safetensors --------------------------------------------------------------------


def test_safetensors_written_here_scans_like_torch_save(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tensors: dict
) -> None:
    st = tmp_path / "model.safetensors"
    save_file(tensors, st, metadata={"format": "pt"})
    pt = tmp_path / "model.pt"
    torch.save(tensors, pt)
    _, a = scan_json(capsys, str(st))
    _, b = scan_json(capsys, str(pt))
    assert a["files"][0]["format"] == "safetensors"
    rows_a = {r["name"]: r for r in a["files"][0]["tensors"]}
    rows_b = {r["name"]: r for r in b["files"][0]["tensors"]}
    assert json.dumps(rows_a, sort_keys=True) == json.dumps(rows_b, sort_keys=True)
    for name, x in tensors.items():
        assert_row_matches(rows_a[name], x)
    with open_checkpoint(st) as c:
        assert c.metadata == {"format": "pt"}
        for name, x in tensors.items():
            got = c.tensor(name)
            assert got.dtype == x.dtype and torch.equal(got.view(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
     torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.complex64],
)
def test_safetensors_dtypes_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    g = fresh_generator()
    x = (torch.randn(5, 3, generator=g, dtype=torch.complex64) if dtype.is_complex
         else (torch.randn(5, 3, generator=g) * 50).to(dtype))
    empty = torch.empty(0, 4, dtype=dtype)
    path = tmp_path / "x.safetensors"
    save_file_in_order({"x": x, "empty": empty, "scalar": x.reshape(-1)[0].clone()}, path)
    with open_checkpoint(path) as c:
        assert c.names() == ["x", "empty", "scalar"]
        for name, want in (("x", x), ("empty", empty), ("scalar", x.reshape(-1)[0])):
            got = c.tensor(name)
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_safetensors_package_interoperates(tmp_path: Path, tensors: dict) -> None:
    st = pytest.importorskip("safetensors.torch")
    theirs = tmp_path / "theirs.safetensors"
    st.save_file({k: v.contiguous() for k, v in tensors.items()}, str(theirs))
    with open_checkpoint(theirs) as c:
        assert sorted(c.names()) == sorted(tensors)
        for name, x in tensors.items():
            assert torch.equal(c.tensor(name).view(torch.uint8), x.view(torch.uint8))
    ours = tmp_path / "ours.safetensors"
    save_file(tensors, ours)
    loaded = st.load_file(str(ours))
    for name, x in tensors.items():
        assert torch.equal(loaded[name].view(torch.uint8), x.view(torch.uint8))


def test_safetensors_misaligned_tensor_is_read_correctly(tmp_path: Path) -> None:
    g = fresh_generator()
    x = torch.randn(9, generator=g, dtype=torch.float64)
    header = json.dumps({"pad": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "x": {"dtype": "F64", "shape": [9], "data_offsets": [3, 75]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02\x03" + x.numpy().tobytes())
    with open_checkpoint(path) as c:
        got = c.tensor("x")
        assert got.data_ptr() % 8 == 0 and torch.equal(got, x)
        s = zeroscan.stats(got)
        assert s.numel == 9 and s.norm == pytest.approx(float(x.norm()), rel=1e-12)


def test_safetensors_tensors_are_memory_mapped(tmp_path: Path) -> None:
    """A tensor read from the file reflects a later change to the file's bytes:
    it is a view of the mapped pages, not a copy."""
    x = torch.arange(1024, dtype=torch.float32)
    path = tmp_path / "m.safetensors"
    save_file({"x": x}, path)
    with open_checkpoint(path) as c:
        got = c.tensor("x")
        (n,) = struct.unpack("<Q", path.read_bytes()[:8])
        with open(path, "r+b") as f:
            f.seek(8 + n + 4 * 1000)
            f.write(struct.pack("<f", -7.5))
        assert float(got[1000]) == -7.5 and float(got[999]) == 999.0


def test_torch_checkpoints_are_loaded_memory_mapped_and_weights_only(
    monkeypatch: pytest.MonkeyPatch, ckpt: Path
) -> None:
    calls = []
    real = torch.load

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    with open_checkpoint(ckpt) as c:
        assert len(c) == 6
    assert calls == [{"map_location": "cpu", "weights_only": True, "mmap": True}]


def test_scan_batches_and_reports_progress(ckpt: Path) -> None:
    seen: list[tuple[int, int]] = []
    result = checkpoint.scan_checkpoint(ckpt, progress=lambda d, t: seen.append((d, t)), batch_bytes=256)
    total = seen[-1][1]
    assert len(result.rows) == 6 and len(seen) >= 3
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == total


# --- progress on stderr ---------------------------------------------------------------


def test_progress_lines_without_tqdm(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, ckpt: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    rc, out, err = run(capsys, "scan", str(ckpt), "--progress")
    assert rc == 1 and "scanning model.pt: 100%" in err
    rc, out, err = run(capsys, "scan", str(ckpt), "--no-progress")
    assert err == ""
    rc, out, err = run(capsys, "scan", str(ckpt))  # small file, not a terminal: quiet
    assert err == ""


# --- diff ---------------------------------------------------------------------------


def test_diff(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    before = {"a": torch.randn(40, generator=g), "frozen": torch.randn(12, generator=g),
              "count": torch.tensor(3), "gone": torch.ones(2), "grows": torch.ones(3),
              "kind": torch.ones(2), "nan": torch.full((5,), math.nan)}
    after = dict(before)
    k = int(torch.randint(1, 40, (), generator=g))
    idx = torch.randperm(40, generator=g)[:k]
    a2 = before["a"].clone()
    a2[idx] += 0.5
    after.update(a=a2, new=torch.zeros(1), grows=torch.ones(4), kind=torch.ones(2, dtype=torch.float16))
    del after["gone"]
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(before, pa)
    torch.save(after, pb)
    rc, out, _ = run(capsys, "scan", str(pa), str(pb), "--diff", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["command"] == "diff" and doc["a"] == str(pa) and doc["b"] == str(pb)
    rows = {r["name"]: r for r in doc["tensors"]}
    assert rows["a"]["status"] == "changed" and rows["a"]["changed"] == k
    assert rows["a"]["changed_fraction"] == pytest.approx(k / 40)
    assert rows["a"]["max_abs_diff"] == pytest.approx(float((a2 - before["a"]).abs().max()), rel=1e-6)
    assert rows["frozen"]["status"] == "identical" and rows["frozen"]["severity"] == "info"
    assert rows["frozen"]["reason"] == "unchanged while 1 other tensor changed"
    assert rows["nan"]["status"] == "identical"  # bit-identical, although NaN != NaN
    assert rows["count"]["status"] == "identical" and rows["count"]["severity"] == "ok"  # integer
    assert rows["gone"]["status"] == "removed" and rows["new"]["status"] == "added"
    assert rows["grows"]["status"] == "reshaped" and rows["kind"]["status"] == "retyped"
    assert list(rows)[-1] == "new"
    assert doc["summary"] == {"changed": 1, "identical": 3, "added": 1, "removed": 1, "reshaped": 1,
                              "retyped": 1, "unread": 0, "became_nan": 0, "became_zero": 0, "worst": "info"}
    assert {r["became"] for r in doc["tensors"]} == {""}
    assert doc["trained_from_first"] is False
    assert run(capsys, "scan", str(pa), str(pb), "--diff", "--fail-on", "warning")[0] == 0
    assert run(capsys, "scan", str(pa), str(pb), "--diff", "--trained-from-first", "--fail-on", "warning")[0] == 1
    rc, out, _ = run(capsys, "scan", str(pa), str(pb), "--diff", "--only-findings")
    assert "frozen" in out and "unchanged" in out and "never updated" not in out
    rc, out, _ = run(capsys, "scan", str(pa), str(pb), "--diff", "--only-findings", "--trained-from-first")
    assert "frozen" in out and "never updated" in out
    assert not any(line.split()[:2] == ["a", "float32"] for line in out.splitlines() if line)  # changed: no finding
    rc, out, _ = run(capsys, "scan", str(pa), str(pa), "--diff", "--fail-on", "info")
    assert rc == 0 and "7 identical" in out  # the same file twice: nothing changed, nothing flagged


def test_diff_across_formats(capsys: pytest.CaptureFixture[str], tmp_path: Path, tensors: dict) -> None:
    pa, pb = tmp_path / "a.pt", tmp_path / "b.safetensors"
    torch.save(tensors, pa)
    save_file(tensors, pb)
    rc, out, _ = run(capsys, "scan", str(pa), str(pb), "--diff", "--json")
    assert {r["status"] for r in json.loads(out)["tensors"]} == {"identical"}


def test_diff_usage_errors(capsys: pytest.CaptureFixture[str], ckpt: Path) -> None:
    rc, out, err = run(capsys, "scan", str(ckpt), "--diff")
    assert rc == 2 and "exactly two" in err and err.count("\n") == 1
    rc, out, err = run(capsys, "scan", str(ckpt), str(ckpt), "--diff", "--plot", "x.png")
    assert rc == 2 and "--plot" in err
    rc, out, err = run(capsys, "scan", str(ckpt), "--trained-from-first")
    assert rc == 2 and "--diff" in err and err.count("\n") == 1


# --- errors: one line, exit 2, no traceback --------------------------------------------------


class NotATensor:
    pass


def corrupt_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = tmp_path / "good.safetensors"
    save_file({"x": torch.ones(8)}, good)
    raw = good.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    cases: dict[str, tuple[bytes, str]] = {
        "truncated header": (raw[: 8 + n // 2], "corrupt safetensors file"),
        "huge header length": (struct.pack("<Q", 1 << 40) + raw[8:], "corrupt safetensors file"),
        "bad json": (struct.pack("<Q", n) + b"{" + b"x" * (n - 1) + raw[8 + n :], "not valid JSON"),
        "offsets past the end": (raw[:-8], "outside"),
        "size mismatch": (
            struct.pack("<Q", n) + raw[8 : 8 + n].replace(b'"shape":[8]', b'"shape":[7]') + raw[8 + n :],
            "needs",
        ),
        "json array": (struct.pack("<Q", 2) + b"[]" + b"\0" * 8, "not an object"),
        "random bytes": (bytes(range(256)) * 3, "not a PyTorch checkpoint"),
        "empty": (b"", "empty file"),
        "truncated zip": (b"", "not a PyTorch checkpoint"),
    }
    out: dict[str, tuple[Path, str]] = {}
    for i, (label, (data, message)) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.{'pt' if label in ('random bytes', 'empty', 'truncated zip') else 'safetensors'}"
        path.write_bytes(data)
        out[label] = (path, message)
    zipped = tmp_path / "zipped.pt"
    torch.save({"x": torch.ones(100)}, zipped)
    out["truncated zip"][0].write_bytes(zipped.read_bytes()[:300])
    pickled = tmp_path / "pickled.pt"
    torch.save({"x": torch.ones(2), "obj": NotATensor()}, pickled)
    out["needs weights_only=False"] = (pickled, "holds a test_cli.NotATensor object")
    out["missing"] = (tmp_path / "missing.pt", "no such file")
    empty = tmp_path / "empty"
    empty.mkdir()
    out["a folder without checkpoints"] = (empty, "holds no checkpoint")
    return out


def test_unreadable_files_give_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for label, (path, message) in corrupt_files(tmp_path).items():
        with pytest.raises(CheckpointError):
            open_checkpoint(path)
        for extra in ([], ["--json"], ["--fail-on", "none"]):
            rc, out, err = run(capsys, "scan", str(path), *extra)
            assert rc == 2, label
            assert out == "", label
            assert err.count("\n") == 1 and err.startswith("zeroscan: error: "), (label, err)
            assert message in err, (label, err)
            assert "Traceback" not in err


def test_no_traceback_from_the_process(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 5) + b"{oops" + b"\0" * 16)
    proc = subprocess.run([sys.executable, "-m", "zeroscan", "scan", str(bad)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.count("\n") == 1 and "corrupt safetensors file" in proc.stderr


def test_a_zip_that_is_not_a_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "a.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("hello.txt", "hi")
    rc, _, err = run(capsys, "scan", str(path))
    assert rc == 2 and "not a PyTorch checkpoint" in err and err.count("\n") == 1


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys)
    assert rc == 2 and "scan" in err
    rc, out, err = run(capsys, "--version")
    assert rc == 0 and zeroscan.__version__ in out
    rc, out, err = run(capsys, "scan")
    assert rc == 2 and "PATH" in err
    rc, out, err = run(capsys, "scan", "x.pt", "--sort", "bogus")
    assert rc == 2 and "--sort" in err
    rc, out, err = run(capsys, "--help")
    assert rc == 0 and "scan" in out and "demo" in out
    assert "bench" not in out  # benchmarks are scripts of a checkout: python benchmarks/bench_*.py
    rc, out, err = run(capsys, "bench")
    assert rc == 2 and "invalid choice: 'bench'" in err


def test_console_script_entry_point() -> None:
    from zeroscan.__main__ import main as entry

    assert entry is main


# --- plot from scan ------------------------------------------------------------------------


def test_scan_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "scan.png"
    rc, out, _ = run(capsys, "scan", str(ckpt), "--plot", str(png), "--fail-on", "error")
    assert rc == 1 and png.stat().st_size > 10_000 and f"plot written to {png}" in out


def test_scan_plot_without_matplotlib(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ckpt: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    rc, _, err = run(capsys, "scan", str(ckpt), "--plot", str(tmp_path / "x.png"))
    assert rc == 2 and "pip install matplotlib" in err and err.count("\n") == 1


# --- demo -------------------------------------------------------------------------------------


def test_demo_tours_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "demo")
    assert rc == 0 and err == ""
    for text in ("1. A healthy tensor", "HEALTHY (ok)", "EXACT_ZERO (warning)", "UNDERFLOW (warning)",
                 "NONFINITE (error)", "5. A detached layer", "(grad, detached)", "6. A parameter missing",
                 "head.bias (param, not_in_optimizer)", "7. A NaN step skipped on the device",
                 "skipped 1 of 4 steps; step 2:", "state after the bad step: unchanged", "8. What an fp8 cast",
                 "e4m3 none scale 1:"):
        assert text in out, text
    state = torch.random.get_rng_state()
    assert run(capsys, "demo")[1] == out  # seeded: the same tour every time
    assert torch.equal(torch.random.get_rng_state(), state)  # and the caller's RNG is left alone


def test_demo_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "demo.png"
    rc, out, _ = run(capsys, "demo", "--plot", str(png))
    assert rc == 0 and png.stat().st_size > 10_000 and f"drawn to {png}" in out


def test_demo_without_the_monitor(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zeroscan.monitor", None)
    rc, out, _ = run(capsys, "demo")
    assert rc == 0 and "4. NaN-poisoned" in out and "5. A detached" not in out
    assert "need zeroscan.Monitor" in out
