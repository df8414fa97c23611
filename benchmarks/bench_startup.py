"""Start-up cost: `import zeroscan` after torch, and `zeroscan scan` of a small
file against `python -c "import torch"`, measured in the same run.

    python benchmarks/bench_startup.py              # 9 rounds
    python benchmarks/bench_startup.py --rounds 15

Each round runs every command once in a fresh process, in turn, so a busy
machine slows them alike; the table gives each one's median and best wall
time. The import time is measured inside the process (time.perf_counter
around `import zeroscan`, torch already imported).

Targets: `import zeroscan` after torch <= 0.25 s; `zeroscan scan` of a 4 MB
safetensors file holding every value distribution (zeros, subnormals,
NaN/Inf) <= 1.25 x the wall time of `python -c "import torch"`; `import
zeroscan` imports no torch._dynamo.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPORT_TARGET_S = 0.25
SCAN_TARGET_RATIO = 1.25

IMPORT_ZEROSCAN = """
import sys, time
import torch
t = time.perf_counter()
import zeroscan
took = time.perf_counter() - t
print(took, "torch._dynamo" in sys.modules)
"""


def wall(cmd: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    return time.perf_counter() - start


def scan_command(path: Path) -> list[str]:
    """The `zeroscan` console script beside this Python, as a user runs it; else `python -m zeroscan`."""
    script = Path(sys.executable).parent / "zeroscan"
    if script.exists():
        return [str(script), "scan", str(path), "--fail-on", "none"]
    found = shutil.which("zeroscan")
    if found:
        return [found, "scan", str(path), "--fail-on", "none"]
    return [sys.executable, "-m", "zeroscan", "scan", str(path), "--fail-on", "none"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="fresh processes per command (default 9)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")

    import torch
    from safetensors.torch import save_file

    from zeroscan.testing import DISTRIBUTIONS, make_distribution

    folder = Path(tempfile.mkdtemp(prefix="zeroscan-startup-"))
    try:
        # 4 MB of float32, one tensor per value distribution of zeroscan.testing (zeros,
        # subnormals, NaN/Inf among them): the scan's findings and its exit path are those
        # of a file with every kind of problem, not of healthy data only.
        small = folder / "one.safetensors"
        g = torch.Generator().manual_seed(0)
        per = (1 << 20) // len(DISTRIBUTIONS)
        save_file({name: make_distribution(name, per, torch.float32, g) for name in DISTRIBUTIONS}, str(small))
        torch_cmd = [sys.executable, "-c", "import torch"]
        scan_cmd = scan_command(small)
        torch_s: list[float] = []
        scan_s: list[float] = []
        import_s: list[float] = []
        dynamo = False
        for k in range(args.rounds):
            print(f"round {k + 1}/{args.rounds}", file=sys.stderr, flush=True)
            # From an empty folder: `python -c` puts the working directory first
            # on sys.path, and a checkout there would be imported instead.
            torch_s.append(wall(torch_cmd, folder))
            scan_s.append(wall(scan_cmd, folder))
            out = subprocess.run([sys.executable, "-c", IMPORT_ZEROSCAN], check=True, capture_output=True, text=True,
                                 cwd=folder)
            took, loaded = out.stdout.split()
            import_s.append(float(took))
            dynamo = dynamo or loaded == "True"
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.rounds} rounds")
    print(f"{'command':52} {'median s':>9} {'best s':>8}")
    rows = [
        ('python -c "import torch"', torch_s),
        (f"zeroscan scan {small.name} (4 MB, 9 distributions)", scan_s),
        ("import zeroscan, after import torch (in process)", import_s),
    ]
    for name, times in rows:
        print(f"{name:52} {statistics.median(times):9.3f} {min(times):8.3f}")
    ratio = statistics.median(scan_s) / statistics.median(torch_s)
    import_median = statistics.median(import_s)
    checks = [
        (f"import zeroscan after torch: {import_median:.3f} s (median)", import_median <= IMPORT_TARGET_S,
         f"<= {IMPORT_TARGET_S} s"),
        (f"zeroscan scan / import torch: {ratio:.2f} (medians)", ratio <= SCAN_TARGET_RATIO,
         f"<= {SCAN_TARGET_RATIO}"),
        (f"import zeroscan imports torch._dynamo: {dynamo}", not dynamo, "False"),
    ]
    for text, ok, target in checks:
        print(f"{text} (target {target}) {'ok' if ok else 'MISSED'}")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
