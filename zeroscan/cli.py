"""The `zeroscan` command: scan checkpoints, tour the verdicts.

    zeroscan scan PATH...            a table per checkpoint (torch.save or .safetensors)
    zeroscan scan a.pt b.pt --diff   which tensors changed, which stayed bit-identical
    zeroscan demo                    a short tour of every verdict on built-in examples

Exit status: 0 when all went well; 1 when a finding at or above `--fail-on`
exists (default error, so a NaN fails a CI step as a linter's error does;
`--fail-on none` never fails); 2 for a usage error or a file that cannot be
read (one line on stderr, never a traceback); 130 when interrupted.

Each tensor is judged in its role (zeroscan.roles): a zero bias, a
normalisation layer's ones, BatchNorm's running statistics are OK; an
all-zero weight matrix or kernel is a warning; NaN/Inf an error in any role.

`scan --json` writes one JSON object to stdout (floats that are NaN or
infinite are written as null; the counts say which):

    {"zeroscan": VERSION, "command": "scan", "tol": float|null,
     "files": [{"path", "format", "nbytes", "tensors": [ROW...],
                "skipped": [{"name", "dtype", "shape", "reason"}]}],
     "summary": {"files", "tensors", "skipped", "findings": {"info", "warning", "error"}, "worst"}}
    ROW: {"name", "dtype", "shape", "numel", "zeros", "zero_fraction", "subnormal", "near_zero",
          "nan", "posinf", "neginf", "negative", "min_abs", "min_abs_nonzero", "max_abs",
          "mean", "std", "norm", "verdict", "role", "severity", "reason"}

and with `--diff`:

    {"zeroscan": VERSION, "command": "diff", "a", "b", "trained_from_first": bool,
     "tensors": [{"name", "dtype", "shape", "numel", "status", "severity", "reason",
                  "changed", "changed_fraction", "max_abs_diff"}],   # the last three when compared
     "summary": {"changed", "identical", "added", "removed", "reshaped", "retyped", "unread", "worst"}}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from zeroscan.cli_format import (
    Progress,
    Style,
    fmt_bytes,
    fmt_count,
    fmt_num,
    fmt_percent,
    fmt_shape,
    printable,
    render_table,
)
from zeroscan.report_data import json_safe
from zeroscan.words import count_noun, is_are

SEVERITIES = ("ok", "info", "warning", "error")
RANK = {s: i for i, s in enumerate(SEVERITIES)}
SORT_KEYS = ("order", "name", "numel", "zeros", "subnormal", "near-zero", "nan", "severity")
EXIT_OK, EXIT_FINDINGS, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A bad combination of arguments; str() is one line."""


# --- scan ------------------------------------------------------------------------


def sort_rows(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows by `key`: name ascending, file order, or the largest first."""
    if key == "order":
        return rows
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
    headers = ["name", "dtype", "shape", "numel", "zero %", "subnormal", "near-zero", "nan/inf",
               "|x| range", "mean", "std", "verdict"]
    cells, colors = [], []
    for r in rows:
        n = int(r["numel"])
        nonfinite = int(r["nan"]) + int(r["posinf"]) + int(r["neginf"])
        lo = r["min_abs_nonzero"]
        lo_text = fmt_num(lo) if lo is not None and math.isfinite(float(lo)) else "0"
        rng = "-" if n == 0 else f"{lo_text} .. {fmt_num(r['max_abs'])}"
        name = str(r["name"])
        cells.append([
            name if len(name) <= 60 else "…" + name[-59:],
            str(r["dtype"]),
            fmt_shape(r["shape"]),
            fmt_count(n),
            fmt_percent(int(r["zeros"]), n),
            fmt_count(int(r["subnormal"])),
            fmt_count(int(r["near_zero"])),
            f"{fmt_count(int(r['nan']))}/{fmt_count(int(r['posinf']) + int(r['neginf']))}" if nonfinite else "0",
            rng,
            fmt_num(r["mean"]),
            fmt_num(r["std"]),
            str(r["verdict"]),
        ])
        sev = str(r["severity"])
        colors.append(sev if sev != "ok" else None)
    return render_table(headers, cells, right={3, 4, 5, 6, 7, 9, 10}, colors=colors, style=style, color_col=11)


def count_findings(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    counts = {"info": 0, "warning": 0, "error": 0}
    for r in rows:
        sev = str(r.get("severity", "ok"))
        if sev in counts:
            counts[sev] += 1
    return counts


def worst_of(rows: Sequence[dict[str, Any]]) -> str:
    return max((str(r.get("severity", "ok")) for r in rows), key=lambda s: RANK.get(s, 0), default="ok")


def findings_words(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    if not total:
        return "no findings"
    # "info" is a mass noun and takes no plural s: "2 info", "2 warnings".
    parts = [count_noun(counts[s], s, "info" if s == "info" else None)
             for s in ("error", "warning", "info") if counts[s]]
    return f"{count_noun(total, 'finding')} ({', '.join(parts)})"


def cmd_scan(args: argparse.Namespace, out: TextIO) -> int:
    from zeroscan.checkpoint import scan_checkpoint

    if args.diff:
        return cmd_diff(args, out)
    if args.trained_from_first:
        raise UsageError("--trained-from-first says how the two files of --diff relate; add --diff")
    plot_path = checked_plot_path(args.plot) if args.plot else None
    style = Style(out)
    files = []
    for path in args.paths:
        size = Path(path).stat().st_size if Path(path).is_file() else 0
        progress = Progress(f"scanning {Path(path).name}", size, args.progress)
        try:
            result = scan_checkpoint(path, tol=args.tol, mostly_zero=args.mostly_zero, progress=progress)
        finally:
            progress.close()
        files.append(result)

    all_rows = [r for f in files for r in f.rows]
    counts = count_findings(all_rows)
    worst = worst_of(all_rows)
    if plot_path:
        from zeroscan.plot import plot_scan

        plot_rows = [
            dict(r, name=f"{Path(f.path).name}:{r['name']}") if len(files) > 1 else r for f in files for r in f.rows
        ]
        title = Path(files[0].path).name if len(files) == 1 else f"{len(files)} checkpoints"
        plot_path = plot_scan(plot_rows, plot_path, title=title)

    if args.json:
        doc = {
            "zeroscan": version(),
            "command": "scan",
            "tol": args.tol,
            "files": [
                {
                    "path": f.path,
                    "format": f.format,
                    "nbytes": f.nbytes,
                    "tensors": sort_rows(shown(f.rows, args.only_findings), args.sort),
                    "skipped": f.skipped,
                }
                for f in files
            ],
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


def shown(rows: list[dict[str, Any]], only_findings: bool) -> list[dict[str, Any]]:
    return [r for r in rows if r["severity"] != "ok"] if only_findings else rows


def write_scan_text(f: Any, args: argparse.Namespace, style: Style, out: TextIO) -> None:
    rows = sort_rows(shown(f.rows, args.only_findings), args.sort)
    nbytes = f.nbytes
    counts = count_findings(f.rows)
    size = f"{f.format}, {count_noun(len(f.rows), 'tensor')}, {fmt_bytes(nbytes)}"
    out.write(style(printable(f.path), "bold") + f"  ({size})\n")
    if rows:
        out.write("\n".join(scan_table(rows, style)) + "\n")
    elif args.only_findings:
        out.write("no tensor has a finding\n")
    findings = sorted((r for r in f.rows if r["severity"] != "ok"), key=lambda r: -RANK[r["severity"]])
    if findings:
        out.write("\nfindings:\n")
        for r in findings:
            what = printable(f"{r['name']}: {r['verdict']}: {r['reason']}")
            out.write(f"  {style(r['severity'].upper(), r['severity'])} {what}\n")
    for s in f.skipped:
        out.write("  skipped " + printable(f"{s['name']} ({s['dtype']}): {s['reason']}") + "\n")
    out.write(f"\n{count_noun(len(f.rows), 'tensor')} scanned, {findings_words(counts)}\n")


def exit_status(worst: str, fail_on: str) -> int:
    if fail_on == "none":
        return EXIT_OK
    return EXIT_FINDINGS if RANK.get(worst, 0) >= RANK[fail_on] else EXIT_OK


# --- diff ----------------------------------------------------------------------------

DIFF_STATUSES = ("changed", "identical", "added", "removed", "reshaped", "retyped", "unread")


def cmd_diff(args: argparse.Namespace, out: TextIO) -> int:
    from zeroscan.checkpoint import open_checkpoint
    from zeroscan.checkpoint_diff import diff_checkpoints

    if len(args.paths) != 2:
        raise UsageError(f"--diff compares exactly two checkpoints, got {len(args.paths)} paths")
    if args.plot:
        raise UsageError("--plot draws a scan; leave out --diff to plot a checkpoint")
    a, b = args.paths
    with open_checkpoint(a) as ca:
        size = ca.nbytes
    progress = Progress(f"comparing {Path(a).name}", size, args.progress)
    try:
        rows = diff_checkpoints(a, b, trained_from_first=args.trained_from_first, progress=progress)
    finally:
        progress.close()
    summary: dict[str, Any] = {s: sum(1 for r in rows if r["status"] == s) for s in DIFF_STATUSES}
    summary["worst"] = worst_of(rows)
    order = {"severity": lambda r: -RANK[r["severity"]], "name": lambda r: r["name"],
             "numel": lambda r: -int(r["numel"])}
    shown_rows = [r for r in rows if r["severity"] != "ok"] if args.only_findings else rows
    if args.sort in order:
        shown_rows = sorted(shown_rows, key=order[args.sort])
    if args.json:
        doc = {"zeroscan": version(), "command": "diff", "a": a, "b": b,
               "trained_from_first": args.trained_from_first, "tensors": shown_rows, "summary": summary}
        json.dump(json_safe(doc), out, indent=1)
        out.write("\n")
    else:
        style = Style(out)
        out.write(style(printable(f"{a} -> {b}"), "bold") + "\n")
        headers = ["name", "dtype", "shape", "status", "changed", "max |a-b|", "note"]
        cells, colors = [], []
        for r in shown_rows:
            changed = "-" if "changed" not in r else fmt_percent(int(r["changed"]), int(r["numel"]))
            cells.append([r["name"], r["dtype"], fmt_shape(r["shape"]), r["status"], changed,
                          fmt_num(r.get("max_abs_diff")), r["reason"]])
            colors.append(r["severity"] if r["severity"] != "ok" else None)
        if cells:
            out.write("\n".join(render_table(headers, cells, {4, 5}, colors, style, color_col=3)) + "\n")
        words = ", ".join(f"{summary[s]} {s}" for s in DIFF_STATUSES if summary[s])
        out.write(f"\n{count_noun(len(rows), 'name')}: {words or 'none'}\n")
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
        "2 an unreadable file or a usage error",
    )
    parser.add_argument("--version", action="version", version=f"zeroscan {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    scan = sub.add_parser(
        "scan",
        help="scan torch.save / .safetensors checkpoints tensor by tensor",
        description="Scan every tensor of each checkpoint (torch.save files loaded with weights_only=True "
        "and memory-mapped; .safetensors files parsed and mapped tensor by tensor) and diagnose it.",
    )
    scan.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint files")
    scan.add_argument("--sort", choices=SORT_KEYS, default="order",
                      help="row order: file order (default), name, or the largest first by numel, zero "
                           "fraction, subnormal/near-zero fraction, NaN/Inf count or severity "
                           "(with --diff: order, name, numel or severity)")
    scan.add_argument("--only-findings", action="store_true", help="list only tensors with a finding")
    scan.add_argument("--json", action="store_true", help="write one JSON object to stdout instead of tables")
    scan.add_argument("--fail-on", choices=("info", "warning", "error", "none"), default="error",
                      help="exit 1 when a finding at or above this severity exists (default: error, so a "
                           "NaN or Inf fails; none: never)")
    scan.add_argument("--diff", action="store_true",
                      help="compare two checkpoints: changed, bit-identical, added and removed tensors "
                           "(a floating-point tensor left bit-identical is 'unchanged', an info)")
    scan.add_argument("--trained-from-first", action="store_true",
                      help="with --diff: the second file was trained from the first, so a floating-point "
                           "tensor left bit-identical while others changed was never updated (a warning)")
    scan.add_argument("--plot", metavar="PNG", help="also draw the scan to this image, in the format its "
                      "extension names (.png when it has none; needs matplotlib)")
    scan.add_argument("--tol", type=tolerance, default=None,
                      help="near-zero threshold (default: each dtype's machine epsilon)")
    scan.add_argument("--mostly-zero", type=probability, default=0.9,
                      help="zero fraction from which a tensor is 'mostly zero' (default 0.9)")
    scan.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="progress on stderr (default: for large files only)")
    scan.set_defaults(run=cmd_scan)

    demo = sub.add_parser("demo", help="a short tour: every verdict on built-in examples, in plain words")
    demo.add_argument("--plot", metavar="PNG", help="also draw the demo model's gradient flow (needs matplotlib)")
    demo.set_defaults(run=cmd_demo)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line `argv` (default sys.argv[1:]) and returns the exit status."""
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
    except KeyboardInterrupt:
        say("zeroscan: interrupted")
        return EXIT_INTERRUPTED
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
