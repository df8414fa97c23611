"""The Monitor's step path and report() from another thread, taking turns.

A logger's or a dashboard's thread may read reports while the training
thread steps. One reentrant lock keeps them apart: the hooks of the step
path hold it while they record, report() while it reads. A plain lock is
not fair, though: a thread that calls report() in a loop takes the lock
back as soon as it lets it go, and the training thread, woken too late,
waits again. So a step that is waiting goes first: report() lets it in
before taking the lock, and training waits at most for the one report
already being made.
"""

from __future__ import annotations

import threading
import time
from typing import Any

# How long report() lets waiting steps go first before it takes its turn
# anyway (so that steps arriving back to back cannot hold a report off).
REPORT_PATIENCE_S = 0.5


class Turns:
    """`with turns.step:` around the step path, `with turns.report:` around
    report(); both reentrant, on one lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.step_waiting = False  # a step is (or was just) waiting for the lock
        self.step = _StepTurn(self)
        self.report = _ReportTurn(self)


class _Turn:
    """One side's `with`: __enter__ waits for the lock as that side does."""

    __slots__ = ("_turns",)

    def __init__(self, turns: Turns) -> None:
        self._turns = turns

    def __exit__(self, *exc: Any) -> None:
        self._turns.lock.release()


class _StepTurn(_Turn):
    __slots__ = ()

    def __enter__(self) -> None:
        turns = self._turns
        turns.step_waiting = True
        turns.lock.acquire()
        turns.step_waiting = False


class _ReportTurn(_Turn):
    __slots__ = ()

    def __enter__(self) -> None:
        turns = self._turns
        deadline = time.monotonic() + REPORT_PATIENCE_S
        while turns.step_waiting and time.monotonic() < deadline:
            time.sleep(1e-4)
        turns.lock.acquire()
