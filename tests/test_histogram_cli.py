"""`zeroscan scan --histogram` and scan_checkpoint(histogram=True): every
tensor's log2-magnitude histogram, counted in the scan's own pass, equals
the float64 reference exactly, whatever the checkpoint's format and however
the tensor was read (mapped whole, in pieces, through read calls, from a DCP
folder in row blocks); without the flag nothing of it appears."""

from __future__ import annotations

import functools
import json
import math
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fresh_generator, make_values, save_file_in_order

import zeroscan
from zeroscan import checkpoint
from zeroscan.checkpoint.batches import BatchScanner
from zeroscan.cli import main
from zeroscan.cli.cells import fmt_binades
from zeroscan.histogram import reference_histogram

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.int32,
          torch.int8, torch.bool)


def planted(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    """n random values of `dtype` (make_values: zeros, subnormals, NaN, +-inf
    planted where the dtype holds them), and surely one of each at the start."""
    x = make_values(n, dtype, g, every=20)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        x[:5] = torch.tensor([0.0, info.tiny / 4, math.nan, math.inf, -math.inf]).to(dtype)
    return x


def tensors_of(g: torch.Generator, n: int = 300) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.{str(d).removeprefix('torch.')}": planted(d, n + i, g) for i, d in enumerate(DTYPES)}


def want_of(x: torch.Tensor) -> dict[str, Any]:
    """The reference histogram's JSON form: a complex tensor's counts its real and imaginary parts."""
    return reference_histogram(torch.view_as_real(x) if x.is_complex() else x).to_dict()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop the printed seed
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def scan_rows(capsys: pytest.CaptureFixture[str], path: Path, *flags: str) -> dict[str, dict[str, Any]]:
    rc, out, err = run(capsys, "scan", "--json", "--fail-on", "none", *flags, str(path))
    assert rc == 0 and err == "", err
    (f,) = json.loads(out)["files"]
    return {r["name"]: r for r in f["tensors"]}


def assert_histograms(rows: dict[str, dict[str, Any]], tensors: dict[str, torch.Tensor]) -> None:
    assert set(rows) == set(tensors)
    for name, x in tensors.items():
        assert rows[name]["histogram"] == want_of(x), name


@pytest.fixture
def merges(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the tensors a scan merged from pieces."""
    merged: list[str] = []
    real = BatchScanner._merge_pieces

    def spy(self: BatchScanner, last: Any) -> Any:
        merged.append(str(last.shape))
        return real(self, last)

    monkeypatch.setattr(BatchScanner, "_merge_pieces", spy)
    return merged


def small_batches(monkeypatch: pytest.MonkeyPatch, batch_bytes: int) -> None:
    """The CLI's scans in batches of `batch_bytes`, so that larger tensors are read in pieces."""
    monkeypatch.setattr(checkpoint, "scan_checkpoint", functools.partial(checkpoint.scan_checkpoint,
                                                                         batch_bytes=batch_bytes))


# --- every format -------------------------------------------------------------------


def test_safetensors_file_histograms_equal_the_reference(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    tensors = tensors_of(fresh_generator())
    path = tmp_path / "model.safetensors"
    save_file_in_order(tensors, path)
    want = {name: reference_histogram(x) for name, x in tensors.items()}
    f32 = want["layers.0.float32"]
    assert f32.zeros and f32.subnormal and f32.nan and f32.posinf and f32.neginf  # the specials are there
    assert_histograms(scan_rows(capsys, path, "--histogram"), tensors)


def test_without_the_flag_no_histogram_anywhere(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    tensors = tensors_of(fresh_generator(), 50)
    path = tmp_path / "model.safetensors"
    save_file_in_order(tensors, path)
    rows = scan_rows(capsys, path)
    assert rows and all("histogram" not in r for r in rows.values())
    assert all("histogram" not in r for r in zeroscan.scan_checkpoint(path).rows)
    rc, out, _ = run(capsys, "scan", "--fail-on", "none", str(path))
    assert rc == 0 and "binades" not in out and "2^" not in out


def test_sharded_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    tensors = tensors_of(fresh_generator())
    names = list(tensors)
    for k, part in enumerate((names[:3], names[3:]), 1):
        save_file_in_order({n: tensors[n] for n in part}, tmp_path / f"model-{k:05d}-of-00002.safetensors")
    rows = scan_rows(capsys, tmp_path, "--histogram")
    assert {r["shard"] for r in rows.values()} == {"model-00001-of-00002.safetensors",
                                                   "model-00002-of-00002.safetensors"}
    assert_histograms(rows, tensors)


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_torch_file_with_views_and_complex(capsys: pytest.CaptureFixture[str], tmp_path: Path, zipped: bool) -> None:
    """A torch.save file: mapped tensors (zip) or tensors torch.load read whole
    (legacy), a transposed view and a complex tensor among them."""
    g = fresh_generator()
    tensors = tensors_of(g, 120)
    if not zipped:  # torch's legacy loader has no float8 storages
        del tensors["layers.4.float8_e4m3fn"]
    tensors["transposed"] = planted(torch.float32, 7 * 9, g).reshape(7, 9).t()
    tensors["complex"] = torch.complex(planted(torch.float32, 40, g), planted(torch.float32, 40, g))
    path = tmp_path / "model.pt"
    torch.save(tensors, path, _use_new_zipfile_serialization=zipped)
    assert_histograms(scan_rows(capsys, path, "--histogram"), tensors)


def test_dcp_folder_in_row_blocks(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                  tmp_path: Path, merges: list[str]) -> None:
    """A torch.distributed.checkpoint folder, its larger tensors read in
    blocks of rows (TensorPiece) and scanned from memory."""
    import torch.distributed.checkpoint as dcp

    g = fresh_generator()
    tensors = {"weight": planted(torch.float32, 40 * 16, g).reshape(40, 16),
               "half": planted(torch.float16, 30 * 8, g).reshape(30, 8), "ids": planted(torch.int64, 20, g)}
    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(dict(tensors), checkpoint_id=folder, no_dist=True)
    small_batches(monkeypatch, 256)
    assert_histograms(scan_rows(capsys, folder, "--histogram"), tensors)
    assert len(merges) == 2  # weight and half came in pieces


# --- tensors in pieces ----------------------------------------------------------------


def test_a_tensor_larger_than_a_batch_sums_its_pieces(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      merges: list[str]) -> None:
    """Mapped pieces of a contiguous tensor, each a batch of its own, one of
    them holding every special value, another none."""
    g = fresh_generator()
    big = planted(torch.float32, 5000, g)
    big[4000:] = torch.randn(1000, generator=g)  # a piece without specials
    tensors = {"small": planted(torch.bfloat16, 64, g), "big": big, "big_half": planted(torch.float16, 3000, g)}
    path = tmp_path / "model.safetensors"
    save_file_in_order(tensors, path)
    small_batches(monkeypatch, 4096)
    assert_histograms(scan_rows(capsys, path, "--histogram"), tensors)
    assert len(merges) == 2


def test_a_misaligned_tensor_read_in_pieces(tmp_path: Path, merges: list[str]) -> None:
    """A tensor at an odd offset is read with read calls, a piece at a time,
    and scanned from memory (the Python API this time)."""
    x = planted(torch.float32, 3000, fresh_generator())
    header = json.dumps({"pad": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "x": {"dtype": "F32", "shape": [3000], "data_offsets": [3, 12003]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02\x03" + x.numpy().tobytes())
    result = zeroscan.scan_checkpoint(path, batch_bytes=1024, histogram=True)
    rows = {r["name"]: r for r in result.rows}
    assert rows["x"]["histogram"] == want_of(x)
    assert rows["pad"]["histogram"] == want_of(torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert merges == ["torch.Size([3000])"]


# --- the Python API ---------------------------------------------------------------------


def test_scan_checkpoint_takes_histogram_by_keyword_and_as_a_bool(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file_in_order({"w": torch.ones(3)}, path)
    with pytest.raises(TypeError, match="histogram must be True or False, got str 'yes'"):
        zeroscan.scan_checkpoint(path, histogram="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        zeroscan.scan_checkpoint(path, None, 0.9, None, 1 << 20, True)  # type: ignore[misc]
    (row,) = zeroscan.scan_checkpoint(path, histogram=True).rows
    assert row["histogram"]["binades"] == {"0": 3}


# --- text --------------------------------------------------------------------------------


def test_text_table_has_a_binades_column(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    tensors = tensors_of(fresh_generator(), 80)
    path = tmp_path / "model.safetensors"
    save_file_in_order(tensors, path)
    rc, out, _ = run(capsys, "scan", "--histogram", "--limit", "0", "--fail-on", "none", str(path))
    header = next(line for line in out.splitlines() if line.startswith("name"))
    assert rc == 0 and "binades" in header.split()
    for name, x in tensors.items():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert fmt_binades(want_of(x), str(x.dtype).removeprefix("torch.")) in line, (name, line)


def hist(binades: dict[str, int], *, subnormal: int = 0, min_exponent: int = -126) -> dict[str, Any]:
    return {"min_exponent": min_exponent, "max_exponent": 127, "binades": binades, "zeros": 7,
            "subnormal": subnormal, "posinf": 1, "neginf": 0, "nan": 2}


@pytest.mark.parametrize(("histogram", "dtype", "want"), [
    (hist({"0": 500, "1": 499, "-3": 1}), "float32", "2^-3..2^2, 99% in 2^0..2^2"),
    (hist({"0": 500, "1": 494, "-3": 6}), "float32", "2^-3..2^2"),  # 0.6 % below: kept
    (hist({"-8": 2, "-2": 990, "5": 5, "9": 3}), "float32", "2^-8..2^10, 99% in 2^-2..2^6"),
    (hist({"0": 990}, subnormal=10, min_exponent=-14), "float16", "2^-24..2^1"),
    (hist({"0": 999}, subnormal=1, min_exponent=-126), "bfloat16", "2^-133..2^1, 99% in 2^0..2^1"),
    (hist({}), "float32", "-"),
    (hist({"9": 4}, min_exponent=0), "int64", "2^9..2^10"),
])  # fmt: skip
def test_fmt_binades(histogram: dict[str, Any], dtype: str, want: str) -> None:
    assert fmt_binades(histogram, dtype) == want


# --- usage --------------------------------------------------------------------------------


def test_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file_in_order({"w": torch.ones(3)}, path)
    rc, out, err = run(capsys, "scan", "--histogram", "--diff", str(path), str(path))
    assert rc == 2 and out == "" and "--histogram" in err and err.count("\n") == 1
    rc, out, err = run(capsys, "scan", "--target-format", "e4m3", str(path))
    assert rc == 2 and out == "" and "--target-format e4m3" in err and "--histogram and --plot" in err
    rc, out, err = run(capsys, "scan", "--histogram", "--target-format", "e3m4", str(path))
    assert rc == 2 and "invalid choice: 'e3m4'" in err
