"""Text from a file or a user made safe to show: printable() writes every
character that could move a terminal's cursor, forge a line or reorder one
(an escape sequence, a newline, a bidi override in a tensor's or a file's
name) as its escape, so that it is shown, not obeyed. The `zeroscan`
command's reports, the plots' labels and the demo's lines all go through it."""

from __future__ import annotations

import unicodedata

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
