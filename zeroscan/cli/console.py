"""How the `zeroscan` command writes to a console: ANSI colours only on a
terminal and not under NO_COLOR (Style), and on a console whose encoding
lacks a character (PYTHONIOENCODING=ascii or latin-1, a Windows cp1252
console) an ASCII fallback ("…" as "...") instead of a failure
(fit_to_console)."""

from __future__ import annotations

import codecs
import os
from typing import TextIO

from zeroscan.safe_text import escape

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


class Style:
    """ANSI colours on a terminal (and not under NO_COLOR), nothing otherwise."""

    CODES = {"error": "31;1", "warning": "33", "info": "36", "ok": "32", "dim": "2", "bold": "1"}

    def __init__(self, stream: TextIO) -> None:
        self.on = stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"

    def __call__(self, text: str, kind: str) -> str:
        code = self.CODES.get(kind)
        return f"\033[{code}m{text}\033[0m" if self.on and code else text
