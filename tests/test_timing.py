"""benchmarks/timing.py's best_in_turn: the calls it compares take turns, so
a ratio between them is taken over the same moments and the same caches."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture()
def timing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import timing

    return timing


def recorder(name: str, seconds: float, calls: list[str]):
    def call() -> None:
        calls.append(name)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    return call


def test_calls_of_a_millisecond_alternate_one_at_a_time(timing) -> None:
    calls: list[str] = []
    fns = [recorder("floor", 0.0012, calls), recorder("stats", 0.0024, calls), recorder("hist", 0.0012, calls)]
    best = timing.best_in_turn(fns, budget=0.05)
    timed = calls[6:]  # after the warm-up call and the one sizing call of each
    assert len(timed) >= 15 and len(timed) % 3 == 0, calls
    assert timed == ["floor", "stats", "hist"] * (len(timed) // 3), calls
    assert best[0] >= 0.0012 and best[1] >= 0.0024 and best[2] >= 0.0012, best
    assert best[1] > best[0], best


def test_short_calls_are_batched_and_each_is_timed(timing) -> None:
    calls: list[str] = []
    best = timing.best_in_turn([recorder("a", 0.0, calls), recorder("b", 0.00005, calls)], budget=0.05)
    assert calls.count("a") > 20 and calls.count("b") > 20, (calls.count("a"), calls.count("b"))
    assert 0.0 < best[0] < best[1], best
