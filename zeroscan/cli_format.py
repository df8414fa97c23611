"""How the `zeroscan` command draws on a terminal: numbers, byte sizes and
shapes in a few characters, aligned tables, ANSI colours (only on a terminal
and not under NO_COLOR), and bytes-scanned progress on stderr.

Text that comes from a file (tensor names, dtype strings) or from the user
(file names) goes through printable() before it reaches a terminal, so a
name holding an escape sequence, a newline or a bidi override is shown, not
obeyed. On a console whose encoding lacks a character (PYTHONIOENCODING=ascii
or latin-1, a Windows cp1252 console) fit_to_console() makes it print an ASCII
fallback ("…" as "...") instead of failing."""

from __future__ import annotations

import codecs
import math
import os
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any, TextIO


LARGE_TTY_BYTES = 64 << 20  # a progress bar on a terminal from this size
LARGE_LOG_BYTES = 1 << 30  # progress lines in a log (stderr not a terminal) from this size


# --- text from files ---------------------------------------------------------------

# Control characters (C0, DEL, C1), format characters (bidi overrides and
# isolates, zero-width joiners), line and paragraph separators, and lone
# surrogates (undecodable bytes of a file name).
UNPRINTABLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: object) -> str:
    """str(text) safe to write to a terminal: every character that could move
    the cursor, forge a line or reorder one is written as its escape, as
    repr() writes it (\\x1b, \\n, \\u202e); an undecodable byte of a file
    name as \\xNN."""
    text = str(text)
    if text.isprintable():  # the common case: nothing to escape
        return text
    return "".join(escape(ch) if unicodedata.category(ch) in UNPRINTABLE_CATEGORIES else ch for ch in text)


def escape(ch: str) -> str:
    code = ord(ch)
    if ch in SHORT_ESCAPES:
        return SHORT_ESCAPES[ch]
    if 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's stand-in for the byte code - 0xDC00
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def display_width(text: str) -> int:
    """Terminal columns of printable text: wide (East Asian) characters take
    two, combining marks none."""
    if text.isascii():
        return len(text)
    return sum(
        0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in text
    )


# --- consoles that cannot encode every character ---------------------------------

# What a console lacking one of these characters shows instead (the reports'
# own symbols, and a few common in tensor names' prose); any other character
# it lacks is written as its escape (escape()), so a name stays recognisable.
ASCII_FALLBACKS = {
    "…": "...", "∈": " in ", "μ": "mu", "σ": "sigma", "‖": "||", "∞": "inf", "–": "-", "—": "--",
    "·": "-", "≤": "<=", "≥": ">=", "≠": "!=", "≈": "~", "±": "+-", "×": "x", "→": "->", "←": "<-", "²": "^2",
    "‘": "'", "’": "'", "“": '"', "”": '"',
}  # fmt: skip
ASCII_FALLBACK_ERRORS = "zeroscan.ascii_fallback"  # the codecs error handler's name


def ascii_fallback(error: UnicodeError) -> tuple[str, int]:
    """The codecs error handler ASCII_FALLBACK_ERRORS: what the encoding
    cannot write becomes its ASCII_FALLBACKS entry or its escape."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    lost = error.object[error.start : error.end]
    return "".join(ASCII_FALLBACKS.get(ch) or escape(ch) for ch in lost), error.end


codecs.register_error(ASCII_FALLBACK_ERRORS, ascii_fallback)


def fit_to_console(stream: TextIO | None) -> None:
    """Makes the text stream `stream` write the characters its encoding
    lacks as ASCII fallbacks rather than raise UnicodeEncodeError mid-report.
    A stream that encodes them all (UTF-8), or cannot be reconfigured (a
    StringIO, a closed stream's None), is left as it is."""
    encoding = getattr(stream, "encoding", None)
    reconfigure = getattr(stream, "reconfigure", None)
    if not encoding or reconfigure is None:
        return
    try:
        "".join(ASCII_FALLBACKS).encode(encoding)
        return
    except UnicodeEncodeError:
        pass
    except LookupError:  # an encoding Python does not know: nothing to reconfigure it with
        return
    reconfigure(errors=ASCII_FALLBACK_ERRORS)


# --- numbers, tables, colours ----------------------------------------------------


BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")  # a size past the last stays in it


def fmt_bytes(n: float) -> str:
    """A byte size in binary units: 1536 -> "1.5 KiB". The unit is the
    smallest whose rounded value stays below 1024, so 1023.96 KiB reads
    "1.0 MiB", not "1024.0 KiB"."""
    for power, unit in enumerate(BYTE_UNITS):
        value = n / 1024**power
        text = f"{value:.0f}" if unit == "B" else f"{value:.1f}"  # whole bytes, tenths of the rest
        # Compare the rounded text, not value: 1023.96 is below 1024 but prints as "1024.0".
        if float(text) < 1024:
            break
    return f"{text} {unit}"


def fmt_num(v: object) -> str:
    """A statistic in 3 significant digits; None (not measured) is "-"."""
    if v is None:
        return "-"
    x = float(v)  # type: ignore[arg-type]
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.2e}"


def fmt_percent(part: int, whole: int) -> str:
    """part/whole in percent; a nonzero part below 0.01 % shows as "<0.01%", never as "0"."""
    if part == 0 or whole == 0:
        return "0"
    if part == whole:
        return "100%"
    pct = 100.0 * part / whole
    return f"{pct:.3g}%" if pct >= 0.01 else "<0.01%"


def fmt_shape(shape: Sequence[int]) -> str:
    """A shape without spaces, so a table column stays one word: [3,4]."""
    return "[" + ",".join(str(s) for s in shape) + "]"


class Style:
    """ANSI colours on a terminal (and not under NO_COLOR), nothing otherwise."""

    CODES = {"error": "31;1", "warning": "33", "info": "36", "ok": "32", "dim": "2", "bold": "1"}

    def __init__(self, stream: TextIO) -> None:
        self.on = stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"

    def __call__(self, text: str, kind: str) -> str:
        code = self.CODES.get(kind)
        return f"\033[{code}m{text}\033[0m" if self.on and code else text


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int], colors: Sequence[str | None],
                 style: Style, color_col: int) -> list[str]:
    """The table as lines: every cell made printable(), columns padded to their
    widest cell (those in `right` right-aligned), the header bold, and column
    `color_col` of each row in that row's colour."""
    rows = [[printable(c) for c in row] for row in rows]
    widths = [display_width(h) for h in headers]
    for row in rows:
        widths = [max(w, display_width(c)) for w, c in zip(widths, row)]

    def line(cells: Sequence[str], color: str | None) -> str:
        parts = []
        for i, (c, w) in enumerate(zip(cells, widths)):
            pad = " " * (w - display_width(c))
            cell = pad + c if i in right else c + pad
            if i == color_col and color:
                cell = style(cell, color)
            parts.append(cell)
        return "  ".join(parts).rstrip()

    out = [style(line(headers, None), "bold")]
    out += [line(row, color) for row, color in zip(rows, colors)]
    return out


# --- progress ------------------------------------------------------------------


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


# --- log2-magnitude histograms ----------------------------------------------------

BULK_SHARE = 0.99  # the share of a tensor's nonzero finite values that fmt_binades' second range holds


def fmt_binades(histogram: Mapping[str, Any], dtype: str) -> str:
    """Where a tensor's nonzero finite values lie, from its histogram
    (Histogram.to_dict()) and its dtype's name: "2^-24..2^3, 99% in
    2^-8..2^1" says every one has 2^-24 <= |x| < 2^3, and at least 99 % of
    them 2^-8 <= |x| < 2^1 (the binades left when those holding the
    smallest and the largest 0.5 % are dropped; left out when that is the
    whole range). Subnormals count as the binade from the dtype's smallest
    subnormal to its smallest normal. "-" when there is no such value."""
    bins = binade_bins(histogram, dtype)
    total = sum(count for _, _, count in bins)
    if not total:
        return "-"
    first, last = bulk(bins, total)
    text = f"{fmt_power(bins[0][0])}..{fmt_power(bins[-1][1])}"
    if (first, last) != (0, len(bins) - 1):
        text += f", {BULK_SHARE:.0%} in {fmt_power(bins[first][0])}..{fmt_power(bins[last][1])}"
    return text


def binade_bins(histogram: Mapping[str, Any], dtype: str) -> list[tuple[int, int, int]]:
    """(low exponent, high exponent, count) of each nonempty bin, ascending: the
    values 2^low <= |x| < 2^high; subnormals first, normal binades after."""
    bins = [(int(e), int(e) + 1, int(c)) for e, c in histogram["binades"].items() if int(c)]
    bins.sort()
    if int(histogram["subnormal"]):
        lowest = int(histogram["min_exponent"])
        bins.insert(0, (lowest - mantissa_bits(dtype), lowest, int(histogram["subnormal"])))
    return bins


def mantissa_bits(dtype: str) -> int:
    """The explicit mantissa bits of a floating dtype (a complex one's parts'), by torch's name."""
    import torch

    return round(-math.log2(torch.finfo(getattr(torch, dtype)).eps))


def bulk(bins: Sequence[tuple[int, int, int]], total: int) -> tuple[int, int]:
    """The first and last index of `bins` left when the bins at each end
    holding at most (1 - BULK_SHARE) / 2 of `total` are dropped."""
    tail = (1.0 - BULK_SHARE) / 2 * total
    first, below = 0, bins[0][2]
    while below <= tail:
        first += 1
        below += bins[first][2]
    last, above = len(bins) - 1, bins[-1][2]
    while above <= tail:
        last -= 1
        above += bins[last][2]
    return first, last


def fmt_power(exponent: int) -> str:
    return f"2^{exponent}"
