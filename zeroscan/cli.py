"""The `zeroscan` command: scan checkpoints, tour the verdicts.

    zeroscan scan PATH...            a table per checkpoint
    zeroscan scan --histogram PATH   ... and where each tensor's |x| lie, binade by binade
    zeroscan scan a.pt b.pt --diff   which tensors changed, which stayed bit-identical
    zeroscan demo                    a short tour of every verdict on built-in examples

A PATH is a checkpoint file (torch.save, .safetensors), a checkpoint folder
(a sharded model with or without its index file, a torch.distributed.checkpoint
folder), a shard index file, a plain folder of checkpoints or a glob
(zeroscan.checkpoint.paths.expand_paths); each checkpoint it names is scanned
on its own, with one progress bar over all its files.

Tables list the worst tensors first (--sort worst: severity, then NaN/Inf
count, then zero fraction) and show at most --limit rows (50; 0 for all), so
a model of thousands of tensors opens on what matters; --group-by layer,
module or shard sums them up per group (zeroscan.checkpoint.groups).

Exit status: 0 when all went well; 1 when a finding at or above `--fail-on`
exists (default error, so a NaN fails a CI step as a linter's error does;
`--fail-on none` never fails), a tensor the scan skipped counting with its
severity; 2 for a usage error or a file that cannot be read (one line on
stderr, never a traceback); 130 when interrupted.

Each tensor is judged in its role (zeroscan.checkpoint.roles): a zero bias, a
normalisation layer's ones, BatchNorm's running statistics are OK; an
all-zero weight matrix or kernel is a warning; NaN/Inf an error in any role.

`scan --json` writes one JSON object to stdout (floats that are NaN or
infinite are written as null; the counts say which). Every row is written,
whatever --limit says, in file order unless --sort is given:

    {"zeroscan": VERSION, "command": "scan", "tol": float|null,
     "files": [{"path", "format", "shards", "nbytes", "tensors": [ROW...],   # shards: files holding its tensors
                "skipped": [{"name", "dtype", "shape", "reason", "severity"?, "shard"?}],
                "groups": [GROUP...]}],                     # "groups" only with --group-by
     "summary": {"files", "tensors", "skipped", "findings": {"info", "warning", "error"}, "worst"}}
    ROW: {"name", "dtype", "shape", "numel", "zeros", "zero_fraction", "subnormal", "near_zero",
          "nan", "posinf", "neginf", "negative", "min_abs", "min_abs_nonzero", "max_abs",
          "mean", "std", "norm", "verdict", "role", "severity", "reason", "shard", "histogram"?}
    HISTOGRAM: {"min_exponent", "max_exponent", "binades": {"E": count}, "zeros", "subnormal",
                "posinf", "neginf", "nan"}                  # "histogram" only with --histogram
    GROUP: {"group", "tensors", "elements", "zeros", "zero_fraction", "subnormal", "near_zero",
            "nan", "inf", "skipped", "findings", "severity", "worst_tensor"}

A HISTOGRAM (zeroscan.histogram.Histogram.to_dict()) counts every element
once: "binades" lists the nonempty normal binades, "E" counting the finite
values with 2^E <= |x| < 2^(E+1) (an integer's E is its bit length less 1);
min_exponent and max_exponent are the dtype's lowest and highest binade. A
complex tensor's counts its real and imaginary parts. In the tensor table,
--histogram adds a "binades" column (zeroscan.cli_format.fmt_binades):
"2^-24..2^3, 99% in 2^-8..2^1" says every nonzero finite |x| is in
[2^-24, 2^3) and at least 99% of them in [2^-8, 2^1). --plot then draws the
histograms (zeroscan.plot_histograms.plot_histograms) instead of the scan's bars, with
--target-format's range marked.

"shard" is the file holding the tensor, relative to the checkpoint's folder
("" for a one-file checkpoint; several names joined by "," for a DCP tensor
stored in pieces). A skipped entry's "severity" is "info" where it is absent;
"error" for a tensor an index lists but its shard lacks. The summary's
"findings" counts scanned tensors; its "worst" includes the skipped entries'
severities. Groups come worst first; a shard group of a one-file checkpoint
is named after the file.

With `--diff`:

    {"zeroscan": VERSION, "command": "diff", "a", "b", "trained_from_first": bool,
     "tensors": [{"name", "dtype", "shape", "numel", "shard", "status", "severity", "reason", "became",
                  "changed", "changed_fraction", "max_abs_diff"}],   # the last three when compared
     "groups": [{"group", "tensors", "changed", "identical", "added", "removed", "reshaped", "retyped",
                 "unread", "became_nan", "became_zero", "findings", "severity", "worst_tensor"}],
                                                                     # only with --group-by
     "summary": {"changed", "identical", "added", "removed", "reshaped", "retyped", "unread",
                 "became_nan", "became_zero", "worst"}}

"became" is "nan" for a tensor with elements NaN/Inf in b that were finite in
a (an error: "became NaN/Inf at N elements"), "zero" for one all zero in b
and not in a (a warning), "" otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO, TypeVar

from zeroscan.cli_format import (
    Progress,
    Style,
    fmt_binades,
    fmt_bytes,
    fmt_count,
    fmt_num,
    fmt_percent,
    fmt_shape,
    fit_to_console,
    printable,
    render_table,
)
from zeroscan.report_data import json_safe
from zeroscan.checkpoint.groups import (
    DIFF_STATUSES,
    GROUP_KEYS,
    RANK,
    diff_groups,
    diff_worst_key,
    scan_groups,
    worst_first,
)
from zeroscan.words import count_noun, is_are

SORT_KEYS = ("worst", "order", "name", "numel", "zeros", "subnormal", "near-zero", "nan", "severity")
DEFAULT_LIMIT = 50  # table rows a text report shows: a 7,000-tensor model reads as its worst 50
TOP_LEVEL = "(top level)"  # how a table shows the group "" (names of one component)
EXIT_OK, EXIT_FINDINGS, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130

T = TypeVar("T")


class UsageError(Exception):
    """A bad combination of arguments; str() is one line."""


# --- what a report shows ------------------------------------------------------------


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


# --- scan ------------------------------------------------------------------------


def sort_rows(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows by `key`: worst first, name ascending, file order, or the largest first."""
    if key == "order":
        return rows
    if key == "worst":
        return worst_first(rows)
    if key == "name":
        return sorted(rows, key=lambda r: r["name"])
    numel = lambda r: max(int(r.get("numel") or 0), 1)  # noqa: E731
    keys: dict[str, Callable[[dict[str, Any]], float]] = {
        "numel": lambda r: int(r.get("numel") or 0),
        "zeros": lambda r: int(r.get("zeros") or 0) / numel(r),
        "subnormal": lambda r: int(r.get("subnormal") or 0) / numel(r),
        "near-zero": lambda r: int(r.get("near_zero") or 0) / numel(r),
        "nan": lambda r: int(r.get("nan") or 0) + int(r.get("posinf") or 0) + int(r.get("neginf") or 0),
        "severity": lambda r: RANK.get(str(r.get("severity")), 0),
    }
    return sorted(rows, key=keys[key], reverse=True)  # stable: ties keep file order


def scan_table(rows: Sequence[dict[str, Any]], style: Style) -> list[str]:
    """The tensor table; a "binades" column after "|x| range" when the rows have histograms."""
    with_binades = any("histogram" in r for r in rows)
    headers = ["name", "dtype", "shape", "numel", "zero %", "subnormal", "near-zero", "nan/inf",
               "|x| range", *(["binades"] if with_binades else []), "mean", "std", "verdict"]
    cells, colors = [], []
    for r in rows:
        n = int(r["numel"])
        nonfinite = int(r["nan"]) + int(r["posinf"]) + int(r["neginf"])
        lo = r["min_abs_nonzero"]
        lo_text = fmt_num(lo) if lo is not None and math.isfinite(float(lo)) else "0"
        rng = "-" if n == 0 else f"{lo_text} .. {fmt_num(r['max_abs'])}"
        cells.append([
            short_name(str(r["name"])),
            str(r["dtype"]),
            fmt_shape(r["shape"]),
            fmt_count(n),
            fmt_percent(int(r["zeros"]), n),
            fmt_count(int(r["subnormal"])),
            fmt_count(int(r["near_zero"])),
            f"{fmt_count(int(r['nan']))}/{fmt_count(int(r['posinf']) + int(r['neginf']))}" if nonfinite else "0",
            rng,
            *([fmt_binades(r["histogram"], str(r["dtype"])) if "histogram" in r else "-"] if with_binades else []),
            fmt_num(r["mean"]),
            fmt_num(r["std"]),
            str(r["verdict"]),
        ])
        sev = str(r["severity"])
        colors.append(sev if sev != "ok" else None)
    right = {3, 4, 5, 6, 7, headers.index("mean"), headers.index("std")}
    return render_table(headers, cells, right=right, colors=colors, style=style, color_col=len(headers) - 1)


def group_table(groups: Sequence[dict[str, Any]], style: Style) -> list[str]:
    """A scan's groups (scan_groups), a line each; a "skipped" column only when some group has one."""
    with_skipped = any(g["skipped"] for g in groups)
    headers = ["group", "tensors", *(["skipped"] if with_skipped else []), "elements", "zero %", "subnormal",
               "near-zero", "nan/inf", "findings", "worst", "worst tensor"]
    cells, colors = [], []
    for g in groups:
        nonfinite = g["nan"] + g["inf"]
        cells.append([
            short_name(group_label(g["group"])),
            str(g["tensors"]),
            *([str(g["skipped"])] if with_skipped else []),
            fmt_count(g["elements"]),
            fmt_percent(g["zeros"], g["elements"]),
            fmt_count(g["subnormal"]),
            fmt_count(g["near_zero"]),
            f"{fmt_count(g['nan'])}/{fmt_count(g['inf'])}" if nonfinite else "0",
            str(g["findings"]),
            g["severity"],
            worst_cell(g),
        ])
        colors.append(g["severity"] if g["severity"] != "ok" else None)
    first_number, severity_col = 1, len(headers) - 2
    right = set(range(first_number, severity_col))
    return render_table(headers, cells, right=right, colors=colors, style=style, color_col=severity_col)


def skipped_severity(entry: dict[str, Any]) -> str:
    return str(entry.get("severity") or "info")


def count_findings(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    counts = {"info": 0, "warning": 0, "error": 0}
    for r in rows:
        sev = str(r.get("severity", "ok"))
        if sev in counts:
            counts[sev] += 1
    return counts


def worst_of(severities: Sequence[str]) -> str:
    return max(severities, key=lambda s: RANK.get(s, 0), default="ok")


def scan_worst(files: Sequence[Any]) -> str:
    """The worst severity of the scanned tensors and of the skipped ones."""
    return worst_of([str(r.get("severity", "ok")) for f in files for r in f.rows]
                    + [skipped_severity(s) for f in files for s in f.skipped])


def findings_words(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    if not total:
        return "no findings"
    # "info" is a mass noun and takes no plural s: "2 info", "2 warnings".
    parts = [count_noun(counts[s], s, "info" if s == "info" else None)
             for s in ("error", "warning", "info") if counts[s]]
    return f"{count_noun(total, 'finding')} ({', '.join(parts)})"


def shard_files(f: Any) -> set[str]:
    """The files of a checkpoint its rows and skipped entries name (none for a one-file checkpoint)."""
    names: set[str] = set()
    for r in [*f.rows, *f.skipped]:
        names.update(n for n in str(r.get("shard") or "").split(",") if n)
    return names


def file_groups(f: Any, by: str, only_findings: bool) -> list[dict[str, Any]]:
    groups = scan_groups(f.rows, by, skipped=f.skipped, default_shard=Path(f.path).name)
    return [g for g in groups if g["severity"] != "ok"] if only_findings else groups


def cmd_scan(args: argparse.Namespace, out: TextIO) -> int:
    from zeroscan.checkpoint import scan_checkpoint
    from zeroscan.checkpoint.paths import expand_paths

    check_limit(args.limit)
    if args.diff:
        return cmd_diff(args, out)
    if args.trained_from_first:
        raise UsageError("--trained-from-first says how the two files of --diff relate; add --diff")
    if args.target_format and not (args.histogram and args.plot):
        raise UsageError(f"--target-format {args.target_format} marks its range on the histogram plot; "
                         "add --histogram and --plot FILE")
    plot_path = checked_plot_path(args.plot) if args.plot else None
    style = Style(out)
    files = []
    for path in expand_paths(args.paths):
        progress = Progress(f"scanning {Path(path).name or path}", enabled=args.progress)
        try:
            result = scan_checkpoint(path, tol=args.tol, mostly_zero=args.mostly_zero, progress=progress,
                                     histogram=args.histogram)
        finally:
            progress.close()
        files.append(result)

    all_rows = [r for f in files for r in f.rows]
    counts = count_findings(all_rows)
    worst = scan_worst(files)
    if plot_path:
        plot_path = plot_files(files, plot_path, args)

    if args.json:
        doc = {
            "zeroscan": version(),
            "command": "scan",
            "tol": args.tol,
            "files": [scan_file_json(f, args) for f in files],
            "summary": {
                "files": len(files),
                "tensors": len(all_rows),
                "skipped": sum(len(f.skipped) for f in files),
                "findings": counts,
                "worst": worst,
            },
        }
        json.dump(json_safe(doc), out, indent=1)
        out.write("\n")
    else:
        for i, f in enumerate(files):
            if i:
                out.write("\n")
            write_scan_text(f, args, style, out)
        if plot_path:
            out.write(f"plot written to {printable(plot_path)}\n")
    return exit_status(worst, args.fail_on)


def plot_files(files: Sequence[Any], path: str, args: argparse.Namespace) -> str:
    """Draws the scanned checkpoints to `path` (--plot): their histograms
    with --histogram, else the scan's bars; returns the file written."""
    from zeroscan.plot import plot_scan
    from zeroscan.plot_histograms import histogram_of_row, plot_histograms

    rows = [dict(r, name=f"{Path(f.path).name}:{r['name']}") if len(files) > 1 else r for f in files for r in f.rows]
    title = Path(files[0].path).name if len(files) == 1 else f"{len(files)} checkpoints"
    if not args.histogram:
        return plot_scan(rows, path, title=title)
    items = [(str(r["name"]), histogram_of_row(r)) for r in rows]
    return plot_histograms(items, path, target=args.target_format, title=title)


def scan_file_json(f: Any, args: argparse.Namespace) -> dict[str, Any]:
    doc = {
        "path": f.path,
        "format": f.format,
        "shards": f.shards,
        "nbytes": f.nbytes,
        "tensors": sort_rows(shown(f.rows, args.only_findings), row_order(args)),
        "skipped": f.skipped,
    }
    if args.group_by:
        doc["groups"] = file_groups(f, args.group_by, args.only_findings)
    return doc


def shown(rows: list[dict[str, Any]], only_findings: bool) -> list[dict[str, Any]]:
    return [r for r in rows if r["severity"] != "ok"] if only_findings else rows


def write_scan_text(f: Any, args: argparse.Namespace, style: Style, out: TextIO) -> None:
    """One checkpoint: its header line; the tensor table, or with --group-by the
    group table; its findings and skipped tensors; a line of counts. Tables and
    lists stop at --limit, with a line saying how many more there are."""
    shards = shard_files(f)
    size = f"{f.format}, {count_noun(len(f.rows) + len(f.skipped), 'tensor')}, {fmt_bytes(f.nbytes)}"
    if len(shards) > 1:
        size += f", {count_noun(len(shards), 'shard file')}"
    out.write(style(printable(f.path), "bold") + f"  ({size})\n")

    if args.group_by:
        items, table, noun = file_groups(f, args.group_by, args.only_findings), group_table, "group"
    else:
        items, table, noun = sort_rows(shown(f.rows, args.only_findings), row_order(args)), scan_table, "tensor"
    lines, hidden = limited(items, args.limit)
    if lines:
        out.write("\n".join(table(lines, style)) + "\n")
    elif args.only_findings:
        out.write(f"no {noun} has a finding\n")
    if hidden:
        out.write(more_line(hidden, noun))

    findings, hidden = limited(worst_first(r for r in f.rows if r["severity"] != "ok"), args.limit)
    if findings:
        out.write("\nfindings:\n")
        for r in findings:
            what = printable(f"{r['name']}: {r['verdict']}: {r['reason']}")
            out.write(f"  {style(r['severity'].upper(), r['severity'])} {what}\n")
        if hidden:
            out.write("  " + more_line(hidden, "finding"))
    judged = [dict(s, severity=skipped_severity(s)) for s in f.skipped]
    skipped, hidden = limited(worst_first(judged), args.limit)
    for s in skipped:
        sev = s["severity"]
        mark = "" if sev == "info" else style(sev.upper(), sev) + " "
        dtype = f" ({s['dtype']})" if s["dtype"] else ""  # none for a tensor its shard lacks
        out.write(f"  {mark}skipped " + printable(f"{s['name']}{dtype}: {s['reason']}") + "\n")
    if hidden:
        out.write("  " + more_line(hidden, "skipped tensor"))

    counts = count_findings(f.rows)
    line = f"{count_noun(len(f.rows), 'tensor')} scanned, {findings_words(counts)}"
    if f.skipped:
        bad = count_findings(judged)
        worse = [count_noun(bad[s], s) for s in ("error", "warning") if bad[s]]
        line += f", {len(f.skipped)} skipped" + (f" ({', '.join(worse)})" if worse else "")
    out.write(f"\n{line}\n")


def exit_status(worst: str, fail_on: str) -> int:
    if fail_on == "none":
        return EXIT_OK
    return EXIT_FINDINGS if RANK.get(worst, 0) >= RANK[fail_on] else EXIT_OK


# --- diff ----------------------------------------------------------------------------


def two_checkpoints(paths: Sequence[str]) -> tuple[str, str]:
    """The two checkpoints --diff compares, from PATHs that may be folders or globs."""
    from zeroscan.checkpoint.paths import expand_paths

    found = expand_paths(paths)
    if len(found) != 2:
        named = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise UsageError(f"--diff compares exactly two checkpoints; the paths given name {len(found)}: {named}")
    return found[0], found[1]


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
        cells.append([short_name(group_label(g["group"])), str(g["tensors"]), *(str(g[s]) for s in DIFF_STATUSES),
                      str(g["became_nan"]), str(g["became_zero"]), g["severity"], worst_cell(g)])
        colors.append(g["severity"] if g["severity"] != "ok" else None)
    severity_col = len(headers) - 2
    return render_table(headers, cells, right=set(range(1, severity_col)), colors=colors, style=style,
                        color_col=severity_col)


def cmd_diff(args: argparse.Namespace, out: TextIO) -> int:
    from zeroscan.checkpoint.diff import diff_checkpoints

    if args.plot:
        raise UsageError("--plot draws a scan; leave out --diff to plot a checkpoint")
    if args.histogram or args.target_format:
        raise UsageError("--histogram counts a scan's magnitudes; leave out --diff to count them")
    a, b = two_checkpoints(args.paths)
    progress = Progress(f"comparing {Path(a).name or a}", enabled=args.progress)
    try:
        rows = diff_checkpoints(a, b, trained_from_first=args.trained_from_first, progress=progress)
    finally:
        progress.close()
    summary: dict[str, Any] = {s: sum(1 for r in rows if r["status"] == s) for s in DIFF_STATUSES}
    summary["became_nan"] = sum(1 for r in rows if r.get("became") == "nan")
    summary["became_zero"] = sum(1 for r in rows if r.get("became") == "zero")
    summary["worst"] = worst_of([str(r["severity"]) for r in rows])
    shown_rows = sort_diff_rows([r for r in rows if r["severity"] != "ok"] if args.only_findings else rows,
                                row_order(args))
    groups = None
    if args.group_by:
        groups = diff_group_rows(rows, a, b, args.group_by)
        if args.only_findings:
            groups = [g for g in groups if g["severity"] != "ok"]
    if args.json:
        doc = {"zeroscan": version(), "command": "diff", "a": a, "b": b,
               "trained_from_first": args.trained_from_first, "tensors": shown_rows}
        if groups is not None:
            doc["groups"] = groups
        doc["summary"] = summary
        json.dump(json_safe(doc), out, indent=1)
        out.write("\n")
        return exit_status(summary["worst"], args.fail_on)

    style = Style(out)
    out.write(style(printable(f"{a} -> {b}"), "bold") + "\n")
    if groups is not None:
        part, hidden = limited(groups, args.limit)
        if part:
            out.write("\n".join(diff_group_table(part, style)) + "\n")
        noun = "group"
    else:
        headers = ["name", "dtype", "shape", "status", "changed", "max |a-b|", "note"]
        part, hidden = limited(shown_rows, args.limit)
        cells, colors = [], []
        for r in part:
            changed = "-" if "changed" not in r else fmt_percent(int(r["changed"]), int(r["numel"]))
            cells.append([short_name(r["name"]), r["dtype"], fmt_shape(r["shape"]), r["status"], changed,
                          fmt_num(r.get("max_abs_diff")), r["reason"]])
            colors.append(r["severity"] if r["severity"] != "ok" else None)
        if cells:
            out.write("\n".join(render_table(headers, cells, {4, 5}, colors, style, color_col=3)) + "\n")
        noun = "tensor"
    if hidden:
        out.write(more_line(hidden, noun))
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
    return exit_status(summary["worst"], args.fail_on)


# --- demo ------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from zeroscan.demo import run_demo

    return run_demo(out=out, plot=checked_plot_path(args.plot) if args.plot else None)


def checked_plot_path(path: str) -> str:
    """The file `--plot path` will write (.png appended when it has no
    extension), checked before any work: matplotlib is installed, writes that
    format, and the folder exists and can be written. UsageError otherwise."""
    from zeroscan.plot import plot_destination

    try:
        target, _ = plot_destination(path)
    except ValueError as e:
        raise UsageError(f"--plot {e}") from None
    folder = os.path.dirname(target) or "."
    problem = (
        "is a directory" if os.path.isdir(target)
        else "no such directory" if not os.path.exists(folder)
        else "not a directory" if not os.path.isdir(folder)
        else "directory not writable" if not os.access(folder, os.W_OK)
        else None
    )  # fmt: skip
    if problem == "is a directory":
        raise UsageError(f"--plot {printable(target)}: is a directory")
    if problem:
        raise UsageError(f"--plot {printable(target)}: {printable(folder)}: {problem}")
    return target


# --- the parser and main ------------------------------------------------------------------


def version() -> str:
    from zeroscan import __version__

    return __version__


def number(text: str, valid: Callable[[float], bool], expected: str) -> float:
    """A command-line number that `valid` accepts; argparse names the option
    and shows `expected` when it does not."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not valid(v):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return v


def probability(text: str) -> float:
    return number(text, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")


def tolerance(text: str) -> float:
    return number(text, lambda v: v >= 0.0, "a non-negative number") + 0.0  # -0 is 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroscan",
        description="Is this tensor truly zero, underflowed, non-finite, or healthy? "
        "Scan checkpoints, tour the verdicts.",
        epilog="exit status: 0 ok, 1 a finding at or above --fail-on (default error), "
        "2 an unreadable file or a usage error, 130 interrupted (Ctrl-C)",
    )
    parser.add_argument("--version", action="version", version=f"zeroscan {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    scan = sub.add_parser(
        "scan",
        help="scan checkpoints (files, model folders, globs) tensor by tensor",
        description="Scan every tensor of each checkpoint and diagnose it. Formats: torch.save files (loaded "
        "with weights_only=True and memory-mapped), .safetensors files, sharded model folders or their "
        "index file (model.safetensors.index.json), and torch.distributed.checkpoint folders. A PATH may "
        "be a file, a folder or a glob: a folder that is one checkpoint is scanned as one, any other "
        "folder is each checkpoint in it.",
    )
    scan.add_argument("paths", nargs="+", metavar="PATH",
                      help="a checkpoint file, a checkpoint folder, a folder of checkpoints or a glob")
    scan.add_argument("--sort", choices=SORT_KEYS, default=None,
                      help="row order: worst first (the default in tables: severity, then NaN/Inf count, then "
                           "zero fraction), file order (the default with --json), name, or the largest first "
                           "by numel, zero fraction, subnormal/near-zero fraction, NaN/Inf count or severity "
                           "(with --diff: worst, order, name, numel or severity)")
    scan.add_argument("--limit", type=int, default=DEFAULT_LIMIT, metavar="N",
                      help=f"show the first N rows of each table and list (default {DEFAULT_LIMIT}; 0 shows "
                           "all); --json always has every row")
    scan.add_argument("--group-by", choices=GROUP_KEYS, default=None,
                      help="sum the tensors up per layer (name up to its first number: model.layers.17), module "
                           "(name without its last part) or shard file, worst group first; the group table "
                           "replaces the tensor table, and --json adds \"groups\"")
    scan.add_argument("--only-findings", action="store_true", help="list only tensors with a finding")
    scan.add_argument("--json", action="store_true", help="write one JSON object to stdout instead of tables")
    scan.add_argument("--fail-on", choices=("info", "warning", "error", "none"), default="error",
                      help="exit 1 when a finding at or above this severity exists (default: error, so a "
                           "NaN or Inf fails; none: never)")
    scan.add_argument("--diff", action="store_true",
                      help="compare two checkpoints: changed, bit-identical, added and removed tensors; "
                           "a tensor that became NaN/Inf is an error, one that became all zero a warning "
                           "(a floating-point tensor left bit-identical is 'unchanged', an info)")
    scan.add_argument("--trained-from-first", action="store_true",
                      help="with --diff: the second file was trained from the first, so a floating-point "
                           "tensor left bit-identical while others changed was never updated (a warning)")
    scan.add_argument("--plot", metavar="PNG", help="also draw the scan to this image, in the format its "
                      "extension names (.png when it has none; needs matplotlib)")
    scan.add_argument("--histogram", action="store_true",
                      help="also count each tensor's |x| by binade (2^e <= |x| < 2^(e+1)) in the same pass: a "
                           "'binades' column (all values' range, and where 99%% of them lie), \"histogram\" in "
                           "--json rows, and the histograms as the --plot")
    scan.add_argument("--target-format", choices=("e4m3", "e5m2", "e2m1"), default=None,
                      help="with --histogram --plot: also mark this fp8/fp4 format's smallest subnormal, "
                           "smallest normal and largest value")
    scan.add_argument("--tol", type=tolerance, default=None,
                      help="near-zero threshold (default: each dtype's machine epsilon)")
    scan.add_argument("--mostly-zero", type=probability, default=0.9,
                      help="zero fraction from which a tensor is 'mostly zero' (default 0.9)")
    scan.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="progress on stderr, one bar per checkpoint (default: for large checkpoints only)")
    scan.set_defaults(run=cmd_scan)

    demo = sub.add_parser("demo", help="a short tour: every verdict on built-in examples, in plain words")
    demo.add_argument("--plot", metavar="PNG", help="also draw the demo model's gradient flow (needs matplotlib)")
    demo.set_defaults(run=cmd_demo)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line `argv` (default sys.argv[1:]) and returns the
    exit status. Ctrl-C, pressed any number of times, ends it with one line
    "zeroscan: interrupted" and EXIT_INTERRUPTED."""
    for stream in (sys.stdout, sys.stderr):
        fit_to_console(stream)  # first: --help and usage errors print too
    previous = stop_on_first_interrupt()
    interrupted = False
    try:
        return run_command(argv)
    except KeyboardInterrupt:
        interrupted = True
        say("zeroscan: interrupted")
        return EXIT_INTERRUPTED
    finally:
        # A program that calls main(argv) gets its own Ctrl-C back. The
        # process's command line (argv None) stays deaf to it once
        # interrupted, so a later press cannot break the exit with a traceback.
        if previous is not None and not (interrupted and argv is None):
            signal.signal(signal.SIGINT, previous)


def stop_on_first_interrupt() -> Callable[[int, FrameType | None], Any] | None:
    """Makes the first SIGINT raise KeyboardInterrupt and every later one do
    nothing: presses that follow it (a user pressing again, a terminal
    sending two) would otherwise land in the cleanup, the "interrupted" line
    or the exit, and print a traceback. Returns the handler it replaced;
    None where it installs none: off the main thread, or where SIGINT is
    already ignored or handled the program's own way."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return None
    stopping = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:  # a press that reached Python before SIG_IGN took over
            return
        stopping = True
        # Ignored by the OS from here on, through the interpreter's exit
        # (which would reset a Python handler to the default and die of SIGINT).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    return previous


def run_command(argv: Sequence[str] | None) -> int:
    """main() without its Ctrl-C handling: parses `argv` and runs its command."""
    if sys.stdout is None:  # `zeroscan ... >&-`: no report can be written, so do no work
        return fail("stdout is closed: nothing to write the report to")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return int(e.code) if isinstance(e.code, int) else EXIT_ERROR
    if args.command is None:
        parser.print_help(sys.stderr)  # argparse writes nothing when stderr is closed
        return EXIT_ERROR
    from zeroscan.checkpoint import CheckpointError

    out = sys.stdout
    try:
        return int(args.run(args, out))
    except (CheckpointError, UsageError) as e:
        return fail(str(e))
    except ImportError as e:  # an optional package (matplotlib) is missing
        return fail(str(e))
    except OSError as e:
        if isinstance(e, BrokenPipeError):  # `zeroscan scan ... | head`: stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
        where = f"{e.filename}: " if e.filename else ""
        return fail(f"{where}{e.strerror or e}")
    except Exception as e:
        if os.environ.get("ZEROSCAN_DEBUG"):
            raise
        lines = str(e).strip().splitlines()
        return fail(f"internal error: {type(e).__name__}: {lines[0] if lines else ''} "
                    "(set ZEROSCAN_DEBUG=1 for the traceback)")


def fail(message: str) -> int:
    say(f"zeroscan: error: {printable(message)}")
    return EXIT_ERROR


def say(line: str) -> None:
    """One line on stderr, unless stderr is closed (`2>&-`)."""
    if sys.stderr is not None:
        sys.stderr.write(line + "\n")
