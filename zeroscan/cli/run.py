"""Running a `zeroscan` command line: main() parses it, runs its command and
turns every way it can end into an exit status and at most one line on
stderr (never a traceback), Ctrl-C included."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TextIO

from zeroscan.cli.console import fit_to_console
from zeroscan.cli.diff import cmd_diff, cmd_scan_diff
from zeroscan.cli.exits import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, UsageError
from zeroscan.cli.parser import build_parser
from zeroscan.cli.scan import checked_plot_path, cmd_scan
from zeroscan.safe_text import printable


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from zeroscan.demo import run_demo

    return run_demo(out=out, plot=checked_plot_path(args.plot) if args.plot else None)


def cmd_scan_or_diff(args: argparse.Namespace, out: TextIO) -> int:
    """`zeroscan scan`: with --diff not a scan but the diff of its two checkpoints (cmd_scan_diff)."""
    return cmd_scan_diff(args, out) if args.diff else cmd_scan(args, out)


# Each command of build_parser() and what runs it.
COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
    "scan": cmd_scan_or_diff,
    "diff": cmd_diff,
    "demo": cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line `argv` (default sys.argv[1:]) and returns the
    exit status. Ctrl-C, pressed any number of times, ends it with one line
    "zeroscan: interrupted" and EXIT_INTERRUPTED. An `argv` that is not a
    sequence of str raises TypeError: that is the calling program's error,
    not a command line's."""
    check_argv(argv)
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


def check_argv(argv: object) -> None:
    """Refuses in one line an `argv` for main() that is not None or a sequence of strings."""
    if argv is None:
        return
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence):
        raise TypeError(f"zeroscan.cli.main: argv must be a list of str or None, got {type(argv).__name__}")
    for arg in argv:
        if not isinstance(arg, str):
            raise TypeError(f"zeroscan.cli.main: argv must be a list of str or None, got a list holding {type(arg).__name__}")


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
        return int(COMMANDS[args.command](args, out))
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
