"""Summaries of a scan or a diff by group of tensors, and the worst-first
order, so that a checkpoint of thousands of tensors reads as a few dozen
lines: `zeroscan scan --group-by layer|module|shard`.

A tensor's group (group_of), from its dotted name or its row:

* layer: the name up to and including its first all-digit component, the
  index of a repeated block (`model.layers.17.self_attn.q_proj.weight` ->
  `model.layers.17`, `transformer.h.3.mlp.c_fc.weight` -> `transformer.h.3`).
  A name without one is outside the repeated blocks, and is grouped by its
  module (`model.embed_tokens.weight` -> `model.embed_tokens`,
  `lm_head.weight` -> `lm_head`);
* module: the name without its last component (the parameter's own name);
  a name of one component (a bare tensor at the top level) is in group "";
* shard: the file holding the tensor (row["shard"]); a one-file
  checkpoint's rows have none, and the caller names that file.

Everything here is a pure function of scan rows (zeroscan.checkpoint.scan.scan_row)
or diff rows (zeroscan.checkpoint.diff.diff_checkpoints): dicts in, dicts out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SEVERITIES = ("ok", "info", "warning", "error")
RANK = {s: i for i, s in enumerate(SEVERITIES)}
GROUP_KEYS = ("layer", "module", "shard")
DIFF_STATUSES = ("changed", "identical", "added", "removed", "reshaped", "retyped", "unread")
# How bad what a tensor became in a diff is: NaN/Inf before all zero before nothing.
BECAME_RANK = {"nan": 2, "zero": 1, "": 0}

Row = Mapping[str, Any]


# --- the group of one name ----------------------------------------------------------


def is_index(component: str) -> bool:
    """An all-digit (ASCII) name component: the index of a ModuleList or Sequential
    entry. str.isdigit() alone would also take "²" and other Unicode digits."""
    return component.isascii() and component.isdigit()


def layer_of(name: str) -> str:
    """The name up to and including its first all-digit component; a name
    without one, its module (module_of)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if is_index(part):
            return ".".join(parts[: i + 1])
    return module_of(name)


def module_of(name: str) -> str:
    """The name without its last component; "" for a name of one component."""
    return name.rpartition(".")[0]


def group_of(row: Row, by: str, default_shard: str = "") -> str:
    """The group of one row: by "layer" or "module" of its name, or by "shard",
    its row["shard"] (`default_shard` where that is missing or empty)."""
    if by == "layer":
        return layer_of(str(row["name"]))
    if by == "module":
        return module_of(str(row["name"]))
    if by == "shard":
        return str(row.get("shard") or default_shard)
    raise ValueError(f"group_of: by must be one of {', '.join(GROUP_KEYS)}, got {by!r}")


# --- worst first ----------------------------------------------------------------------


def rank(severity: object) -> int:
    return RANK.get(str(severity), 0)


def nonfinite(row: Row) -> int:
    return int(row.get("nan") or 0) + int(row.get("posinf") or 0) + int(row.get("neginf") or 0)


def zero_fraction(row: Row) -> float:
    numel = int(row.get("numel") or 0)
    return int(row.get("zeros") or 0) / numel if numel else 0.0


def worst_key(row: Row) -> tuple[int, int, float]:
    """A scan row's badness, largest worst: severity, then NaN+Inf elements,
    then zero fraction. Sort with reverse=True (stable: ties keep their order)."""
    return rank(row.get("severity")), nonfinite(row), zero_fraction(row)


def worst_first(rows: Iterable[Row]) -> list[Any]:
    """Scan rows in worst_key order, ties in their given (file) order."""
    return sorted(rows, key=worst_key, reverse=True)


def diff_worst_key(row: Row) -> tuple[int, int, float]:
    """A diff row's badness: severity, then what it became (NaN/Inf, all
    zero), then the fraction of its elements that changed."""
    return rank(row.get("severity")), BECAME_RANK.get(str(row.get("became") or ""), 0), float(
        row.get("changed_fraction") or 0.0
    )


# --- groups of a scan --------------------------------------------------------------------


def scan_groups(
    rows: Sequence[Row], by: str, *, skipped: Sequence[Row] = (), default_shard: str = ""
) -> list[dict[str, Any]]:
    """One summary per group of `rows` (scan rows) and `skipped` entries (not
    scanned: they add to "skipped" and their severity, "info" when they have
    none, to the group's), worst group first (worst_key over the groups' sums),
    ties in order of first appearance:

        {"group", "tensors", "elements", "zeros", "zero_fraction", "subnormal", "near_zero",
         "nan", "inf", "skipped", "findings", "severity", "worst_tensor"}

    "findings" counts scanned tensors whose severity is not ok; "worst_tensor"
    is the group's first tensor in worst_first order (a skipped entry's name
    when its severity is higher than every scanned tensor's)."""
    groups: dict[str, dict[str, Any]] = {}
    worst: dict[str, tuple[tuple[int, int, float], str]] = {}

    def group(row: Row) -> dict[str, Any]:
        key = group_of(row, by, default_shard)
        if key not in groups:
            groups[key] = {"group": key, "tensors": 0, "elements": 0, "zeros": 0, "zero_fraction": 0.0,
                           "subnormal": 0, "near_zero": 0, "nan": 0, "inf": 0, "skipped": 0, "findings": 0,
                           "severity": "ok", "worst_tensor": ""}
        return groups[key]

    def consider(g: dict[str, Any], badness: tuple[int, int, float], name: str) -> None:
        if g["group"] not in worst or badness > worst[g["group"]][0]:  # strictly worse: the first one stays
            worst[g["group"]] = (badness, name)
            g["worst_tensor"] = name
        if badness[0] > rank(g["severity"]):
            g["severity"] = SEVERITIES[badness[0]]

    for r in rows:
        g = group(r)
        g["tensors"] += 1
        g["elements"] += int(r.get("numel") or 0)
        g["zeros"] += int(r.get("zeros") or 0)
        g["subnormal"] += int(r.get("subnormal") or 0)
        g["near_zero"] += int(r.get("near_zero") or 0)
        g["nan"] += int(r.get("nan") or 0)
        g["inf"] += int(r.get("posinf") or 0) + int(r.get("neginf") or 0)
        g["findings"] += rank(r.get("severity")) > RANK["ok"]
        consider(g, worst_key(r), str(r["name"]))
    for s in skipped:
        g = group(s)
        g["skipped"] += 1
        consider(g, (rank(s.get("severity") or "info"), 0, 0.0), str(s["name"]))
    for g in groups.values():
        g["zero_fraction"] = g["zeros"] / g["elements"] if g["elements"] else 0.0
    return sorted(groups.values(), key=lambda g: (rank(g["severity"]), g["nan"] + g["inf"], g["zero_fraction"]),
                  reverse=True)


# --- groups of a diff ------------------------------------------------------------------


def diff_groups(rows: Sequence[Row], by: str, *, default_shard: str = "") -> list[dict[str, Any]]:
    """One summary per group of diff rows, worst first (severity, then tensors
    that became NaN/Inf, then that became all zero), ties in order of first
    appearance:

        {"group", "tensors", "changed", "identical", "added", "removed", "reshaped", "retyped",
         "unread", "became_nan", "became_zero", "findings", "severity", "worst_tensor"}

    "became_nan" and "became_zero" count the group's tensors whose row says
    so (row["became"])."""
    groups: dict[str, dict[str, Any]] = {}
    worst: dict[str, tuple[int, int, float]] = {}
    for r in rows:
        key = group_of(r, by, default_shard)
        g = groups.get(key)
        if g is None:
            g = groups[key] = {"group": key, "tensors": 0, **{s: 0 for s in DIFF_STATUSES}, "became_nan": 0,
                               "became_zero": 0, "findings": 0, "severity": "ok", "worst_tensor": ""}
        g["tensors"] += 1
        status = str(r.get("status"))
        if status in DIFF_STATUSES:
            g[status] += 1
        became = str(r.get("became") or "")
        g["became_nan"] += became == "nan"
        g["became_zero"] += became == "zero"
        g["findings"] += rank(r.get("severity")) > RANK["ok"]
        badness = diff_worst_key(r)
        if key not in worst or badness > worst[key]:
            worst[key] = badness
            g["worst_tensor"] = str(r["name"])
            g["severity"] = SEVERITIES[badness[0]]
    return sorted(groups.values(), key=lambda g: (rank(g["severity"]), g["became_nan"], g["became_zero"]),
                  reverse=True)
