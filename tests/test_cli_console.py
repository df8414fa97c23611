"""The command line as a console sees it: an encoding that cannot show every
character the reports use (PYTHONIOENCODING=ascii, latin-1, a Windows cp1252
console), and Ctrl-C pressed any number of times. Each runs `python -m
zeroscan` in a process of its own, as a user does."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import fresh_generator

import zeroscan.checkpoint
from zeroscan.cli import EXIT_FINDINGS, EXIT_INTERRUPTED, main

pytestmark = pytest.mark.slow  # each case runs the command in its own process: left out of the quick subset (-m "not slow")

# --- consoles that cannot encode every character -----------------------------------

SEPARATOR = "=== zeroscan exited with"

# `python -m zeroscan ARGV` for each ARGV of the JSON list argv[1], in one
# process (one torch import), each followed on stdout and stderr by a
# separator line with its exit status.
RUN_EACH = f"""
import json, runpy, sys
for argv in json.loads(sys.argv[1]):
    sys.argv = ["zeroscan", *argv]
    try:
        runpy.run_module("zeroscan", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    for stream in (sys.stdout, sys.stderr):
        stream.write("\\n{SEPARATOR} %s\\n" % code)
        stream.flush()
"""


def run_each(commands: list[list[str]], encoding: str) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each command, run on a console of
    `encoding`: the bytes written must be text in that encoding."""
    env = dict(os.environ, PYTHONIOENCODING=encoding, NO_COLOR="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", RUN_EACH, json.dumps(commands)], env=env,
                          capture_output=True, timeout=600)
    out, err = proc.stdout.decode(encoding), proc.stderr.decode(encoding)  # strict: a console would show mojibake
    assert proc.returncode == 0, err
    outs, errs = (re.split(f"\n{re.escape(SEPARATOR)} (\\S+)\n", text) for text in (out, err))
    assert len(outs) == len(errs) == 2 * len(commands) + 1, err
    return [(int(code), o, e) for code, o, e in zip(errs[1::2], outs[0::2], errs[0::2])]


def shows(text: str, encoding: str) -> bool:
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


@pytest.mark.parametrize("encoding", ["ascii", "latin-1", "cp1252", "utf-8"])
def test_every_command_prints_on_any_console(tmp_path: Path, encoding: str) -> None:
    """A scan with findings (a NaN, a name longer than a table cell, a
    non-ASCII file and tensor name, progress on stderr), --limit's "…" line,
    the demo (μ, σ, ∈, ‖x‖), --help and an error naming a non-ASCII path: each
    prints, as the real characters where the console has them and as ASCII
    fallbacks where it does not, and never ends in an internal error."""
    g = fresh_generator()
    poisoned = torch.randn(int(torch.randint(8, 64, (), generator=g)), generator=g)
    poisoned[int(torch.randint(0, len(poisoned), (), generator=g))] = math.nan
    long_name = "encoder." + "very_long_module_name." * 3 + "weight"
    path = tmp_path / "modèle_σ∈….pt"
    torch.save({"model": {long_name: poisoned, "μ_scale": torch.zeros(4, 4), "bias": torch.ones(3)}}, path)
    commands = [["scan", str(path), "--progress"], ["scan", str(path), "--limit", "1"], ["demo"], ["--help"],
                ["scan", "--help"], ["scan", str(tmp_path / "missing_∞.pt")]]
    results = run_each(commands, encoding)
    for argv, (code, out, err) in zip(commands, results):
        assert "internal error" not in err and "Traceback" not in err, (argv, err)
    (scan_code, scan_out, scan_err), (limit_code, limit_out, _), (demo_code, demo_out, demo_err) = results[:3]
    assert scan_code == limit_code == EXIT_FINDINGS and "(1 NaN)" in scan_out
    assert ("μ_scale" if shows("μ", encoding) else "mu_scale") in scan_out
    assert "scanning" in scan_err  # the progress line, naming the file
    ellipsis = "…" if shows("…", encoding) else "..."
    assert f"{ellipsis} 2 more tensors not shown" in limit_out
    assert demo_code == 0 and demo_err == ""
    assert ("|x|∈[" if shows("∈", encoding) else "|x| in [") in demo_out
    assert ("σ=" if shows("σ", encoding) else "sigma=") in demo_out
    for code, out, err in results[3:5]:
        assert code == 0 and "usage: zeroscan" in out
    code, out, err = results[5]
    assert code == 2 and out == "" and err.startswith("zeroscan: error: ") and err.count("\n") == 1
    assert ("missing_∞.pt" if shows("∞", encoding) else "missing_inf.pt") in err


# --- Ctrl-C ---------------------------------------------------------------------------

# `zeroscan scan PATH` whose scan waits for Ctrl-C. It tells the test each
# stage it reaches on stdout and waits there for a line on stdin (or Ctrl-C):
# "running" (the scan), "cleanup" (the scan's finally), "writing" (stderr
# taking the "interrupted" line) and "exiting" (an atexit hook), so that the
# test can press Ctrl-C at each exactly.
INTERRUPTED_SCAN = """
import atexit, signal, sys
import zeroscan.checkpoint

# Ctrl-C as Python sets it up in a terminal, also where the tests run as a
# background job (whose children start with SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)

def stage(name):
    sys.__stdout__.write(name + "\\n")
    sys.__stdout__.flush()
    sys.stdin.readline()

def scan_until_interrupted(path, **kwargs):
    try:
        stage("running")
    finally:
        stage("cleanup")

class SlowConsole:
    encoding = "utf-8"
    def write(self, text):
        if "interrupted" in text:
            stage("writing")
        return sys.__stderr__.write(text)
    def flush(self):
        sys.__stderr__.flush()
    def isatty(self):
        return False

zeroscan.checkpoint.scan_checkpoint = scan_until_interrupted
sys.stderr = SlowConsole()
atexit.register(stage, "exiting")
sys.argv = ["zeroscan", "scan", sys.argv[1]]
from zeroscan.__main__ import main

raise SystemExit(main())
"""

# Ctrl-C presses per stage; the first stops the scan, the others follow it.
PRESSES = {
    "second_in_the_cleanup": {"running": 1, "cleanup": 1},
    "second_on_the_interrupted_line": {"running": 1, "writing": 1},
    "second_at_exit": {"running": 1, "exiting": 1},
    "twice_at_once": {"running": 2},
    "five_at_every_stage": {"running": 2, "cleanup": 1, "writing": 1, "exiting": 1},
    "five_at_once": {"running": 5},
}


@pytest.mark.parametrize("presses", list(PRESSES.values()), ids=list(PRESSES))
def test_ctrl_c_any_number_of_times(tmp_path: Path, presses: dict[str, int]) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, path)
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", INTERRUPTED_SCAN, str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    watchdog = threading.Timer(300, proc.kill)  # a hang fails the test instead of stopping pytest
    watchdog.start()
    stages = []
    try:
        for line in proc.stdout:
            stages.append(line.strip())
            for _ in range(presses.get(stages[-1], 0)):
                os.kill(proc.pid, signal.SIGINT)
            if stages[-1] != "running":  # the scan itself waits for the first press, not for a line
                try:
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                except BrokenPipeError:  # it died of a press
                    break
        err = proc.stderr.read()
        code = proc.wait()
    finally:
        watchdog.cancel()
        proc.kill()
    assert stages == ["running", "cleanup", "writing", "exiting"], (stages, err)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err == "zeroscan: interrupted\n"
    assert code == EXIT_INTERRUPTED


def test_a_program_calling_main_gets_its_ctrl_c_back(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """main(argv) called by a program: one line and 130 for two presses, and
    the program's own SIGINT handling afterwards (the process's command line
    keeps ignoring SIGINT until it exits)."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is handled by the test runner here")
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, path)

    def interrupted_scan(path: str, **kwargs: object) -> None:
        try:
            signal.raise_signal(signal.SIGINT)
        finally:
            signal.raise_signal(signal.SIGINT)  # pressed again during the cleanup

    monkeypatch.setattr(zeroscan.checkpoint, "scan_checkpoint", interrupted_scan)
    capsys.readouterr()
    try:
        code = main(["scan", str(path)])
    except KeyboardInterrupt:
        pytest.fail("a KeyboardInterrupt escaped main()")
    assert code == EXIT_INTERRUPTED and capsys.readouterr().err == "zeroscan: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
