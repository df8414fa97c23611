"""The scan: `zeroscan scan PATH...` judges every tensor of each checkpoint
(zeroscan.checkpoint.scan_checkpoint) and reports it as a tensor table, a
group table (--group-by) or one JSON object (--json; the schema is in
zeroscan.cli's docstring), and with --plot draws it. `scan A B --diff` is
not a scan: it runs as `zeroscan diff A B` (zeroscan.cli.diff.cmd_scan_diff)."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from zeroscan.cli.cells import fmt_binades, fmt_bytes, fmt_num, fmt_percent, fmt_shape
from zeroscan.cli.console import Style
from zeroscan.cli.exits import UsageError, exit_status
from zeroscan.cli.parser import version
from zeroscan.cli.progress import Progress
from zeroscan.cli.tables import (
    check_limit,
    group_label,
    limited,
    more_line,
    render_table,
    row_order,
    short_name,
    with_findings,
    worst_cell,
    worst_of,
)
from zeroscan.report_data import json_safe
from zeroscan.safe_text import printable
from zeroscan.checkpoint.groups import RANK, scan_groups, worst_first
from zeroscan.words import count_noun, short_count


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
            short_count(n),
            fmt_percent(int(r["zeros"]), n),
            short_count(int(r["subnormal"])),
            short_count(int(r["near_zero"])),
            f"{short_count(int(r['nan']))}/{short_count(int(r['posinf']) + int(r['neginf']))}" if nonfinite else "0",
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
            short_count(g["elements"]),
            fmt_percent(g["zeros"], g["elements"]),
            short_count(g["subnormal"]),
            short_count(g["near_zero"]),
            f"{short_count(g['nan'])}/{short_count(g['inf'])}" if nonfinite else "0",
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
    return with_findings(groups) if only_findings else groups


def cmd_scan(args: argparse.Namespace, out: TextIO) -> int:
    """`zeroscan scan PATH...`: scans each checkpoint the PATHs name and writes
    the report `args` asks for; returns the exit status --fail-on gives the
    worst finding."""
    from zeroscan.checkpoint import scan_checkpoint
    from zeroscan.checkpoint.paths import expand_paths

    check_limit(args.limit)
    if args.trained_from_first:
        raise UsageError("--trained-from-first says how the two files of --diff relate; add --diff")
    if args.target_format and not (args.histogram and args.plot):
        raise UsageError(f"--target-format {args.target_format} marks its range on the histogram plot; "
                         "add --histogram and --plot FILE")
    plot_path = checked_plot_path(args.plot) if args.plot else None
    style = Style(out)
    files = []
    for path in expand_paths(args.paths):
        progress = Progress(f"scanning {Path(path.text).name or path.text}", enabled=args.progress)
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
    from zeroscan.histogram_plot import histogram_of_row, plot_histograms

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
        "tensors": sort_rows(shown_rows(f.rows, args.only_findings), row_order(args)),
        "skipped": f.skipped,
    }
    if args.group_by:
        doc["groups"] = file_groups(f, args.group_by, args.only_findings)
    return doc


def shown_rows(rows: list[dict[str, Any]], only_findings: bool) -> list[dict[str, Any]]:
    """The rows a report shows: all, or with --only-findings those with a finding."""
    return with_findings(rows) if only_findings else rows


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
        items, table, noun = sort_rows(shown_rows(f.rows, args.only_findings), row_order(args)), scan_table, "tensor"
    lines, hidden = limited(items, args.limit)
    if lines:
        out.write("\n".join(table(lines, style)) + "\n")
    elif args.only_findings:
        out.write(f"no {noun} has a finding\n")
    if hidden:
        out.write(more_line(hidden, noun))

    findings, hidden = limited(worst_first(with_findings(f.rows)), args.limit)
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
