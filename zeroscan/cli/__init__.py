"""The `zeroscan` command: scan checkpoints, compare two, tour the verdicts.

    zeroscan scan PATH...            a table per checkpoint
    zeroscan scan --histogram PATH   ... and where each tensor's |x| lie, binade by binade
    zeroscan diff a.pt b.pt          which tensors changed, which stayed bit-identical
    zeroscan demo                    a short tour of every verdict on built-in examples

`zeroscan scan A B --diff` still does what `zeroscan diff A B` does, with the
same output and exit status.

A PATH is a checkpoint file (torch.save, .safetensors), a checkpoint folder
(a sharded model with or without its index file, a torch.distributed.checkpoint
folder), a shard index file, a plain folder of checkpoints or a glob
(zeroscan.checkpoint.paths.expand_paths); each checkpoint it names is scanned
on its own, with one progress bar over all its files. `diff` takes exactly
two PATHs, A and B, each naming one checkpoint, and the options of a
report (--json, --group-by, --limit, --only-findings, --fail-on, --progress;
--sort worst, order, name, numel or severity) with --trained-from-first.

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
--histogram adds a "binades" column (zeroscan.cli.cells.fmt_binades):
"2^-24..2^3, 99% in 2^-8..2^1" says every nonzero finite |x| is in
[2^-24, 2^3) and at least 99% of them in [2^-8, 2^1). --plot then draws the
histograms (zeroscan.histogram_plot.plot_histograms) instead of the scan's bars, with
--target-format's range marked.

"shard" is the file holding the tensor, relative to the checkpoint's folder
("" for a one-file checkpoint; several names joined by "," for a DCP tensor
stored in pieces). A skipped entry's "severity" is "info" where it is absent;
"error" for a tensor an index lists but its shard lacks. The summary's
"findings" counts scanned tensors; its "worst" includes the skipped entries'
severities. Groups come worst first; a shard group of a one-file checkpoint
is named after the file.

`diff --json` (or `scan --diff --json`):

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

# The modules: run (main, and the command each name runs) -> scan, diff ->
# parser, progress -> tables -> console, cells, exits; none imports one
# before it in that list, nor one beside it (scan and diff import neither
# the other).
from zeroscan.cli.exits import EXIT_ERROR, EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_OK, UsageError
from zeroscan.cli.parser import build_parser
from zeroscan.cli.run import main

__all__ = ["EXIT_ERROR", "EXIT_FINDINGS", "EXIT_INTERRUPTED", "EXIT_OK", "UsageError", "build_parser", "main"]
