"""How scan_checkpoint reads tensor bytes: a file truncated during the scan is
an error, never a SIGBUS; one file descriptor per checkpoint whatever its
tensor count; tensors without data (sparse, meta, quantized) are skipped with
a note; and every row is what zeroscan.stats says of the tensor alone."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import assert_matches_reference, fresh_generator, make_values, run_python, save_file_in_order
from safetensors.torch import save_file

import zeroscan
import zeroscan.cli
from zeroscan.checkpoint import (
    COMPLEX_DTYPES,
    CheckpointError,
    dtype_name,
    dtype_skip_reason,
    open_checkpoint,
    scan_checkpoint,
)
from zeroscan.checkpoint.files import FileChangedError
from zeroscan.ops import MAX_DIMS, scannable_form

FORMATS = ["safetensors", "torch"]
BIG = 1 << 18  # elements: a tensor this large is scanned in pieces when batches are small
STATS_FIELDS = (
    "numel", "zeros", "subnormal", "near_zero", "nan", "posinf", "neginf", "negative",
    "min_abs", "min_abs_nonzero", "max_abs", "mean", "std", "norm",
)  # fmt: skip


def save(fmt: str, path: Path, tensors: dict[str, torch.Tensor]) -> None:
    if fmt == "safetensors":
        save_file_in_order(tensors, path)
    else:
        torch.save(tensors, path)


def as_record(row: dict[str, object]) -> dict[str, object]:
    """A scan row with the two fields of a Stats record that it leaves out."""
    finite = int(row["numel"]) - int(row["nan"]) - int(row["posinf"]) - int(row["neginf"])  # type: ignore[call-overload]
    return {**row, "finite": finite, "sum": float(row["mean"]) * finite if finite else 0.0}  # type: ignore[arg-type]


# --- a file truncated while it is scanned ----------------------------------------

TRUNCATE_DURING = """
    import os, sys
    from zeroscan.checkpoint import CheckpointError, scan_checkpoint
    from zeroscan.checkpoint.diff import diff_checkpoints

    paths = sys.argv[1:]  # one file: scanned; two: diffed, and the second is truncated
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == 1:  # after the first batch or tensor: the rest of the file is gone
            os.truncate(paths[-1], os.path.getsize(paths[-1]) // 3)

    try:
        if len(paths) == 1:
            scan_checkpoint(paths[0], progress=progress, batch_bytes=64 << 10)
        else:
            diff_checkpoints(*paths, progress=progress)
    except CheckpointError as e:
        print("ERROR", e)
    else:
        print("NO ERROR after", len(calls), "progress calls")
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_file_truncated_during_the_scan_is_an_error_not_a_crash(tmp_path: Path, fmt: str) -> None:
    g = fresh_generator()
    path = tmp_path / f"model.{fmt}"
    save(fmt, path, {f"layers.{i}.weight": torch.randn(512, 512, generator=g) for i in range(8)})
    done = run_python(TRUNCATE_DURING, str(path))
    assert done.returncode == 0, f"the scan died (return code {done.returncode}): {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ERROR {path}: changed while it was being scanned (now "), lines


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_file_truncated_during_a_diff_is_an_error_not_a_crash(tmp_path: Path, fmt: str) -> None:
    g = fresh_generator()
    a, b = tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"
    tensors = {f"layers.{i}.weight": torch.randn(512, 512, generator=g) for i in range(8)}
    save(fmt, a, tensors)
    save(fmt, b, {k: v + 1 for k, v in tensors.items()})
    done = run_python(TRUNCATE_DURING, str(a), str(b))
    assert done.returncode == 0, f"the diff died (return code {done.returncode}): {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ERROR {b}: changed while it was being "), lines


# The command line in a fresh interpreter, with every file of the checkpoint
# (argv[3:]) cut to an eighth of its size, inside its first tensor, at a
# chosen moment: "opened", as soon as open_checkpoint has opened it
# (torch.load has mapped it, a safetensors header or DCP .metadata is read),
# or "scanning", after the first batch of 64 kB. With "unlocated", torch's
# storages are not matched to the zip's records, so the scan reads torch's
# own mapping of the file.
TRUNCATE_IN_CLI = """
    import os, sys
    import zeroscan.checkpoint as checkpoint
    import zeroscan.checkpoint.scan as scanning
    import zeroscan.checkpoint.single as single
    from zeroscan.cli import main

    path, when, *victims = sys.argv[1:]

    def truncate():
        for victim in victims:
            os.truncate(victim, os.path.getsize(victim) // 8)

    opened, scan = checkpoint.open_checkpoint, checkpoint.scan_checkpoint

    def open_then_truncate(p):
        table = opened(p)
        if when == "opened":
            truncate()
        return table

    def scan_in_small_batches(p, **kwargs):
        if when == "opened":
            return scan(p, **kwargs)
        shown = kwargs["progress"]
        def progress(done, total):
            if done and not progress.cut:
                progress.cut = True
                truncate()
            shown(done, total)
        progress.cut = False
        return scan(p, **{**kwargs, "progress": progress, "batch_bytes": 64 << 10})

    if when == "unlocated":
        single.locate_in_zip = lambda file, tensors: {}
    scanning.open_checkpoint = open_then_truncate
    checkpoint.scan_checkpoint = scan_in_small_batches
    sys.exit(main(["scan", path]))
"""


def save_layout(layout: str, folder: Path, tensors: dict[str, torch.Tensor]) -> tuple[Path, list[Path]]:
    """`tensors` saved as `layout`: the path to scan and the files that hold their bytes."""
    if layout in ("torch", "safetensors"):
        folder.mkdir()
        path = folder / f"model.{'pt' if layout == 'torch' else layout}"
        save(layout, path, tensors)
        return path, [path]
    if layout in ("sharded safetensors", "sharded torch"):
        folder.mkdir()
        fmt = layout.split()[1]
        items = list(tensors.items())
        halves = [dict(items[: len(items) // 2]), dict(items[len(items) // 2 :])]
        files = [folder / f"model-0000{k}-of-00002.{'safetensors' if fmt == 'safetensors' else 'bin'}" for k in (1, 2)]
        for half, f in zip(halves, files):
            save(fmt, f, half)
        return folder, files
    assert layout == "dcp"
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=folder, no_dist=True)
    return folder, sorted(folder.glob("*.distcp"))


@pytest.mark.slow  # a process per case, killed or not by SIGBUS
@pytest.mark.parametrize(
    "layout, when",
    [(layout, "opened") for layout in ("torch", "safetensors", "sharded safetensors", "sharded torch", "dcp")]
    + [(layout, "scanning") for layout in ("sharded safetensors", "sharded torch", "dcp")]
    + [("torch", "unlocated")],
)
def test_a_checkpoint_truncated_in_place_is_an_error_not_a_crash(tmp_path: Path, layout: str, when: str) -> None:
    """os.truncate on the files of an opened checkpoint, of every format: the
    scan ends with zeroscan's error and exit status 2, never a SIGBUS, an
    internal error or another format's wording."""
    g = fresh_generator()
    tensors = {f"layers.{i}.weight": torch.randn(128, 256, generator=g) for i in range(6)}
    path, victims = save_layout(layout, tmp_path / "ckpt", tensors)
    done = run_python(TRUNCATE_IN_CLI, str(path), when, *map(str, victims))
    assert done.returncode == 2, f"the scan ended with {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert any(done.stderr.startswith(f"zeroscan: error: {v}: changed while it was being scanned (now ")
               for v in victims), done.stderr


def test_a_short_read_names_the_tensor_and_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(1000), "b": torch.ones(1000)}, path)
    size = path.stat().st_size
    with open_checkpoint(path) as c:
        os.truncate(path, size - 100)
        with pytest.raises(FileChangedError) as err:
            c.file().read_tensor("b", c.located()["b"])
        b = c.located()["b"]
    assert str(err.value) == (
        f"{path}: changed while it was being scanned (now {size - 100:,} bytes; "
        f"tensor 'b' needs bytes {b.offset:,}..{b.end:,})"
    )


def test_a_file_rewritten_in_place_is_an_error(tmp_path: Path) -> None:
    """Same size, new bytes: the scan would mix two files' tensors."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(1000)}, path)
    with open_checkpoint(path) as c:
        file = c.file()
        os.utime(path, ns=(file.opened.st_atime_ns, file.opened.st_mtime_ns + 1_000_000_000))
        with pytest.raises(FileChangedError, match=r"changed while it was being scanned .*rewritten in place"):
            file.check_unchanged()


# --- one descriptor per checkpoint ------------------------------------------------

MANY_TENSORS_FEW_DESCRIPTORS = """
    import resource, sys
    import torch
    from zeroscan.checkpoint import open_checkpoint, scan_checkpoint

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    path = sys.argv[1]
    scan = scan_checkpoint(path)
    with open_checkpoint(path) as c:
        held = dict(c.tensors())  # every tensor alive at once: all views of one mapping
        total = sum(float(t.sum()) for t in held.values())
    print(len(scan.rows), len(scan.skipped), len(held), total)
"""


def test_a_2000_tensor_file_scans_under_a_256_descriptor_limit(tmp_path: Path) -> None:
    path = tmp_path / "many.safetensors"
    save_file({f"block.{i}.weight": torch.full((4,), float(i)) for i in range(2000)}, path)
    done = run_python(MANY_TENSORS_FEW_DESCRIPTORS, str(path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2000", "0", "2000", str(4.0 * sum(range(2000)))]


def test_close_releases_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(3)}, path)
    c = open_checkpoint(path)
    raw = c.file().raw
    assert float(c.tensor("a").sum()) == 3.0
    c.close()
    assert raw.closed


# --- tensors without data to scan ----------------------------------------------------


def sparse_coo() -> torch.Tensor:
    return torch.eye(4).to_sparse()


def sparse_csr() -> torch.Tensor:
    return torch.eye(4).to_sparse_csr()


def meta() -> torch.Tensor:
    return torch.empty(4, 4, device="meta")


def quantized() -> torch.Tensor:
    return torch.quantize_per_tensor(torch.randn(16), 0.1, 0, torch.qint8)


@pytest.mark.filterwarnings("ignore:.*(Sparse CSR tensor support is in beta|quantized tensor creation).*")
@pytest.mark.parametrize(
    "make, words",
    [(sparse_coo, "torch.sparse_coo tensor"), (sparse_csr, "torch.sparse_csr tensor"),
     (meta, "meta device"), (quantized, "dtype qint8 is not scanned")],
)  # fmt: skip
def test_tensors_without_dense_data_are_skipped_with_a_note(tmp_path: Path, make: object, words: str) -> None:
    g = fresh_generator()
    dense = torch.randn(5, 3, generator=g)
    path = tmp_path / "odd.pt"
    torch.save({"dense": dense, "odd": make(), "after": dense * 2}, path)  # type: ignore[operator]
    result = scan_checkpoint(path)
    assert [r["name"] for r in result.rows] == ["dense", "after"]
    ((skip,),) = [[s for s in result.skipped]]
    assert skip["name"] == "odd" and words in skip["reason"], skip
    assert "\n" not in skip["reason"]
    assert_matches_reference(as_record(result.rows[0]), dense)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tensor_of_more_than_max_dims_is_scanned_flat(tmp_path: Path, fmt: str) -> None:
    g = fresh_generator()
    x = torch.randn([1] * MAX_DIMS + [3, 2], generator=g)
    path = tmp_path / f"deep.{fmt}"
    save(fmt, path, {"deep": x})
    (row,) = scan_checkpoint(path).rows
    assert row["shape"] == list(x.shape)
    assert_matches_reference(as_record(row), x)


# --- every row is what zeroscan.stats says of the tensor alone ---------------------


def mixed(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Every scannable dtype, empty and 0-d tensors, a complex one, and tensors
    of more than BIG elements (scanned in pieces when batches are small)."""
    tensors: dict[str, torch.Tensor] = {}
    for dtype in zeroscan.ops.FLOAT_DTYPES + zeroscan.ops.INT_DTYPES:
        name = str(dtype).removeprefix("torch.")
        n = int(torch.randint(1, 3000, (), generator=g))
        tensors[f"{name}.weight"] = make_values(n, dtype, g).reshape(-1, 1)
        tensors[f"{name}.scalar"] = make_values(1, dtype, g).reshape(())
        tensors[f"{name}.empty"] = torch.empty(0, 3, dtype=dtype)
    tensors["complex.weight"] = torch.randn(40, 3, generator=g, dtype=torch.complex64)
    big = BIG * 2 + int(torch.randint(1, BIG, (), generator=g))
    tensors["big.float32"] = make_values(big // 7 * 7, torch.float32, g, every=5000).reshape(-1, 7)
    tensors["big.bfloat16"] = make_values(big, torch.bfloat16, g, every=5000)
    tensors["big.complex128"] = torch.randn(BIG // 2 + 3, generator=g, dtype=torch.complex128)
    return tensors


def strided(g: torch.Generator) -> dict[str, torch.Tensor]:
    """What only torch.save keeps: transposed and sliced views, two views of
    one storage (each saved with its whole storage)."""
    base = make_values(300 * 200, torch.float32, g).reshape(300, 200)
    return {"t": base.t(), "rows": base[10:20], "cols": base[:, 5:9], "again": base.t()[3]}


def check_rows(path: Path, tensors: dict[str, torch.Tensor], batch_bytes: int, exact: bool) -> None:
    result = scan_checkpoint(path, batch_bytes=batch_bytes)
    assert [r["name"] for r in result.rows] == list(tensors) and result.skipped == []
    for row in result.rows:
        x = tensors[str(row["name"])]
        assert row["shape"] == list(x.shape) and row["dtype"] == str(x.dtype).removeprefix("torch.")
        form, _ = scannable_form(x)
        assert form is not None
        want = zeroscan.stats(form).to_dict()
        if exact:  # each tensor whole in one batch: bit for bit what one call on the tensor gives
            got = {k: row[k] for k in STATS_FIELDS}
            assert json.dumps(got) == json.dumps({k: want[k] for k in STATS_FIELDS}), row["name"]
        assert_matches_reference(as_record(row), form)


@pytest.mark.parametrize("batch_bytes", [64 << 20, 4096])
@pytest.mark.parametrize("fmt", FORMATS)
def test_scan_rows_match_each_tensor_scanned_alone(tmp_path: Path, fmt: str, batch_bytes: int) -> None:
    g = fresh_generator()
    tensors = mixed(g)
    if fmt == "safetensors":
        del tensors["big.complex128"]  # the format has no complex128 (C64 only)
    path = tmp_path / f"mixed.{fmt}"
    save(fmt, path, tensors)
    check_rows(path, tensors, batch_bytes, exact=batch_bytes == 64 << 20)


@pytest.mark.parametrize("batch_bytes", [64 << 20, 4096])
def test_strided_views_in_a_torch_file_are_read_from_their_storage(tmp_path: Path, batch_bytes: int) -> None:
    g = fresh_generator()
    tensors = strided(g)
    path = tmp_path / "views.pt"
    torch.save(tensors, path)
    with open_checkpoint(path) as c:
        assert set(c.located()) == set(tensors)  # read with read calls, not through torch's mapping
    check_rows(path, tensors, batch_bytes, exact=batch_bytes == 64 << 20)


def test_a_misaligned_safetensors_tensor_is_read_aligned(tmp_path: Path) -> None:
    g = fresh_generator()
    x = make_values(1001, torch.float64, g)
    header = json.dumps({"pad": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "x": {"dtype": "F64", "shape": [1001], "data_offsets": [3, 3 + 8 * 1001]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02\x03" + x.numpy().tobytes())
    rows = {r["name"]: r for r in scan_checkpoint(path).rows}
    assert_matches_reference(as_record(rows["x"]), x)
    assert rows["pad"]["numel"] == 3 and rows["pad"]["max_abs"] == 3.0


def test_torch_files_are_read_through_read_calls(tmp_path: Path) -> None:
    """Every dense tensor of a torch.save zip file is located in the file, so
    a scan never reads torch's mapping of it."""
    g = fresh_generator()
    tensors = {**mixed(g), "sparse": sparse_coo(), "meta": meta()}
    path = tmp_path / "m.pt"
    torch.save(tensors, path)
    with open_checkpoint(path) as c:
        want = {k for k, v in tensors.items() if v.layout == torch.strided and not v.is_meta and v.numel()}
        located = c.located()
        assert set(located) == want
        for name in want:
            where = located[name]
            assert math.prod(where.shape) == tensors[name].numel() and where.dtype == tensors[name].dtype


def test_a_torch_file_of_the_other_byte_order_is_scanned_as_torch_loads_it(tmp_path: Path) -> None:
    """torch.load swaps such a file's bytes in memory: its values are not the file's bytes."""
    g = fresh_generator()
    x = make_values(999, torch.float32, g)
    native, swapped = tmp_path / "native.pt", tmp_path / "swapped.pt"
    torch.save({"x": x}, native)
    other = "big" if sys.byteorder == "little" else "little"
    with zipfile.ZipFile(native) as src, zipfile.ZipFile(swapped, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/byteorder"):
                data = other.encode()
            elif "/data/" in info.filename:
                data = x.numpy().byteswap().tobytes()
            dst.writestr(info.filename, data)
    (row,) = scan_checkpoint(swapped).rows
    assert_matches_reference(as_record(row), x)


# --- a file is read as what it holds, whatever its name --------------------------------


def save_as(fmt: str, path: Path, tensors: dict[str, torch.Tensor]) -> None:
    if fmt == "torch-legacy":
        torch.save(tensors, path, _use_new_zipfile_serialization=False)
    else:
        save(fmt, path, tensors)


@pytest.mark.parametrize(
    "fmt, name",
    [("torch", "model.safetensors"), ("torch-legacy", "model.safetensors"), ("safetensors", "model.pt"),
     ("safetensors", "pytorch_model.bin"), ("safetensors", "last.ckpt"), ("torch-legacy", "model.pth"),
     ("torch", "model.bin")],
)  # fmt: skip
def test_a_file_is_read_as_what_it_holds_whatever_its_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str, name: str
) -> None:
    """The formats are told apart by content (a torch.save file named
    model.safetensors once read as a corrupt safetensors header)."""
    g = fresh_generator()
    tensors = {"w": make_values(300, torch.float32, g).reshape(30, 10), "b": make_values(10, torch.bfloat16, g)}
    path = tmp_path / name
    save_as(fmt, path, tensors)
    result = scan_checkpoint(path)
    assert result.format == fmt and sorted(r["name"] for r in result.rows) == sorted(tensors)
    for row in result.rows:
        assert_matches_reference(as_record(row), tensors[str(row["name"])])
    capsys.readouterr()
    assert zeroscan.cli.main(["scan", str(path), "--json", "--fail-on", "none"]) == 0
    (f,) = json.loads(capsys.readouterr().out)["files"]
    assert f["format"] == fmt and sorted(r["name"] for r in f["tensors"]) == sorted(tensors)


def test_a_damaged_safetensors_file_is_still_named_by_its_name(tmp_path: Path) -> None:
    """A file that is neither format by its first bytes is read as its name says."""
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4)}, path)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=f"^{path}: corrupt safetensors file: "):
        scan_checkpoint(path)


# --- the dtypes a scan skips ----------------------------------------------------------------

SCANNED_DTYPES = {*zeroscan.ops.FLOAT_DTYPES, *zeroscan.ops.INT_DTYPES, *COMPLEX_DTYPES}
ALL_TORCH_DTYPES = {d for d in vars(torch).values() if isinstance(d, torch.dtype)}


@pytest.mark.parametrize("dtype", sorted(ALL_TORCH_DTYPES - SCANNED_DTYPES, key=str), ids=str)
def test_the_skip_reason_names_exactly_the_dtypes_a_scan_reads(dtype: torch.dtype) -> None:
    """True of every dtype skipped: uint16 is an integer dtype and float8_e4m3fnuz
    a floating one, yet neither is read, so the reason lists what is."""
    assert_names_what_is_read(dtype_name(dtype), dtype_skip_reason(dtype_name(dtype)))


def assert_names_what_is_read(name: str, reason: str | None) -> None:
    """`reason` skips dtype `name` and names, of all torch's dtypes, exactly those a scan reads."""
    assert reason is not None and reason.startswith(f"dtype {name} is not scanned (zeroscan reads "), reason
    named = set(re.findall(r"\w+", reason.removeprefix(f"dtype {name} is not scanned"))) & {
        dtype_name(d) for d in ALL_TORCH_DTYPES}
    assert named == {dtype_name(d) for d in SCANNED_DTYPES}, reason


@pytest.mark.parametrize("dtype", sorted(SCANNED_DTYPES, key=str), ids=str)
def test_no_skip_reason_for_a_dtype_a_scan_reads(dtype: torch.dtype) -> None:
    assert dtype_skip_reason(dtype_name(dtype)) is None


def test_skipped_tensors_of_unread_dtypes_give_that_reason(tmp_path: Path) -> None:
    g = fresh_generator()
    w = make_values(50, torch.float32, g)
    odd = {d: torch.zeros(3, dtype=d) for d in (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fnuz,
                                                 torch.float8_e5m2fnuz)}
    path = tmp_path / "odd.pt"
    torch.save({"w": w, **{dtype_name(d): t for d, t in odd.items()}}, path)
    result = scan_checkpoint(path)
    (row,) = result.rows
    assert_matches_reference(as_record(row), w)
    assert sorted(s["name"] for s in result.skipped) == sorted(dtype_name(d) for d in odd)
    for skipped in result.skipped:
        assert_names_what_is_read(str(skipped["name"]), str(skipped["reason"]))
