"""A world of spawned processes for tests of collective code: gloo on the
CPU by default, or NCCL with one GPU per rank.

`spawn_world` starts one process per rank, joined through a file store; each
runs every check in order (a barrier between checks keeps the ranks in step)
and writes, per check, its traceback or the text it returned to a file that
the test process reads back. The whole run is bounded in time, so a hang
fails the tests instead of blocking them, and every failure names its rank
and the seed (ZEROSCAN_TEST_SEED replays it). Where the backend cannot run
(no gloo; for NCCL: no NCCL in this torch, no CUDA device, or fewer devices
than ranks) the calling test is skipped and says why. `module_world` makes
of it a module-scoped fixture, for a module whose tests each assert one check.

With backend="nccl", rank r makes CUDA device r % device_count its current
device before joining, so a check's `.to("cuda")` lands on its own GPU (NCCL
refuses two ranks on one GPU); the default group is then NCCL, and a check
that also wants gloo creates it with dist.new_group(backend="gloo").
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
    backend: str = "gloo",
) -> World:
    """Runs every check on `size` spawned ranks of a `backend` ("gloo" or
    "nccl") world; skips where that backend cannot run here (see the module
    doc). `timeout_s` bounds the whole run, `collective_timeout_s` each collective."""
    skip_unless_backend_runs(backend, size)
    seed = fresh_seed(below=2**31)
    tmp = tmp_path_factory.mktemp(f"world{size}_{backend}")
    store = str(tmp / "store")
    ctx = multiprocessing.get_context("spawn")  # fork would copy this process's torch threads and state
    procs = [
        ctx.Process(
            target=_run_rank,
            args=(rank, size, backend, store, str(tmp), seed, dict(checks), collective_timeout_s),
            daemon=True,
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


def module_world(
    size: int, checks: Mapping[str, Check], *, timeout_s: float, collective_timeout_s: float
) -> Callable[..., World]:
    """A module-scoped fixture that spawns one world for all of a module's
    tests: `world = module_world(2, CHECKS, timeout_s=90.0, collective_timeout_s=30.0)`,
    then each test takes `world` and asserts one check with `world.assert_passed`."""

    @pytest.fixture(scope="module", name="world")
    def world_fixture(tmp_path_factory: pytest.TempPathFactory) -> World:
        return spawn_world(
            size, checks, tmp_path_factory, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s
        )

    return world_fixture


def skip_unless_backend_runs(backend: str, size: int) -> None:
    """pytest.skip, saying why, unless a `size`-rank `backend` world can run here."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"spawn_world: backend must be 'gloo' or 'nccl', got {backend!r}")
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    if backend == "gloo" and not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if backend == "nccl":
        if not dist.is_nccl_available():
            pytest.skip("torch.distributed with NCCL is not available (this torch is built without NCCL)")
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if devices == 0:
            pytest.skip("NCCL needs a CUDA device, and none is available")
        if devices < size:
            pytest.skip(f"NCCL needs one CUDA device per rank: {size} ranks, {devices} device(s)")


def _run_rank(
    rank: int,
    size: int,
    backend: str,
    store: str,
    out_dir: str,
    seed: int,
    checks: dict[str, Check],
    collective_timeout_s: float,
) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    record: RankRecord = {"outcomes": {}, "world_error": None}
    path = Path(out_dir, f"rank{rank}.json")
    try:
        if backend == "nccl":
            # Before joining: NCCL binds each rank's communicator to the current device.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
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
            _barrier(backend)
        dist.destroy_process_group()
    except Exception:
        record["world_error"] = traceback.format_exc()
    _write(path, record)


def _barrier(backend: str) -> None:
    if backend == "nccl":
        # NCCL's barrier is an all_reduce on some GPU: name this rank's own
        # rather than let torch guess it (and warn).
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def _write(path: Path, record: RankRecord) -> None:
    """Whole or not at all: a rank killed for hanging may be killed mid-write."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)
