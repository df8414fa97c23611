"""How a `zeroscan` command ends: its exit statuses, and UsageError, the
one-line refusal of a bad combination of arguments (EXIT_ERROR)."""

from __future__ import annotations

from zeroscan.checkpoint.groups import RANK

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A bad combination of arguments; str() is one line."""


def exit_status(worst: str, fail_on: str) -> int:
    """EXIT_FINDINGS when the worst severity found is at or above --fail-on, else EXIT_OK."""
    if fail_on == "none":
        return EXIT_OK
    return EXIT_FINDINGS if RANK.get(worst, 0) >= RANK[fail_on] else EXIT_OK
