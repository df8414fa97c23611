"""The GPU job's scripts, run where CI runs (no GPU): benchmarks/gpu_check.sh,
benchmarks/bench_cuda.py, benchmarks/cuda_training.py and benchmarks/small_scan.py.

A GPU comes to few sessions, for 30 minutes; a typo found there costs a
rerun. So every code path of these scripts that does not need CUDA runs
here: the benchmark's sections at smoke sizes on the CPU, the small scan's
checks against the float64 reference, and the shell script's stage and
deadline handling."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroscan
from zeroscan.testing import DISTRIBUTIONS

pytestmark = pytest.mark.slow  # runs the GPU job's scripts: left out of the quick subset (-m "not slow")

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def run_script(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


@pytest.fixture
def small_scan(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import small_scan

    return small_scan


def test_bench_cuda_smoke_runs_every_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = run_script(sys.executable, "benchmarks/bench_cuda.py", "--device", "cpu", "--smoke", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [t["dtype"] for t in results["bandwidth"]] == ["float32", "bfloat16", "float16", "float8_e4m3fn"]
    for table in results["bandwidth"]:
        for row in table["rows"]:
            assert set(row["stats_s"]) == set(DISTRIBUTIONS)  # every distribution was timed
            assert all(t > 0 for t in row["stats_s"].values()) and row["worst"] in row["stats_s"]
            assert row["stats_s"][row["worst"]] == max(row["stats_s"].values())
    assert [t["tensors"] for t in results["many"]] == [21, 200]  # the tiny model's shapes; the small tensors
    assert results["syncs"] == {} and results["graphs"] == {}  # CUDA only
    assert results["training"]["params"] > 0 and "overhead" in results["training"]
    assert "## Summary" in done.stdout and "needs CUDA" in done.stdout
    assert "| stats, float8_e4m3fn: worst distribution, % of copy GB/s |" in done.stdout and "| >= 80 % |" in done.stdout
    assert "| x.view(torch.float32).sum() |" in done.stdout  # float8's floor: its bytes summed as float32


@pytest.mark.parametrize(
    "args, message",
    [
        (["--only", "bandwidth,nope"], "--only takes bandwidth, many, syncs, graphs, training; got nope"),
        (["--device", "cpu"], "--device cpu is only for --smoke"),
    ],
)
def test_bench_cuda_refuses_bad_arguments(args: list[str], message: str) -> None:
    done = run_script(sys.executable, "benchmarks/bench_cuda.py", *args, timeout=60)
    assert done.returncode != 0 and message in done.stderr


def test_small_scan_agrees_with_the_reference_on_cpu(small_scan, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["small_scan.py", "--device", "cpu", "--seed", str(torch.seed() % 2**31)])
    assert small_scan.main() == 0
    assert "OK" in capsys.readouterr().out


def test_small_scan_reports_a_wrong_scan(small_scan, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    # A scan that misses the last element of each tensor must be caught.
    real = zeroscan.stats
    monkeypatch.setattr(small_scan.zeroscan, "stats", lambda x, **kw: real(x.flatten()[:-1], **kw) if x.numel() > 1 else real(x, **kw))
    monkeypatch.setattr(sys, "argv", ["small_scan.py", "--device", "cpu"])
    assert small_scan.main() == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "numel: " in captured.err
    monkeypatch.setattr(small_scan.zeroscan, "stats", real)


def test_kernels_only_says_whether_this_build_has_cuda_kernels(small_scan, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    missing = small_scan.missing_cuda_kernels()
    if torch.cuda.is_available():
        assert missing == []  # a GPU machine must run a CUDA build
    monkeypatch.setattr(sys, "argv", ["small_scan.py", "--kernels-only"])
    assert small_scan.main() == (1 if missing else 0)
    out = capsys.readouterr().out
    assert ("NOT " + ", ".join(missing)) in out if missing else "every op" in out


def test_bench_cuda_sizes_choose_the_bandwidth_rows(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ("--device", "cpu", "--smoke", "--sizes", "1,2", "--only", "bandwidth", "--dtypes", "float16,float8_e5m2")
    done = run_script(sys.executable, "benchmarks/bench_cuda.py", *args, "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    tables = json.loads(out.read_text())["bandwidth"]
    assert [table["dtype"] for table in tables] == ["float16", "float8_e5m2"]
    assert [[row["bytes"] for row in table["rows"]] for table in tables] == [[1 << 20, 2 << 20]] * 2


@pytest.mark.parametrize("dtypes", ["", "float32,int8", "float33", "float8_e4m3fnuz"])
def test_bench_cuda_refuses_bad_dtypes(dtypes: str) -> None:
    done = run_script(sys.executable, "benchmarks/bench_cuda.py", "--device", "cpu", "--smoke", "--dtypes", dtypes, timeout=60)
    assert done.returncode != 0
    scanned = "float32,float64,float16,bfloat16,float8_e4m3fn,float8_e5m2"
    assert f"--dtypes takes some of {scanned}, comma-separated; got {dtypes!r}" in done.stderr


@pytest.mark.parametrize("sizes", ["0", "1,x", ""])
def test_bench_cuda_refuses_bad_sizes(sizes: str) -> None:
    done = run_script(sys.executable, "benchmarks/bench_cuda.py", "--device", "cpu", "--smoke", "--sizes", sizes, timeout=60)
    assert done.returncode != 0 and f"--sizes takes positive whole MB, comma-separated (e.g. 256,1024); got {sizes!r}" in done.stderr


@pytest.mark.parametrize("stage", ["benchmark", "tests+sanitize", "env:10+bench+nope"])
def test_gpu_check_refuses_an_unknown_stage(stage: str) -> None:
    done = run_script("bash", "benchmarks/gpu_check.sh", "env", stage, timeout=60)
    assert done.returncode == 2
    unknown = stage.split("+")[-1].split(":")[0] if stage != "tests+sanitize" else "sanitize"
    assert f"unknown stage '{unknown}'" in done.stderr
    assert "env build kernels tests memcheck racecheck backtrace nccl bench, or call1 / call2" in done.stderr


def summary_rows(out: Path) -> dict[str, str]:
    """gpu_check.sh's summary table as stage -> result."""
    rows = {}
    for line in (out / "summary.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("stage", "---"):
            rows[cells[0]] = cells[1]
    return rows


def test_gpu_check_reports_stages_past_its_deadline(tmp_path: Path) -> None:
    done = run_script("bash", "benchmarks/gpu_check.sh", "env", "bench", env={"OUT": str(tmp_path), "DEADLINE_S": "0"}, timeout=60)
    assert done.returncode == 1
    assert summary_rows(tmp_path) == {"env": "not run: 0 s of DEADLINE_S=0 left", "bench": "not run: 0 s of DEADLINE_S=0 left"}
    # Every log is packed into one file, so that what comes back stays under the file limit.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tgz", "summary.md"]


def test_gpu_check_stops_after_a_build_that_did_not_run(tmp_path: Path) -> None:
    # call1 past its deadline: the build does not run, so nothing after it is tried.
    done = run_script("bash", "benchmarks/gpu_check.sh", "call1", env={"OUT": str(tmp_path), "DEADLINE_S": "0"}, timeout=60)
    assert done.returncode == 1
    rows = list(summary_rows(tmp_path))
    assert rows[0] == "env" and sorted(rows[1:]) == ["build", "kernels"]  # build+kernels run at once


@pytest.mark.parametrize("stage", ["tests:0", "tests:x", "env+bench:-5"])
def test_gpu_check_refuses_a_limit_that_is_not_whole_seconds(stage: str) -> None:
    done = run_script("bash", "benchmarks/gpu_check.sh", stage, timeout=60)
    assert done.returncode == 2
    member = stage.split("+")[-1]
    assert f"gpu_check: '{member}': a stage's limit is whole seconds, at least 1 (as in tests:120)" in done.stderr


def test_gpu_check_takes_a_plan_alone() -> None:
    done = run_script("bash", "benchmarks/gpu_check.sh", "env", "call1", timeout=60)
    assert done.returncode == 2 and "call1 and call2 are whole plans; give one alone" in done.stderr


def test_gpu_check_runs_joined_stages_at_once_under_their_own_limits(tmp_path: Path) -> None:
    # env finishes; kernels (nvcc's compile, or its absence) cannot finish in 1 s or fails at once without nvcc.
    done = run_script("bash", "benchmarks/gpu_check.sh", "env+kernels:1", env={"OUT": str(tmp_path), "DEADLINE_S": "100"}, timeout=120)
    rows = summary_rows(tmp_path)
    assert rows["env"] == "ok"
    assert rows["kernels"] in ("TIMED OUT after 1 s", "FAILED (exit 1)")
    assert done.returncode == 1
    # At once: both had started before either ended.
    lines = done.stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"== gpu_check: (env|kernels) \(", line)]
    ends = [i for i, line in enumerate(lines) if re.match(r"== gpu_check: (env|kernels): ", line)]
    assert len(starts) == len(ends) == 2 and max(starts) < min(ends), lines


@pytest.mark.skipif(shutil.which("gdb") is None and shutil.which("cuda-gdb") is None, reason="needs gdb or cuda-gdb")
def test_gpu_check_shows_where_a_test_crashed(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text("import ctypes\n\ndef test_crash():\n    ctypes.string_at(0)\n\ndef test_fine():\n    assert True\n")
    env = {"OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "DEADLINE_S": "200"}
    crashed = run_script("bash", "benchmarks/gpu_check.sh", "backtrace", env={**env, "BACKTRACE_TESTS": f"{probe}::test_crash"})
    assert crashed.returncode == 1
    assert "received signal SIGSEGV" in crashed.stdout and "#0 " in crashed.stdout  # the C++ frames, not only Python's
    assert summary_rows(tmp_path / "out")["backtrace"] == "FAILED (exit 1)"
    fine = run_script("bash", "benchmarks/gpu_check.sh", "backtrace", env={**env, "BACKTRACE_TESTS": f"{probe}::test_fine"})
    assert fine.returncode == 0 and summary_rows(tmp_path / "out")["backtrace"] == "ok"


# Prints each collected test that is skipped here for want of a GPU (a skipif
# whose condition holds and whose reason names CUDA or a GPU), and whether -k
# selected it.
GPU_PROBE = """
import re

def needs_gpu(item):
    return any(
        m.args and m.args[0] is True and re.search(r"cuda|gpu", str(m.kwargs.get("reason", "")), re.I)
        for m in item.iter_markers("skipif")
    )

def pytest_deselected(items):
    for item in items:
        if needs_gpu(item):
            print("needs-gpu deselected", item.nodeid)

def pytest_collection_finish(session):
    for item in session.items:
        if needs_gpu(item):
            print("needs-gpu selected", item.nodeid)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="tells the GPU tests by their skip for want of a GPU")
def test_call1_runs_every_test_that_needs_a_gpu(tmp_path: Path) -> None:
    """gpu_check.sh's call1 runs `-k cuda` over $CALL1_TESTS: every test that
    needs a GPU must have "cuda" in its id and its file in that list (or be
    test_nccl.py's, the nccl stage's)."""
    (tmp_path / "gpu_probe.py").write_text(GPU_PROBE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    done = run_script(
        sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "gpu_probe", "-k", "cuda", "tests",
        env={"PYTHONPATH": path}, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = [line.split(" ", 2)[1:] for line in done.stdout.splitlines() if line.startswith("needs-gpu ")]
    assert any(how == "selected" for how, _ in found)  # the probe saw the CUDA cases
    left_out = [node for how, node in found if how == "deselected"]
    assert not left_out, f"need a GPU, without 'cuda' in their ids: {left_out}"
    call1 = re.search(r'^CALL1_TESTS="([^"]*)"', (BENCHMARKS / "gpu_check.sh").read_text(), re.M)
    assert call1 is not None
    files = {node.split("::")[0] for _, node in found} - {"tests/test_nccl.py"}
    missing = sorted(files - set(call1.group(1).split()))
    assert not missing, f"hold tests that need a GPU, not in gpu_check.sh's CALL1_TESTS: {missing}"


@pytest.fixture
def calibration(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import sass_calibration

    return sass_calibration


def test_calibration_fit_recovers_the_factors_of_exact_runs(calibration) -> None:
    """Runs whose slots are exactly 1.5 x float + 0.75 x other give back 1.5
    and 0.75; runs with float-pipe slots alone cannot tell the two apart."""
    def run(float_slots: float, other_slots: float, fitted: bool = True):
        spent = 1.5 * float_slots + 0.75 * other_slots
        return calibration.H200Run("t", "float32", "contig", calibration.H200_SLOTS_PER_S / spent, float_slots, other_slots, fitted)

    runs = (run(0.0, 80.0), run(20.0, 10.0), run(12.0, 7.0), run(5.0, 5.0, fitted=False))
    assert calibration.fit(runs) == pytest.approx((1.5, 0.75), rel=1e-12)
    with pytest.raises(ValueError, match="do not separate"):
        calibration.fit((run(10.0, 0.0), run(20.0, 0.0)))


def test_calibration_predicts_the_runs_it_is_fitted_to_within_15_percent(calibration) -> None:
    for r in calibration.H200_RUNS:
        share, _ = calibration.predict_share(r.float_slots, r.other_slots, 4 if r.dtype == "float32" else 2)
        measured = r.elements_per_s * (4 if r.dtype == "float32" else 2) / calibration.H200_COPY_BYTES_PER_S
        if r.fitted:
            assert share == pytest.approx(measured, rel=0.15), f"{r.kernels} {r.dtype} {r.kind}"
    assert calibration.worst_fitted_error() <= 0.15


def test_calibration_shares_stop_at_the_copy_and_at_the_atomics_bound(calibration) -> None:
    fast, bounded = calibration.predict_share(0.0, 1.0, 1, atomics=1.0)
    assert fast == 1.0  # memory, not issue, bounds a kernel this cheap
    atomic_bytes = calibration.ATOMIC_RATE * calibration.H200_SMS_CLOCKS_PER_S
    assert bounded == pytest.approx(atomic_bytes / calibration.H200_COPY_BYTES_PER_S)
    assert calibration.predict_share(0.0, 1.0, 1) == (1.0, 1.0)  # no atomics, no second bound
