"""The diff: `zeroscan diff A B` (and `zeroscan scan A B --diff`,
cmd_scan_diff) compares two checkpoints tensor by tensor
(zeroscan.checkpoint.diff) and reports it as a tensor table, a group table
(--group-by) or one JSON object (--json; the schema is in zeroscan.cli's
docstring)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from zeroscan.cli import tables
from zeroscan.cli.cells import fmt_num, fmt_percent, fmt_shape
from zeroscan.cli.console import Style
from zeroscan.cli.exits import UsageError, exit_status
from zeroscan.cli.parser import version
from zeroscan.cli.progress import Progress
from zeroscan.report_data import json_safe
from zeroscan.safe_text import printable
from zeroscan.checkpoint.groups import DIFF_STATUSES, RANK, diff_groups, diff_worst_key
from zeroscan.checkpoint.paths import CheckpointPath, expand_paths
from zeroscan.words import count_noun, is_are, listed

SHOWN_PATHS = 4  # paths an error lists before "and N more"


def cmd_diff(args: argparse.Namespace, out: TextIO) -> int:
    """`zeroscan diff A B`: compares checkpoint A with checkpoint B."""
    tables.check_limit(args.limit)
    a, b = checkpoints_a_and_b(args.paths)
    return compare(a, b, args, out)


def cmd_scan_diff(args: argparse.Namespace, out: TextIO) -> int:
    """`zeroscan scan A B --diff`: what `zeroscan diff A B` does, refusing the
    scan's options a diff has no use for."""
    tables.check_limit(args.limit)
    if args.plot:
        raise UsageError("--plot draws a scan; leave out --diff to plot a checkpoint")
    if args.histogram or args.target_format:
        raise UsageError("--histogram counts a scan's magnitudes; leave out --diff to count them")
    a, b = two_checkpoints(args.paths)
    return compare(a, b, args, out)


def checkpoints_a_and_b(paths: Sequence[str]) -> tuple[CheckpointPath, CheckpointPath]:
    """The checkpoints `zeroscan diff A B` compares: exactly two PATHs, each
    naming one checkpoint (a file, a checkpoint folder, or a glob or folder
    that holds one). UsageError otherwise, naming what was given."""
    if len(paths) != 2:
        given = f"{count_noun(len(paths), 'path')}: {listed(list(paths), SHOWN_PATHS)}" if paths else "no path"
        raise UsageError(f"diff compares two checkpoints, A and B; got {given}")
    found = []
    for label, path in zip("AB", paths):
        named = expand_paths([path])
        if len(named) != 1:  # a folder or glob of several checkpoints
            names = listed([c.text for c in named], SHOWN_PATHS)
            raise UsageError(f"diff compares two checkpoints, A and B; {label} ({path}) names "
                             f"{count_noun(len(named), 'checkpoint')}: {names}")
        found.append(named[0])
    return found[0], found[1]


def two_checkpoints(paths: Sequence[str]) -> tuple[CheckpointPath, CheckpointPath]:
    """The two checkpoints `scan --diff` compares, from PATHs that may be folders or globs."""
    found = expand_paths(paths)
    if len(found) != 2:
        raise UsageError(f"--diff compares exactly two checkpoints; the paths given name {len(found)}: "
                         f"{listed([c.text for c in found], SHOWN_PATHS)}")
    return found[0], found[1]


def compare(a: CheckpointPath, b: CheckpointPath, args: argparse.Namespace, out: TextIO) -> int:
    """Diffs checkpoint `a` against `b` (each opened as expand_paths found
    it) and writes the report `args` asks for; returns the exit status
    --fail-on gives the worst finding."""
    from zeroscan.checkpoint.diff import diff_checkpoints

    progress = Progress(f"comparing {Path(a.text).name or a.text}", enabled=args.progress)
    try:
        rows = diff_checkpoints(a, b, trained_from_first=args.trained_from_first, progress=progress)
    finally:
        progress.close()
    summary = diff_summary(rows)
    shown_rows = sort_diff_rows(tables.with_findings(rows) if args.only_findings else rows, tables.row_order(args))
    groups = None
    if args.group_by:
        groups = diff_group_rows(rows, a.text, b.text, args.group_by)
        if args.only_findings:
            groups = tables.with_findings(groups)
    if args.json:
        doc = {"zeroscan": version(), "command": "diff", "a": a.text, "b": b.text,
               "trained_from_first": args.trained_from_first, "tensors": shown_rows}
        if groups is not None:
            doc["groups"] = groups
        doc["summary"] = summary
        json.dump(json_safe(doc), out, indent=1)
        out.write("\n")
    else:
        write_diff_text(a.text, b.text, rows, shown_rows, groups, args, out)
    return exit_status(summary["worst"], args.fail_on)


def diff_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON's "summary": tensors per status, how many became NaN/Inf or zero, the worst severity."""
    summary: dict[str, Any] = {s: sum(1 for r in rows if r["status"] == s) for s in DIFF_STATUSES}
    summary["became_nan"] = sum(1 for r in rows if r.get("became") == "nan")
    summary["became_zero"] = sum(1 for r in rows if r.get("became") == "zero")
    summary["worst"] = tables.worst_of([str(r["severity"]) for r in rows])
    return summary


def sort_diff_rows(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Diff rows by `key`: worst (diff_worst_key), severity, name, numel; file order otherwise."""
    keys: dict[str, Callable[[dict[str, Any]], Any]] = {
        "worst": lambda r: tuple(-k for k in diff_worst_key(r)),
        "severity": lambda r: -RANK[r["severity"]],
        "name": lambda r: r["name"],
        "numel": lambda r: -int(r["numel"]),
    }
    return sorted(rows, key=keys[key]) if key in keys else rows


def diff_group_rows(rows: Sequence[dict[str, Any]], a: str, b: str, by: str) -> list[dict[str, Any]]:
    """The diff's groups; a one-file checkpoint's shard is its file name (b's for a tensor only in b)."""
    named = [dict(r, shard=r.get("shard") or Path(b if r["status"] == "added" else a).name) for r in rows]
    return diff_groups(named, by)


def diff_group_table(groups: Sequence[dict[str, Any]], style: Style) -> list[str]:
    headers = ["group", "tensors", *DIFF_STATUSES, "became NaN", "became zero", "worst", "worst tensor"]
    cells, colors = [], []
    for g in groups:
        name = tables.short_name(tables.group_label(g["group"]))
        cells.append([name, str(g["tensors"]), *(str(g[s]) for s in DIFF_STATUSES),
                      str(g["became_nan"]), str(g["became_zero"]), g["severity"], tables.worst_cell(g)])
        colors.append(g["severity"] if g["severity"] != "ok" else None)
    severity_col = len(headers) - 2
    return tables.render_table(headers, cells, right=set(range(1, severity_col)), colors=colors, style=style,
                        color_col=severity_col)


def diff_tensor_table(rows: Sequence[dict[str, Any]], style: Style) -> list[str]:
    headers = ["name", "dtype", "shape", "status", "changed", "max |a-b|", "note"]
    cells, colors = [], []
    for r in rows:
        changed = "-" if "changed" not in r else fmt_percent(int(r["changed"]), int(r["numel"]))
        cells.append([tables.short_name(r["name"]), r["dtype"], fmt_shape(r["shape"]), r["status"], changed,
                      fmt_num(r.get("max_abs_diff")), r["reason"]])
        colors.append(r["severity"] if r["severity"] != "ok" else None)
    return tables.render_table(headers, cells, {4, 5}, colors, style, color_col=3)


def write_diff_text(a: str, b: str, rows: Sequence[dict[str, Any]], shown_rows: Sequence[dict[str, Any]],
                    groups: Sequence[dict[str, Any]] | None, args: argparse.Namespace, out: TextIO) -> None:
    """The text report: "a -> b"; the group table with --group-by, else the
    tensor table, stopping at --limit; then the counts and what they mean."""
    style = Style(out)
    out.write(style(printable(f"{a} -> {b}"), "bold") + "\n")
    if groups is not None:
        part, hidden = tables.limited(groups, args.limit)
        lines, noun = (diff_group_table(part, style) if part else []), "group"
    else:
        part, hidden = tables.limited(shown_rows, args.limit)
        lines, noun = (diff_tensor_table(part, style) if part else []), "tensor"
    if lines:
        out.write("\n".join(lines) + "\n")
    if hidden:
        out.write(tables.more_line(hidden, noun))
    write_diff_counts(rows, out)


def write_diff_counts(rows: Sequence[dict[str, Any]], out: TextIO) -> None:
    """The lines under the table: names per status, what became NaN/Inf or
    zero, and what bit-identical floating-point tensors say."""
    summary = diff_summary(rows)
    words = ", ".join(f"{summary[s]} {s}" for s in DIFF_STATUSES if summary[s])
    out.write(f"\n{count_noun(len(rows), 'name')}: {words or 'none'}\n")
    became = []
    if summary["became_nan"]:
        became.append(f"{count_noun(summary['became_nan'], 'tensor')} became NaN/Inf")
    if summary["became_zero"]:
        became.append(f"{count_noun(summary['became_zero'], 'tensor')} became all zero")
    if became:
        out.write("; ".join(became) + "\n")
    never = sum(1 for r in rows if r["status"] == "identical" and r["severity"] == "warning")
    unchanged = sum(1 for r in rows if r["status"] == "identical" and r["severity"] == "info")
    if never:
        out.write("a floating-point tensor left bit-identical while others changed was never updated "
                  "between the two checkpoints: frozen, missing from the optimizer, or its gradient "
                  "was always zero\n")
    elif unchanged:
        # Unchanged is how a frozen backbone looks, so it is only a warning when the user says so.
        out.write(f"{count_noun(unchanged, 'floating-point tensor')} {is_are(unchanged)} unchanged; "
                  "if the second file was trained from the first, --trained-from-first makes "
                  f"{'it a warning' if unchanged == 1 else 'them warnings'}\n")
