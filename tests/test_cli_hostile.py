"""The command line on hostile input: checkpoints whose tensors are quantized,
expanded to 2^62 elements or viewed oddly; tensor and file names holding
escape sequences; stdout or stderr closed; --plot paths that cannot be
written. Every case must end in a result or one clear line, never a crash,
a hang, a forged line or a wasted scan."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import unicodedata
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fresh_generator, save_file_in_order

from zeroscan import checkpoint
from zeroscan.cli import main

pytestmark = pytest.mark.slow  # each case runs the command in its own process: left out of the quick subset (-m "not slow")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def zeroscan_process(args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m zeroscan ARGS` through bash, so redirections such as >&- apply.
    A crash (segfault) or a hang fails the test instead of killing pytest."""
    command = f"exec {sys.executable} -W ignore -m zeroscan {args}"  # exec: a timeout kills zeroscan itself
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout)


# --- diff: quantized, expanded and strided tensors ---------------------------------------------


def quantized(values: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated, but checkpoints still hold them
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(values, scale, zero_point, torch.qint8)


def per_channel(values: torch.Tensor, scales: list[float], axis: int = 0) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(values, torch.tensor(scales, dtype=torch.float64),
                                          torch.arange(len(scales)), axis, torch.quint8)


def changed_bits(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ, counted on materialised copies (small tensors only)."""
    if a.is_quantized:
        a, b = a.int_repr(), b.int_repr()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(ints) != b.contiguous().view(ints)).sum())


def dequantized(q: torch.Tensor) -> torch.Tensor:
    """q's values in float64 (torch's dequantize() rounds them to float32, the diff does not)."""
    ints = q.int_repr().double()
    if q.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return (ints - q.q_zero_point()) * q.q_scale()
    shape = [1] * q.dim()
    shape[q.q_per_channel_axis()] = -1
    scales = q.q_per_channel_scales().double().view(shape)
    zero_points = q.q_per_channel_zero_points().double().view(shape)
    return (ints - zero_points) * scales


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.is_quantized:
        a, b = dequantized(a), dequantized(b)
    return float((a.double() - b.double()).abs().max())


# name -> (tensor in a, tensor in b, the fields the diff row must hold)
DiffCase = tuple[torch.Tensor, torch.Tensor, dict[str, Any]]


def diff_cases() -> dict[str, DiffCase]:
    g = fresh_generator()
    cases: dict[str, DiffCase] = {}

    def exact(name: str, a: torch.Tensor, b: torch.Tensor, **extra: Any) -> None:
        n = changed_bits(a, b)
        want: dict[str, Any] = {"status": "changed" if n or extra else "identical", "changed": n}
        if n:
            want["max_abs_diff"] = max_diff(a, b)
        cases[name] = (a, b, {**want, **extra})

    # 2^62 elements from one stored value, on both sides: compared once, counted 2^62 times.
    huge = (2**31, 2**31)
    one = torch.tensor([1.0])
    cases["expanded.same"] = (one.expand(huge), one.clone().expand(huge), {"status": "identical", "changed": 0})
    cases["expanded.changed"] = (one.expand(huge), torch.tensor([3.5]).expand(huge),
                                 {"status": "changed", "changed": 2**62, "max_abs_diff": 2.5})
    three = torch.arange(3.0).view(3, 1, 1)
    other = three.clone()
    other[1] = 7.0
    cases["expanded.one_of_three"] = (three.expand(3, 2**30, 2**30), other.expand(3, 2**30, 2**30),
                                      {"status": "changed", "changed": 2**60, "max_abs_diff": 6.0})
    # Expanded against dense: the dense file holds every element, so the work is what it stores.
    base = torch.randn(1, 2, generator=g)
    dense = base.expand(2**20, 2).clone()
    dense[5, 1] += 9.0
    dense[77, 0] -= 1.0
    exact("expanded.vs_dense", base.expand(2**20, 2), dense)
    exact("dense.vs_expanded", dense, base.expand(2**20, 2))
    # Views: only what the tensor views is compared (torch.save keeps the whole storage).
    m = torch.randn(64, 48, generator=g)
    mt = m.t().contiguous()
    mt[3, 7] = 0.0
    exact("transposed", m.t(), mt)
    big = torch.randn(40, 90, generator=g)
    exact("sliced.vs_copy", big[:, 1::3], big[:, 1::3].clone())
    elsewhere = big.clone()
    elsewhere[:, 0::3] = 0.0  # the storage differs only where the view does not look
    exact("sliced.storage_differs_outside", big[:, 1::3], elsewhere[:, 1::3])
    changed = big.clone()
    changed[2, 4] = 1e3
    exact("sliced.changed", big[:, 1::3], changed[:, 1::3])
    ramp = torch.arange(10.0)
    bumped = ramp.clone()
    bumped[4] = -1.0
    exact("overlapping", ramp.as_strided((8, 3), (1, 1)), bumped.as_strided((8, 3), (1, 1)))
    # Repeated along different dimensions: small is compared, huge is refused with a reason.
    exact("crossed.small", torch.arange(4.0).view(1, 4).expand(3, 4), torch.arange(3.0).view(3, 1).expand(3, 4))
    wide = torch.ones(1, 2**20)
    cases["crossed.huge"] = (wide.expand(2**20, 2**20), wide.view(2**20, 1).expand(2**20, 2**20),
                             {"status": "unread", "reason": "different dimensions"})

    # Quantized: the stored integers bit for bit, plus scale, zero point, axis, qscheme.
    values = torch.randn(5, 6, generator=g)
    q = quantized(values, 0.1, 3)
    exact("q.same", q, quantized(values, 0.1, 3))
    nudged = values.clone()
    nudged[2, 2] += 0.5
    exact("q.one_value", q, quantized(nudged, 0.1, 3))
    rescaled = quantized(values, 0.2, 3)
    cases["q.scale"] = (q, rescaled, {"status": "changed", "changed": 30, "max_abs_diff": max_diff(q, rescaled),
                                      "reason": "scale 0.1 -> 0.2"})
    shifted = quantized(values, 0.1, 4)
    cases["q.zero_point"] = (q, shifted, {"status": "changed", "changed": 30, "reason": "zero point 3 -> 4"})
    scales = [0.05, 0.1, 0.2, 0.3, 0.4]
    pc = per_channel(values.abs(), scales)
    exact("qc.same", pc, per_channel(values.abs(), scales))
    pc_nudged = values.abs()
    pc_nudged[4, 0] += 1.0
    exact("qc.one_value", pc, per_channel(pc_nudged, scales))
    moved = per_channel(values.abs(), [0.05, 0.1, 0.25, 0.3, 0.4])
    cases["qc.one_channel"] = (pc, moved, {"status": "changed", "changed": 6, "max_abs_diff": max_diff(pc, moved),
                                           "reason": "changed on 1 of 5 channels"})
    cases["qc.axis"] = (per_channel(values.abs()[:, :5], scales), per_channel(values.abs()[:, :5], scales, axis=1),
                        {"status": "changed", "changed": 25, "reason": "axis 0 -> 1"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_tensor = torch.quantize_per_tensor(values.abs(), 0.1, 3, torch.quint8)
    cases["q.scheme"] = (per_tensor, pc, {"status": "changed", "changed": 30,
                                         "reason": "qscheme per_tensor_affine -> per_channel_affine"})
    return cases


@pytest.fixture(scope="module")
def diffed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, DiffCase], dict[str, dict[str, Any]]]:
    """Every case in one pair of files, diffed by one process (a segfault or a
    walk over 2^62 elements fails the tests rather than pytest)."""
    cases = diff_cases()
    folder = tmp_path_factory.mktemp("diff")
    a, b = folder / "a.pt", folder / "b.pt"
    torch.save({name: x for name, (x, _, _) in cases.items()}, a)
    torch.save({name: y for name, (_, y, _) in cases.items()}, b)
    assert a.stat().st_size < 64 << 20  # the 2^62-element tensors are a few bytes on disk
    proc = zeroscan_process(f"scan {a} {b} --diff --json --fail-on none")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["tensors"]}
    return cases, rows


@pytest.mark.parametrize("name", list(diff_cases()))
def test_diff_of_hostile_layouts(diffed: tuple[dict[str, DiffCase], dict[str, dict[str, Any]]], name: str) -> None:
    cases, rows = diffed
    x, _, want = cases[name]
    row = rows[name]
    for key, value in want.items():
        if key == "reason":
            assert value in row["reason"], row
        elif key == "max_abs_diff":
            assert row[key] == pytest.approx(value, rel=1e-6), row
        else:
            assert row[key] == value, row
    if "changed" in want:
        assert row["changed_fraction"] == pytest.approx(want["changed"] / x.numel())


def test_quantized_checkpoints_load_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "q.pt"
    torch.save({"w": quantized(torch.randn(3, 4), 0.1, 2), "c": per_channel(torch.rand(3, 4), [0.1, 0.2, 0.3])}, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = torch.load(path, weights_only=True)
    assert loaded["w"].is_quantized and loaded["c"].qscheme() == torch.per_channel_affine


def test_blocks_never_materialise_an_expanded_view() -> None:
    from zeroscan.checkpoint.diff import block_pairs

    x = torch.tensor([[1.0, 2.0]]).expand(2**27, 2)  # 1 GiB if materialised
    y = torch.tensor([[5.0], [6.0]]).expand(2, 2**27).t()  # the same shape, repeated the same way
    chunk = 1 << 12
    sizes = [(xs.numel(), repeat) for xs, ys, repeat in block_pairs(x, y, chunk)]
    assert sizes == [(2, 2**27)]
    z = torch.randn(2**16, 2).expand(2, 2**16, 2)
    w = torch.randn(2**16, 2)
    assert all(xs.numel() <= chunk for xs, _, _ in block_pairs(z, w.expand(2, 2**16, 2), chunk))


def test_unreadable_dtypes_give_an_unread_row(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = torch.quantize_per_tensor(torch.rand(4, 4), 0.1, 0, torch.quint4x2)
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    sparse = torch.eye(3).to_sparse()
    try:
        torch.save({"packed": packed, "sparse": sparse}, a)
        torch.save({"packed": packed, "sparse": sparse}, b)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.load(a, weights_only=True)
    except Exception as e:  # this torch cannot round-trip them: nothing to diff
        pytest.skip(f"torch cannot save and load these: {e}")
    proc = zeroscan_process(f"scan {a} {b} --diff --json", timeout=120)  # in a process: it once segfaulted
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["tensors"]}
    assert rows["packed"]["status"] == "unread" and "packs" in rows["packed"]["reason"]
    assert rows["sparse"]["status"] == "unread" and "sparse" in rows["sparse"]["reason"]


# --- torch's warnings while a checkpoint loads ---------------------------------------------------------


def scan_with_warnings_shown(path: Path) -> subprocess.CompletedProcess[str]:
    """`python -m zeroscan scan --json PATH` in a fresh interpreter with Python's default warning
    filters (torch warns of a sparse CSR tensor once per process: a test in this one would see
    nothing after the first)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return subprocess.run([sys.executable, "-m", "zeroscan", "scan", "--json", str(path)],
                          capture_output=True, text=True, timeout=120, env=env)


SPARSE_LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sparse_csr": lambda x: x.to_sparse_csr(),
    "sparse_csc": lambda x: x.to_sparse_csc(),
    "sparse_bsr": lambda x: x.to_sparse_bsr((2, 2)),
    "sparse_bsc": lambda x: x.to_sparse_bsc((2, 2)),
}


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("layout", list(SPARSE_LAYOUTS))
def test_torch_warnings_while_loading_never_reach_stderr(tmp_path: Path, layout: str, zipped: bool) -> None:
    """A sparse compressed tensor is skipped with zeroscan's reason; torch's
    "support is in beta state" warning and its source line are not printed."""
    g = fresh_generator()
    w = torch.randn(4, 4, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        odd = SPARSE_LAYOUTS[layout](torch.eye(4))
    path = tmp_path / "model.pt"
    torch.save({"w": w, "odd": odd}, path, _use_new_zipfile_serialization=zipped)
    proc = scan_with_warnings_shown(path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    (f,) = json.loads(proc.stdout)["files"]
    assert [r["name"] for r in f["tensors"]] == ["w"] and f["tensors"][0]["max_abs"] == float(w.abs().max())
    (skipped,) = f["skipped"]
    assert skipped["name"] == "odd" and f"torch.{layout} tensor" in skipped["reason"]


# --- stdout or stderr closed -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("small") / "model.pt"
    torch.save({"w": torch.randn(4, 4), "b": torch.zeros(4)}, path)
    return path


@pytest.mark.parametrize("args", ["scan {f}", "scan --json {f}", "scan {f} {f} --diff", "demo"])
@pytest.mark.parametrize("stderr_open", [True, False])
def test_stdout_closed(small_ckpt: Path, args: str, stderr_open: bool) -> None:
    proc = zeroscan_process(args.format(f=small_ckpt) + " >&-" + ("" if stderr_open else " 2>&-"), timeout=120)
    assert proc.returncode == 2
    if stderr_open:
        assert proc.stderr == "zeroscan: error: stdout is closed: nothing to write the report to\n"
    else:
        assert proc.stderr == ""


@pytest.mark.parametrize(("args", "status"), [("scan {f} --progress", 0), ("scan {f} --json", 0),
                                              ("scan {f}.missing", 2), ("scan {f} --sort bogus", 2)])
def test_stderr_closed(small_ckpt: Path, args: str, status: int) -> None:
    proc = zeroscan_process(args.format(f=small_ckpt) + " 2>&-", timeout=120)
    assert proc.returncode == status
    assert (str(small_ckpt) in proc.stdout) == (status == 0)


# --- text from files is shown, never obeyed -------------------------------------------------------

HOSTILE_NAMES = ["\x1b[2J", "a\nERROR fake.weight: nonfinite: forged", "x\u202eevil", "zero\u200bwidth",
                 "c1\x9b31m", "del\x7f", "line\u2028sep", "bell\x07", "wide.漢字"]


def unsafe(text: str) -> list[str]:
    """Characters a terminal would obey rather than show (a newline ends a line and is allowed)."""
    return [ch for ch in text if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


def columns_line_up(out: str, first: str, second: str) -> None:
    """In every table row the second column starts where its header does."""
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith(first) and second in line)
    start = header.index(second)
    table = lines[lines.index(header) + 1 :]
    rows = table[: next((i for i, line in enumerate(table) if not line.strip()), len(table))]
    assert len(rows) >= len(HOSTILE_NAMES)
    for row in rows:
        prefix = row[:start]
        width = sum(2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in prefix)
        cut = start - (width - len(prefix))
        assert row[cut - 2 : cut] == "  " and row[cut] != " ", (row, start)


@pytest.fixture
def hostile_files(tmp_path: Path) -> tuple[Path, Path]:
    # every tensor with a finding (NaN or all zero), so that each name reaches the findings too
    tensors = {name: torch.tensor([1.0, math.nan, 2.0]) if i % 2 else torch.zeros(2, 2)
               for i, name in enumerate(HOSTILE_NAMES)}
    st, pt = tmp_path / "names.safetensors", tmp_path / "names\x1b]0;title\x07.pt"
    save_file_in_order(tensors, st)
    torch.save(tensors, pt)
    return st, pt


@pytest.mark.parametrize("extra", [[], ["--only-findings"], ["--progress"], ["--diff"], ["--diff", "--progress"]])
def test_names_from_files_are_escaped(capsys: pytest.CaptureFixture[str], hostile_files: tuple[Path, Path],
                                      extra: list[str]) -> None:
    st, pt = hostile_files
    rc, out, err = run(capsys, "scan", str(pt), str(st), *extra, "--fail-on", "none")
    assert rc == 0
    assert unsafe(out) == [] and unsafe(err) == []
    assert "\\x1b[2J" in out and "a\\nERROR fake.weight" in out and "x\\u202eevil" in out
    assert not any(line.startswith("ERROR fake") or line.lstrip().startswith("ERROR fake") for line in out.splitlines())
    if "--progress" in extra:
        assert "names\\x1b]0;title\\x07.pt" in err
    columns_line_up(out, "name", "dtype")


def test_json_keeps_names_exact_and_escaped(capsys: pytest.CaptureFixture[str], hostile_files: tuple[Path, Path]) -> None:
    st, pt = hostile_files
    for argv in (["scan", "--json", str(st), str(pt)], ["scan", "--json", "--diff", str(st), str(pt)]):
        rc, out, err = run(capsys, *argv)
        assert unsafe(out) == [] and out.isascii()
        doc = json.loads(out)
        tensors = doc["tensors"] if "tensors" in doc else doc["files"][0]["tensors"]
        assert [t["name"] for t in tensors] == HOSTILE_NAMES


def test_a_file_dtype_and_path_are_escaped(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "odd\x1b[31m.safetensors"
    header = json.dumps({"w\x1b[2J": {"dtype": "X\x1b[31m", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    rc, out, err = run(capsys, "scan", str(path))
    assert unsafe(out) == [] and unsafe(err) == [] and err.count("\n") <= 1
    rc, out, err = run(capsys, "scan", str(tmp_path / "gone\x1b[2J\n.pt"))
    assert rc == 2 and unsafe(err) == [] and err.count("\n") == 1 and "gone\\x1b[2J\\n.pt" in err
    rc, out, err = run(capsys, "scan", str(tmp_path / os.fsdecode(b"bad\xff.pt")))  # not UTF-8
    assert rc == 2 and unsafe(err) == [] and "bad\\xff.pt: no such file" in err


# --- --plot: the file written is the file named; a bad path fails before the scan --------------


@pytest.fixture
def no_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the scan ran before --plot was checked")

    monkeypatch.setattr(checkpoint, "scan_checkpoint", refuse)


BAD_PLOT_PATHS: dict[str, tuple[Callable[[Path], str], str]] = {
    "unknown extension": (lambda d: str(d / "out.xyz"), "matplotlib cannot write .xyz files; it writes"),
    "missing folder": (lambda d: str(d / "nowhere" / "x.png"), "no such directory"),
    "folder is a file": (lambda d: str(d / "file.txt" / "x.png"), "not a directory"),
    "a directory": (lambda d: str(d / "dir.png"), "is a directory"),
}


@pytest.mark.parametrize("case", list(BAD_PLOT_PATHS))
@pytest.mark.parametrize("command", ["scan", "demo"])
def test_bad_plot_path_is_a_usage_error_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, small_ckpt: Path, no_scan: None, case: str, command: str
) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "dir.png").mkdir()
    make, message = BAD_PLOT_PATHS[case]
    plot = make(tmp_path)
    argv = ["scan", str(small_ckpt)] if command == "scan" else ["demo"]
    rc, out, err = run(capsys, *argv, "--plot", plot)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("zeroscan: error: --plot ") and message in err, err
    if case == "unknown extension":
        assert ".png" in err and ".svg" in err and ".pdf" in err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into any folder")
def test_plot_into_a_read_only_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path, small_ckpt: Path,
                                      no_scan: None) -> None:
    pytest.importorskip("matplotlib")
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    rc, out, err = run(capsys, "scan", str(small_ckpt), "--plot", str(folder / "x.png"))
    assert rc == 2 and "not writable" in err and err.count("\n") == 1


@pytest.mark.parametrize(("given", "written"), [("report", "report.png"), ("report.", "report.png"),
                                                ("r.SVG", "r.SVG"), ("r.pdf", "r.pdf")])
@pytest.mark.parametrize("command", ["scan", "demo"])
def test_plot_names_the_file_written(capsys: pytest.CaptureFixture[str], tmp_path: Path, small_ckpt: Path,
                                     given: str, written: str, command: str) -> None:
    pytest.importorskip("matplotlib")
    argv = ["scan", str(small_ckpt)] if command == "scan" else ["demo"]
    rc, out, err = run(capsys, *argv, "--plot", str(tmp_path / given))
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [written]
    assert str(tmp_path / written) in "".join(out.split())  # the demo wraps its lines


def test_plot_without_matplotlib_fails_before_the_scan(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, small_ckpt: Path,
    no_scan: None
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    for plot in ("report", "x.png"):
        rc, out, err = run(capsys, "scan", str(small_ckpt), "--plot", str(tmp_path / plot))
        assert rc == 2 and out == "" and "pip install matplotlib" in err and err.count("\n") == 1

