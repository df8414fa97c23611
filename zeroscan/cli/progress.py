"""Bytes-scanned progress on stderr while the `zeroscan` command reads a
checkpoint: a bar on a terminal, a line per 10 % in a log, nothing for a
small checkpoint unless asked (--progress)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from zeroscan.cli.cells import fmt_bytes
from zeroscan.safe_text import printable

LARGE_TTY_BYTES = 64 << 20  # a progress bar on a terminal from this size
LARGE_LOG_BYTES = 1 << 30  # progress lines in a log (stderr not a terminal) from this size


class Progress:
    """Bytes-scanned progress on stderr: tqdm when installed and stderr is a
    terminal, else a line rewritten in place (terminal) or a line per 10 %
    (a log).

    Called as a scan's progress(done, total). Without a `total` it takes the
    one the first call gives: a many-file checkpoint's size is known only
    once it is open. `enabled` None shows progress only for a large total."""

    def __init__(self, label: str, total: int | None = None, enabled: bool | None = None,
                 stream: TextIO | None = None) -> None:
        self.stream: TextIO = stream or sys.stderr  # None when stderr is closed: no progress
        self.tty = self.stream is not None and self.stream.isatty()
        self.wanted = enabled
        self.label = printable(label)
        self.total = 0
        self.enabled = False
        self.started = False
        self.last_decile = -1
        self.bar: Any = None
        if total is not None:
            self.start(total)

    def start(self, total: int) -> None:
        """Decides, once, whether to show progress towards `total` bytes."""
        self.started = True
        self.total = total
        enabled = self.wanted
        if enabled is None:
            enabled = total >= (LARGE_TTY_BYTES if self.tty else LARGE_LOG_BYTES)
        self.enabled = enabled and total > 0 and self.stream is not None
        if self.enabled and self.tty:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=self.label,
                                file=self.stream, leave=False, dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if not self.started:
            self.start(total)
        if not self.enabled:
            return
        if self.bar is not None:
            if total != self.bar.total:
                self.bar.total = total
            self.bar.update(done - self.bar.n)
            return
        pct = 100.0 * done / total if total else 100.0
        if self.tty:
            self.stream.write(f"\r{self.label}: {pct:5.1f}% ({fmt_bytes(done)} of {fmt_bytes(total)})")
            self.stream.flush()
        elif int(pct // 10) > self.last_decile:
            self.last_decile = int(pct // 10)
            self.stream.write(f"{self.label}: {pct:.0f}% ({fmt_bytes(done)} of {fmt_bytes(total)})\n")
            self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()
