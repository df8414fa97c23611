"""The `zeroscan` command line: its one argument parser (build_parser), the
checks of its numeric arguments, and version()."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from zeroscan.cli.tables import DEFAULT_LIMIT, DIFF_SORT_KEYS, SORT_KEYS
from zeroscan.checkpoint.groups import GROUP_KEYS


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
    """The parser of every command; args.command names the one given (None when none is)."""
    parser = argparse.ArgumentParser(
        prog="zeroscan",
        description="Is this tensor truly zero, underflowed, non-finite, or healthy? "
        "Scan checkpoints, compare two, tour the verdicts.",
        epilog="exit status: 0 ok, 1 a finding at or above --fail-on (default error), "
        "2 an unreadable file or a usage error, 130 interrupted (Ctrl-C)",
    )
    parser.add_argument("--version", action="version", version=f"zeroscan {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_scan_command(sub)
    add_diff_command(sub)
    demo = sub.add_parser("demo", help="a short tour: every verdict on built-in examples, in plain words")
    demo.add_argument("--plot", metavar="PNG", help="also draw the demo model's gradient flow (needs matplotlib)")
    return parser


def add_scan_command(sub: argparse._SubParsersAction) -> None:
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
    add_report_options(scan, SORT_KEYS,
                       "row order: worst first (the default in tables: severity, then NaN/Inf count, then "
                       "zero fraction), file order (the default with --json), name, or the largest first "
                       "by numel, zero fraction, subnormal/near-zero fraction, NaN/Inf count or severity "
                       "(with --diff: worst, order, name, numel or severity)")
    scan.add_argument("--diff", action="store_true",
                      help="compare two checkpoints, as `zeroscan diff A B` does (the form to use): changed, "
                           "bit-identical, added and removed tensors; a tensor that became NaN/Inf is an error, "
                           "one that became all zero a warning (a floating-point tensor left bit-identical is "
                           "'unchanged', an info)")
    add_trained_from_first(scan, "with --diff: the second file was trained from the first")
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


def add_diff_command(sub: argparse._SubParsersAction) -> None:
    diff = sub.add_parser(
        "diff",
        usage="%(prog)s A B [options]",
        help="compare two checkpoints tensor by tensor: changed, bit-identical, added, removed, "
             "became NaN/Inf or all zero",
        description="Compare checkpoint A with checkpoint B tensor by tensor, bit for bit, matching tensors by "
        "name whatever their formats and shard layouts: changed, bit-identical, added, removed, reshaped "
        "and retyped tensors. A tensor that became NaN/Inf is an error, one that became all zero a "
        "warning, a floating-point tensor left bit-identical 'unchanged' (an info). The same as "
        "`zeroscan scan A B --diff`.",
    )
    # Any number of PATHs reach cmd_diff, which refuses other than two in one line (argparse's
    # own refusal would print its usage too).
    diff.add_argument("paths", nargs="*", metavar="A B",
                      help="the two checkpoints: each a checkpoint file, a checkpoint folder, or a folder or "
                           "glob that holds one checkpoint")
    add_report_options(diff, DIFF_SORT_KEYS,
                       "row order: worst first (the default in tables: severity, then what the tensor became, "
                       "then the fraction changed), file order (the default with --json), name, or the "
                       "largest first by numel or severity")
    add_trained_from_first(diff, "B was trained from A")
    diff.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="progress on stderr (default: for large checkpoints only)")


def add_report_options(command: argparse.ArgumentParser, sort_keys: tuple[str, ...], sort_help: str) -> None:
    """The options of a report's tables and JSON, which scan and diff share."""
    command.add_argument("--sort", choices=sort_keys, default=None, help=sort_help)
    command.add_argument("--limit", type=int, default=DEFAULT_LIMIT, metavar="N",
                         help=f"show the first N rows of each table and list (default {DEFAULT_LIMIT}; 0 shows "
                              "all); --json always has every row")
    command.add_argument("--group-by", choices=GROUP_KEYS, default=None,
                         help="sum the tensors up per layer (name up to its first number: model.layers.17), "
                              "module (name without its last part) or shard file, worst group first; the group "
                              "table replaces the tensor table, and --json adds \"groups\"")
    command.add_argument("--only-findings", action="store_true", help="list only tensors with a finding")
    command.add_argument("--json", action="store_true", help="write one JSON object to stdout instead of tables")
    command.add_argument("--fail-on", choices=("info", "warning", "error", "none"), default="error",
                         help="exit 1 when a finding at or above this severity exists (default: error, so a "
                              "NaN or Inf fails; none: never)")


def add_trained_from_first(command: argparse.ArgumentParser, trained: str) -> None:
    """--trained-from-first; `trained` says, in the command's words, which checkpoint was trained from which."""
    command.add_argument("--trained-from-first", action="store_true",
                         help=f"{trained}, so a floating-point tensor left bit-identical while others changed "
                              "was never updated (a warning)")
