"""What the scan's and the diff's tables share: how a table is laid out
(render_table: aligned columns, the severity coloured), row orders,
--limit, and the cells that name groups and tensors."""

from __future__ import annotations

import argparse
import unicodedata
from collections.abc import Sequence
from typing import Any, TypeVar

from zeroscan.checkpoint.groups import RANK
from zeroscan.cli.console import Style
from zeroscan.cli.exits import UsageError
from zeroscan.safe_text import printable
from zeroscan.words import count_noun

SORT_KEYS = ("worst", "order", "name", "numel", "zeros", "subnormal", "near-zero", "nan", "severity")
DIFF_SORT_KEYS = ("worst", "order", "name", "numel", "severity")  # the orders a diff's rows have
DEFAULT_LIMIT = 50  # table rows a text report shows: a 7,000-tensor model reads as its worst 50
TOP_LEVEL = "(top level)"  # how a table shows the group "" (names of one component)

T = TypeVar("T")


def row_order(args: argparse.Namespace) -> str:
    """--sort as given; without it, worst first in a table and file order in
    JSON, which programs read whole and compare run to run."""
    return args.sort or ("order" if args.json else "worst")


def check_limit(limit: int) -> None:
    if limit < 0:
        raise UsageError(f"--limit takes the number of rows to show (0 shows all), got {limit}")


def limited(items: Sequence[T], limit: int) -> tuple[Sequence[T], int]:
    """The first `limit` items (all when limit is 0) and how many were left out."""
    if limit == 0 or len(items) <= limit:
        return items, 0
    return items[:limit], len(items) - limit


def more_line(hidden: int, noun: str) -> str:
    """The line that says a table or list left `hidden` things out."""
    in_number = count_noun(hidden, noun).partition(" ")[2]  # the noun agreeing with `hidden`
    return f"… {hidden:,} more {in_number} not shown (--limit 0 shows all)\n"


def with_findings(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows or groups --only-findings shows: those whose severity is not "ok"."""
    return [r for r in items if r["severity"] != "ok"]


def group_label(group: str) -> str:
    return group or TOP_LEVEL


def within(name: str, group: str) -> str:
    """`name` without its group's prefix, when it has it: the worst tensor of
    group model.layers.17 is self_attn.q_proj.weight."""
    return name[len(group) + 1 :] if group and name.startswith(group + ".") else name


def short_name(name: str) -> str:
    return name if len(name) <= 60 else "…" + name[-59:]


def worst_cell(group: dict[str, Any]) -> str:
    """A group table's "worst tensor" cell: the tensor to look at first, none in a group without findings."""
    if group["severity"] == "ok":
        return "-"
    return short_name(within(group["worst_tensor"], group["group"]))


def worst_of(severities: Sequence[str]) -> str:
    return max(severities, key=lambda s: RANK.get(s, 0), default="ok")


def display_width(text: str) -> int:
    """Terminal columns of printable text: wide (East Asian) characters take
    two, combining marks none."""
    if text.isascii():
        return len(text)
    return sum(
        0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in text
    )


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
