"""Many small cases checked in one test.

On a GPU every test case pays a fixed cost (launches, host syncs, the
pytest-xdist worker's round trip) far above what scanning a small tensor
takes, so the tests over many small inputs (sizes, densities of special
values, layouts, planted positions) check them in a loop inside one case per
dtype and device, rather than one parametrized case each. A Checklist keeps
what separate cases gave: every case runs whatever the others did, and the
test fails naming each case that failed, with the first one's traceback. The
seed the test prints (helpers.fresh_seed) replays them all.

    with Checklist() as checks:
        for n in SIZES:
            with checks.case(f"n={n}"):
                ...
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType


class Checklist:
    def __init__(self) -> None:
        self.cases = 0
        self.failures: list[tuple[str, Exception]] = []

    def __enter__(self) -> Checklist:
        return self

    @contextmanager
    def case(self, label: str) -> Iterator[None]:
        """One case: an exception it raises is kept under `label`, and the
        next case runs. (pytest.skip and KeyboardInterrupt are no Exception:
        they end the test as usual.)"""
        __tracebackhide__ = True  # pytest shows the case's own frames
        self.cases += 1
        try:
            yield
        except Exception as err:
            self.failures.append((label, err))

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        __tracebackhide__ = True
        if error is not None or not self.failures:
            return
        listed = "\n".join(f"  [{case}] {type(err).__name__}: {first_line(err)}" for case, err in self.failures)
        label, first = self.failures[0]
        if first.args and isinstance(first.args[0], str):  # pytest's one-line summary then names the case
            first.args = (f"[{label}] {first.args[0]}", *first.args[1:])
        first.add_note(f"{len(self.failures)} of {self.cases} cases failed (the traceback is the first's):\n{listed}")
        raise first


def first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""
