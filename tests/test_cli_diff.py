"""`zeroscan diff A B`: the same report and exit status as `zeroscan scan A B
--diff`, on real checkpoints, and one-line usage errors for PATHs that are
not two checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import fresh_generator, run_cli, run_cli_json

from zeroscan.cli import EXIT_ERROR, EXIT_FINDINGS, EXIT_OK

CHANGED, POISONED = "encoder.0.weight", "decoder.1.weight"




@pytest.fixture
def pair(tmp_path: Path) -> tuple[str, str]:
    """a.pt of random tensors, and b.pt its copy with CHANGED changed at a few
    elements and POISONED all NaN."""
    g = fresh_generator()
    before = {
        CHANGED: torch.randn(6, 4, generator=g),
        "encoder.0.bias": torch.randn(6, generator=g),
        POISONED: torch.randn(3, 6, generator=g),
        "decoder.1.bias": torch.randn(3, generator=g),
    }
    after = {name: t.clone() for name, t in before.items()}
    after[CHANGED].view(-1)[torch.randperm(24, generator=g)[:3]] += 0.25
    after[POISONED] = torch.full_like(before[POISONED], math.nan)
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(before, a)
    torch.save(after, b)
    return str(a), str(b)


@pytest.mark.parametrize("options", [[], ["--group-by", "layer"], ["--sort", "name", "--only-findings"],
                                     ["--trained-from-first", "--fail-on", "none"]])
def test_diff_writes_what_scan_diff_writes(capsys: pytest.CaptureFixture[str], pair: tuple[str, str],
                                           options: list[str]) -> None:
    a, b = pair
    rc, doc = run_cli_json(capsys, "diff", a, b, *options)
    assert (rc, doc) == run_cli_json(capsys, "scan", a, b, "--diff", *options)
    assert doc["command"] == "diff" and (doc["a"], doc["b"]) == (a, b)
    assert ("groups" in doc) == ("--group-by" in options)
    rc_text, text, _ = run_cli(capsys, "diff", a, b, *options)
    assert (rc_text, text) == run_cli(capsys, "scan", a, b, "--diff", *options)[:2] and rc_text == rc


def test_diff_names_the_changed_tensor_and_the_one_that_became_nan(capsys: pytest.CaptureFixture[str],
                                                                  pair: tuple[str, str]) -> None:
    rc, doc = run_cli_json(capsys, "diff", *pair)
    rows = {r["name"]: r for r in doc["tensors"]}
    assert rows[CHANGED]["status"] == "changed" and rows[CHANGED]["changed"] == 3
    assert rows[CHANGED]["became"] == "" and rows[CHANGED]["severity"] == "ok"
    assert rows[POISONED]["became"] == "nan" and rows[POISONED]["severity"] == "error"
    assert rows[POISONED]["changed"] == 18  # every element, now NaN
    assert {rows[n]["status"] for n in ("encoder.0.bias", "decoder.1.bias")} == {"identical"}
    assert doc["summary"]["changed"] == 2 and doc["summary"]["became_nan"] == 1
    assert doc["summary"]["worst"] == "error"


def test_diff_exit_status_follows_fail_on(capsys: pytest.CaptureFixture[str], pair: tuple[str, str]) -> None:
    assert run_cli(capsys, "diff", *pair)[0] == EXIT_FINDINGS  # the default --fail-on error: NaN fails
    assert run_cli(capsys, "diff", *pair, "--fail-on", "none")[0] == EXIT_OK
    assert run_cli(capsys, "diff", pair[0], pair[0])[0] == EXIT_OK  # nothing changed, nothing flagged


@pytest.mark.parametrize("count", [0, 1, 3])
def test_diff_refuses_other_than_two_paths_in_one_line(capsys: pytest.CaptureFixture[str], pair: tuple[str, str],
                                                      count: int) -> None:
    paths = [pair[0], pair[1], pair[0]][:count]
    rc, out, err = run_cli(capsys, "diff", *paths)
    assert rc == EXIT_ERROR and out == "" and err.count("\n") == 1
    assert err.startswith("zeroscan: error: diff compares two checkpoints, A and B; got ")
    assert ("got no path" in err) if count == 0 else (f"got {count} path" in err and pair[0] in err)


def test_diff_refuses_a_path_that_names_two_checkpoints(capsys: pytest.CaptureFixture[str],
                                                        pair: tuple[str, str]) -> None:
    folder = str(Path(pair[0]).parent)
    rc, out, err = run_cli(capsys, "diff", folder, pair[1])
    assert rc == EXIT_ERROR and out == "" and err.count("\n") == 1
    assert f"A ({folder}) names 2 checkpoints: " in err
    rc, out, err = run_cli(capsys, "diff", pair[0], pair[1], "--limit", "-1")
    assert rc == EXIT_ERROR and err == "zeroscan: error: --limit takes the number of rows to show (0 shows all), got -1\n"


def test_diff_help(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "diff", "--help")
    assert rc == EXIT_OK and out.startswith("usage: zeroscan diff A B [options]")
    assert "--plot" not in out and "--histogram" not in out  # options a diff has no use for
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == EXIT_OK and "diff" in out
