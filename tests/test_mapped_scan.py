"""zeroscan.stats.stats_many_mapped: tensors read in place from a mapped file.

Its rows equal stats_many's bit for bit, and a file truncated under the
mapping marks the tensors past the cut as faulted instead of killing the
process with SIGBUS. Every fault happens in a child process, so a broken
guard kills the child, not pytest; the same children show that a SIGBUS
outside a guarded scan still takes the default action (or the handler
installed before zeroscan's).
"""

from __future__ import annotations

import json
import mmap
import signal
from pathlib import Path

import pytest
import torch

import zeroscan
from helpers import assert_matches_reference, fresh_generator, make_values, run_python
from zeroscan.stats import stats_many_mapped

pytestmark = pytest.mark.slow  # truncates files under processes that then die: left out of the quick subset (-m "not slow")

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.uint8, torch.bool)


def write_and_map(path: Path, tensors: list[torch.Tensor]) -> tuple[mmap.mmap, list[torch.Tensor]]:
    """Writes the tensors' bytes one after another (each at an offset aligned
    to 8 bytes, after 24 bytes of padding so no tensor starts a page) and
    returns the file's copy-on-write mapping and the tensors viewed there."""
    offsets, blob = [], bytearray(24)
    for x in tensors:
        blob += bytes(-len(blob) % 8)
        offsets.append(len(blob))
        blob += x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(blob))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    views = [
        whole[off : off + x.numel() * x.element_size()].view(x.dtype).reshape(x.shape)
        for off, x in zip(offsets, tensors)
    ]
    return mapped, views


def test_rows_equal_stats_many(tmp_path: Path) -> None:
    g = fresh_generator()
    tensors = [make_values(int(torch.randint(1, 40_000, (), generator=g)), d, g) for d in DTYPES]
    tensors.append(make_values(1_200_000, torch.bfloat16, g))  # > 2^19: the parallel path
    tensors.append(make_values(6_000, torch.float32, g).reshape(60, 100))
    tensors.append(make_values(0, torch.float16, g))
    _, views = write_and_map(tmp_path / "tensors.bin", tensors)
    views[-2] = views[-2][:, 3:70:2]  # strided: gathered, and its span is not its numel
    for tol in (None, 1e-2):
        batch, faulted = stats_many_mapped(views, tol=tol)
        assert faulted == []
        want = zeroscan.stats_many(views, tol=tol)
        for got, expected, x in zip(batch, want, views):
            assert torch.equal(got.buffer, expected.buffer)  # bit for bit
            assert (got.dtype, got.shape) == (x.dtype, x.shape)
    for i in (0, 1, len(views) - 3, len(views) - 2):  # float32, bfloat16, the large and the strided one
        assert_matches_reference(batch[i], views[i], tol=1e-2)


def test_inputs_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"stats_many_mapped: tensors\[1\] is None"):
        stats_many_mapped([torch.ones(2), None])  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match=r"^zeroscan.stats_many_mapped: tensors\[1\] has unsupported dtype \(UInt16\)"):
        stats_many_mapped([torch.ones(2), torch.zeros(2, dtype=torch.uint16)])
    with pytest.raises(ValueError, match=r"stats_many_mapped: tensors\[0\] is on the meta device"):
        stats_many_mapped([torch.ones(2, device="meta")])
    batch, faulted = stats_many_mapped([])
    assert len(batch) == 0 and faulted == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_refused_in_one_line() -> None:
    with pytest.raises(RuntimeError) as error:
        stats_many_mapped([torch.ones(3), torch.ones(3, device="cuda")])
    want = "zeroscan.stats_many_mapped: tensors[1] is on cuda:0; it scans memory-mapped CPU tensors"
    assert str(error.value).strip() == want


def test_cuda_kernel_refuses_in_one_line() -> None:
    # The kernel that CUDA tensors reach (called here through the CUDA key,
    # as this test may run without a GPU).
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(RuntimeError) as error:
        torch.ops.zeroscan.stats_many_mapped.default.redispatch(cuda, [torch.ones(3)], None)
    message = str(error.value)
    assert "\n" not in message.strip()
    assert message.startswith("zeroscan.stats_many_mapped: xs[0] is on ")
    assert message.endswith("; it scans memory-mapped CPU tensors")


def test_opcheck() -> None:
    g = fresh_generator()
    xs = [make_values(300, d, g) for d in DTYPES]
    xs += [xs[0].reshape(10, 30).t(), xs[1][:0]]
    torch.library.opcheck(torch.ops.zeroscan.stats_many_mapped.default, (xs, None))
    torch.library.opcheck(torch.ops.zeroscan.stats_many_mapped.default, (xs[:2], 0.5))


# --- a file truncated under the mapping --------------------------------------

# argv: the file, its size in bytes, where to cut it, the [begin, end) byte
# spans of the float32 tensors to scan, and "faulthandler" or not. Scans the
# spans twice after the cut (the second fault must be caught too) and prints
# what it found as JSON.
TRUNCATED_SCAN = """
    import faulthandler, json, mmap, os, signal, sys
    import numpy as np
    import torch
    from zeroscan.stats import stats_many, stats_many_mapped

    path, size, cut, spans = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    if sys.argv[5] == "faulthandler":
        faulthandler.enable()
    np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32).tofile(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    floats = torch.frombuffer(mapped, dtype=torch.float32)
    views = [floats[b // 4 : e // 4] for b, e in spans]
    stats_many_mapped(views)  # every page read once before the cut
    os.truncate(path, cut)

    # What the mapping now holds where it can be read: the file up to the cut,
    # then zeros up to the end of the cut's page.
    readable = -(-cut // mmap.PAGESIZE) * mmap.PAGESIZE
    with open(path, "rb") as f:
        now = bytearray(f.read()) + bytearray(readable - cut)
    copies = torch.frombuffer(now, dtype=torch.float32)
    want = [stats_many([copies[b // 4 : e // 4]])[0].buffer if e <= readable else None for b, e in spans]

    out = {"expected": [i for i, (b, e) in enumerate(spans) if e > readable], "runs": []}
    for flush in (True, False):
        torch.set_flush_denormal(flush)
        batch, faulted = stats_many_mapped(views)
        tiny = torch.full((64,), 1e-39) * 2.0  # zero only with the caller's flush mode
        out["runs"].append({
            "faulted": faulted,
            "rows_equal": all(torch.equal(batch[i].buffer, w) for i, w in enumerate(want) if w is not None),
            "faulted_rows_zero": all(not batch[i].buffer.any() for i in faulted),
            "flush_kept": bool((tiny == 0).all()) == flush,
            "sigbus_unblocked": signal.SIGBUS not in signal.pthread_sigmask(signal.SIG_BLOCK, []),
        })
    print(json.dumps(out))
"""


def check_truncated_scan(path: Path, size: int, cut: int, spans: list[tuple[int, int]], *, mode: str = "") -> None:
    proc = run_python(TRUNCATED_SCAN, str(path), str(size), str(cut), json.dumps(spans), mode)
    assert proc.returncode == 0, f"child died with {proc.returncode}: {proc.stderr[-2000:]}"
    assert "Fatal Python error" not in proc.stderr
    out = json.loads(proc.stdout)
    assert out["expected"], "the spans should reach past the cut"
    for run in out["runs"]:
        assert run == {
            "faulted": out["expected"],
            "rows_equal": True,
            "faulted_rows_zero": True,
            "flush_kept": True,
            "sigbus_unblocked": True,
        }


def small_spans(cut: int) -> list[tuple[int, int]]:
    page = mmap.PAGESIZE
    readable = -(-cut // page) * page
    return [
        (0, 4096),  # wholly before the cut
        (cut - 400, cut + 200),  # across the cut, ending within its page: readable
        (cut - 1000, readable + 8),  # across the cut into the next page
        (readable + 64, readable + 64 + 4096),  # wholly past the cut's page
        (cut + 8, cut + 200),  # past the cut, within its page: zeros
        (page, 3 * page),  # read after faulted ones
        (readable - 4096, readable),  # ends exactly at the cut's page end
    ]


@pytest.mark.parametrize("mode", ["", "faulthandler"])
def test_truncated_file_marks_tensors_past_the_cut(tmp_path: Path, mode: str) -> None:
    page = mmap.PAGESIZE
    cut = 10 * page + 100 * 4 + 4  # within a page, on a float32 boundary
    check_truncated_scan(tmp_path / "cut.bin", 2 * cut, cut, small_spans(cut), mode=mode)


def test_truncated_file_on_the_parallel_path(tmp_path: Path) -> None:
    # 4M floats; the large spans run as many tasks on several threads.
    size = 16 << 20
    cut = size // 2 + 4 * 1001
    spans = small_spans(cut) + [
        (0, cut - 4 * 1001),  # 2M floats before the cut
        (4 << 20, 12 << 20),  # 2M floats across it
        (cut + (2 << 20), size),  # 1.5M floats past it
    ]
    check_truncated_scan(tmp_path / "cut.bin", size, cut, spans, mode="faulthandler")


# argv: the file, "scan" (a guarded scan catches a fault first) or not, and
# "faulthandler" or not. Then reads a float past the cut with torch itself.
UNGUARDED_READ = """
    import faulthandler, mmap, os, sys
    import numpy as np
    import torch
    from zeroscan.stats import stats_many_mapped

    path = sys.argv[1]
    if sys.argv[3] == "faulthandler":
        faulthandler.enable()
    np.zeros(1 << 20, dtype=np.float32).tofile(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    floats = torch.frombuffer(mapped, dtype=torch.float32)
    os.truncate(path, 2 << 20)
    if sys.argv[2] == "scan":
        print("faulted", stats_many_mapped([floats[:100], floats])[1], flush=True)
    # One element, read on this thread: a parallel sum faults on several
    # threads at once, and the first to reach faulthandler puts back the
    # default action, which can kill the process before it has reported.
    print("value", float(floats[3 << 18]), flush=True)
"""


@pytest.mark.parametrize("scan", ["", "scan"])
@pytest.mark.parametrize("mode", ["", "faulthandler"])
def test_sigbus_outside_a_guarded_scan_still_kills(tmp_path: Path, scan: str, mode: str) -> None:
    proc = run_python(UNGUARDED_READ, str(tmp_path / "cut.bin"), scan, mode)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "value" not in proc.stdout
    if scan:
        assert "faulted [1]" in proc.stdout
    if mode:  # faulthandler, installed before zeroscan's handler, still reports the fault
        assert "Fatal Python error: Bus error" in proc.stderr
        assert "<string>" in proc.stderr  # with the Python traceback of the read
