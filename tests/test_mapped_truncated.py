"""A tensor that maps a file, scanned after the file was truncated under it:
the process lives on, and the call raises one line naming itself and the
tensor (zeroscan.mapped_reads), where reading the mapping would have killed
it with SIGBUS.

The issue named a tensor of zeroscan.checkpoint.open_checkpoint(p).tensor(name)
and one of torch.load(p, mmap=True), scanned by zeroscan.stats, stats_many
and diagnose. The unnamed members of the family tested here are a
numpy.memmap seen through torch.from_numpy and torch.from_file's shared
mapping, scanned by stats(histogram=True), diagnose_many, scan_buffers and
headroom_of.

Each runs in a process of its own (helpers.run_python): a regression ends
that process with SIGBUS, not pytest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zeroscan
from helpers import ended, fresh_generator, make_values, run_python

SOURCES = ("open_checkpoint safetensors", "open_checkpoint torch.save", "torch.load mmap", "numpy.memmap", "torch.from_file")

# call label: (expression of t, the name its error gives t)
CALLS = {
    "stats": ("zeroscan.stats(t)", "zeroscan.stats: x "),
    "stats_many": ("zeroscan.stats_many([torch.ones(3), t])", "zeroscan.stats_many: tensors[1] "),
    "diagnose": ("zeroscan.diagnose(t)", "zeroscan.diagnose: x "),
    "stats(histogram=True)": ("zeroscan.stats(t, histogram=True)", "zeroscan.stats: x "),
    "diagnose_many": ("zeroscan.diagnose_many([t])", "zeroscan.diagnose_many: tensors[0] "),
    "scan_buffers": ("zeroscan.scan_buffers([torch.ones(3), t])", "zeroscan.scan_buffers: tensors[1] "),
    "headroom_of": ("zeroscan.headroom_of(t, 'e4m3')", "zeroscan.headroom_of: x "),
}

# argv: a folder for the files, the source, then the calls. Prints, as each
# call ends, "call <label> <json>": the error it raised (null if none); and
# first "same <json>": whether each call's result on the mapped tensor equals
# the in-memory tensor's before the truncation.
TRUNCATE = """
    import json, os, sys, warnings
    from pathlib import Path
    import numpy, torch, zeroscan
    from safetensors.torch import save_file

    warnings.simplefilter("ignore")  # a read-only numpy memmap's warning
    folder, source, calls = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    x = torch.linspace(-3, 3, 1 << 20)
    x[::7] = 0
    keep = []  # what holds each mapping open
    if source == "open_checkpoint safetensors":
        path = folder / "m.safetensors"
        save_file({"w": x}, str(path))
        keep.append(zeroscan.open_checkpoint(path))
        t = keep[0].tensor("w")
    elif source == "open_checkpoint torch.save":
        path = folder / "m.pt"
        torch.save({"w": x}, path)
        keep.append(zeroscan.open_checkpoint(path))
        t = keep[0].tensor("w")
    elif source == "torch.load mmap":
        path = folder / "m.pt"
        torch.save({"w": x}, path)
        t = torch.load(path, mmap=True, weights_only=True)["w"]
    elif source == "numpy.memmap":
        path = folder / "m.npy"
        numpy.save(path, x.numpy())
        t = torch.from_numpy(numpy.load(path, mmap_mode="r"))
    else:
        path = folder / "m.bin"
        path.write_bytes(x.numpy().tobytes())
        t = torch.from_file(str(path), shared=True, size=x.numel(), dtype=torch.float32)

    def result(expr, tensor):
        got = eval(expr, {"zeroscan": zeroscan, "torch": torch, "t": tensor})
        got = list(got) if isinstance(got, (list, zeroscan.StatsBatch)) else [got]
        return repr([g.to_dict() if hasattr(g, "to_dict") else g.tolist() for g in got])

    same = {label: result(expr, t) == result(expr, x) for label, expr in calls.items()}
    print("same " + json.dumps(same), flush=True)
    os.truncate(path, 64)  # what a job saving the file again does first
    for label, expr in calls.items():
        try:
            result(expr, t)
            error = None
        except Exception as e:
            error = {"type": type(e).__name__, "message": str(e)}
        print(f"call {label} " + json.dumps(error), flush=True)
"""


@pytest.mark.slow  # a process per source
@pytest.mark.parametrize("source", SOURCES)
def test_a_truncated_mapping_is_an_error_naming_the_call(source: str, tmp_path: Path) -> None:
    calls = {label: expr for label, (expr, _) in CALLS.items()}
    proc = run_python(TRUNCATE, str(tmp_path), source, json.dumps(calls), timeout=240)
    lines = proc.stdout.splitlines()
    done = {line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2]) for line in lines if line.startswith("call ")}
    assert proc.returncode == 0, f"{len(done)} of {len(CALLS)} calls ended, then: {ended(proc)}"
    same = json.loads(next(line for line in lines if line.startswith("same "))[5:])
    assert same == {label: True for label in CALLS}, "the mapped tensor scanned unlike the same values in memory"
    assert set(done) == set(CALLS)
    for label, (_, prefix) in CALLS.items():
        error = done[label]
        assert error is not None, f"{label}: the truncated mapping was read without an error"
        assert error["type"] == "RuntimeError", (label, error)
        message = error["message"]
        assert message.startswith(prefix) and "\n" not in message, (label, message)
        assert "maps a file that no longer holds it" in message, (label, message)


def test_foreign_memory_scans_as_torch_memory_does_under_transforms() -> None:
    """Read under the guard, memory torch did not allocate (here a numpy
    array's) gives the same results as a copy in torch's memory, in eager
    mode and under torch.func.grad, jvp and a vmap over something else."""
    values = make_values(777, torch.float32, fresh_generator())
    foreign = torch.from_numpy(values.numpy().copy())
    assert not foreign.untyped_storage().resizable()  # what marks it as perhaps a file's mapping

    def scans(x: torch.Tensor) -> str:
        return repr([zeroscan.stats(x).to_dict(), zeroscan.stats(x, histogram=True).to_dict(),
                     zeroscan.stats_many([x, values]).to_dicts(), zeroscan.diagnose(x).to_dict()])

    want = scans(values)
    seen: list[str] = []

    def f(y: torch.Tensor) -> torch.Tensor:
        seen.append(scans(foreign))
        return y.sum()

    f(torch.ones(2))
    torch.func.grad(f)(torch.ones(2))
    torch.func.jvp(f, (torch.ones(2),), (torch.ones(2),))
    torch.func.vmap(f)(torch.ones(3, 2))
    assert seen == [want] * 4
