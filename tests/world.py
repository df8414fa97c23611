"""A gloo world of spawned processes for tests of collective code.

`spawn_world` starts one process per rank, joined through a file store; each
runs every check in order (a barrier between checks keeps the ranks in step)
and writes, per check, its traceback or the text it returned to a file that
the test process reads back. The whole run is bounded in time, so a hang
fails the tests instead of blocking them, and every failure names its rank
and the seed (ZEROSCAN_TEST_SEED replays it).
"""

from __future__ import annotations

import json
import multiprocessing
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypedDict

import pytest
import torch
import torch.distributed as dist

from helpers import fresh_seed

# check(rank, world_size, seed) runs on every rank and raises to fail; the
# text it returns (None for none) must be the same on every rank. Checks must
# be module-level functions (or partials of them): spawned ranks unpickle them.
Check = Callable[[int, int, int], str | None]


class Outcome(TypedDict):
    error: str | None  # the traceback; None when the check passed
    output: str


class RankRecord(TypedDict):
    outcomes: dict[str, Outcome]  # check name -> outcome
    world_error: str | None  # a failure outside the checks: setup, a barrier, teardown


@dataclass(frozen=True)
class World:
    size: int
    seed: int
    timeout_s: float
    hung: list[int]
    exitcodes: list[int | None]
    records: dict[int, RankRecord]  # an empty record for a rank that wrote none

    def assert_passed(self, name: str) -> None:
        """The check passed on every rank, and every rank returned the same text."""
        finished = {rank: list(self.records[rank]["outcomes"]) for rank in self.hung}
        assert not self.hung, (
            f"ranks {self.hung} still ran after {self.timeout_s} s (seed {self.seed}); checks they finished: {finished}"
        )
        failures = []
        for rank, record in self.records.items():
            outcomes = record["outcomes"]
            if record["world_error"] is not None:
                failures.append(f"rank {rank} failed outside the checks:\n{record['world_error']}")
            if name not in outcomes:
                failures.append(f"rank {rank} wrote no result (exit codes {self.exitcodes}; see captured stderr)")
            elif outcomes[name]["error"] is not None:
                failures.append(f"rank {rank}:\n{outcomes[name]['error']}")
        assert not failures, f"{name} on {self.size} ranks (seed {self.seed}):\n" + "\n".join(failures)
        outputs = [record["outcomes"][name]["output"] for record in self.records.values()]
        assert all(o == outputs[0] for o in outputs), f"{name}: the ranks' results differ (seed {self.seed})"


def spawn_world(
    size: int,
    checks: Mapping[str, Check],
    tmp_path_factory: pytest.TempPathFactory,
    *,
    timeout_s: float,
    collective_timeout_s: float,
) -> World:
    """Runs every check on `size` spawned ranks; skips where gloo is missing.
    `timeout_s` bounds the whole run, `collective_timeout_s` each collective."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    seed = fresh_seed(below=2**31)
    tmp = tmp_path_factory.mktemp(f"world{size}")
    store = str(tmp / "store")
    ctx = multiprocessing.get_context("spawn")  # fork would copy this process's torch threads and state
    procs = [
        ctx.Process(
            target=_run_rank, args=(rank, size, store, str(tmp), seed, dict(checks), collective_timeout_s), daemon=True
        )
        for rank in range(size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join()
    records: dict[int, RankRecord] = {}
    for rank in range(size):
        path = tmp / f"rank{rank}.json"
        records[rank] = json.loads(path.read_text()) if path.exists() else {"outcomes": {}, "world_error": None}
    return World(size, seed, timeout_s, hung, [p.exitcode for p in procs], records)


def _run_rank(
    rank: int, size: int, store: str, out_dir: str, seed: int, checks: dict[str, Check], collective_timeout_s: float
) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    record: RankRecord = {"outcomes": {}, "world_error": None}
    path = Path(out_dir, f"rank{rank}.json")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        for name, check in checks.items():
            try:
                record["outcomes"][name] = {"error": None, "output": check(rank, size, seed) or ""}
            except Exception:
                record["outcomes"][name] = {"error": traceback.format_exc(), "output": ""}
            _write(path, record)  # kept if a later check hangs: it tells how far this rank got
            dist.barrier()
        dist.destroy_process_group()
    except Exception:
        record["world_error"] = traceback.format_exc()
    _write(path, record)


def _write(path: Path, record: RankRecord) -> None:
    """Whole or not at all: a rank killed for hanging may be killed mid-write."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)
