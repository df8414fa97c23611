"""One root cause, one finding.

A .detach() upstream of three layers leaves six parameters without a
gradient; a NaN that spread reaches every gradient. The report gives such a
cause once, naming every tensor it explains, and keeps each tensor's own
finding as a member (Finding.members: in to_dict() and JSON, and in
Report.format(verbose=True)). Findings share a root cause when:

- the cause analysis gave them the same root (Finding.root: the cut, the
  hook, the output left out of the loss, the param group at lr 0);
- they say the same thing but for the tensor's name (every gradient of a
  head exactly zero at the same steps, say);
- they are non-finite values while a model-wide finding says where the
  non-finite values began: that one stands for all of them.

Findings keep their order: a group stands where its first member stood.
"""

from __future__ import annotations

import dataclasses

from zeroscan.monitor.report import GLOBAL_NAME, Finding
from zeroscan.verdicts import Cause
from zeroscan.words import count_noun, listed

SHOWN_NAMES = 8  # names a grouped message lists before "and N more"


def group_findings(findings: list[Finding]) -> list[Finding]:
    """`findings` (ranked), one per root cause (see the module doc)."""
    findings = _absorb_nonfinite(findings)
    keys = [_key(f) for f in findings]
    members: dict[tuple, list[Finding]] = {}
    for f, key in zip(findings, keys):
        if key is not None:
            members.setdefault(key, []).append(f)
    out: list[Finding] = []
    for f, key in zip(findings, keys):
        same = members.get(key) if key is not None else None
        if same is None or len(same) < 2:
            out.append(f)
        elif same[0] is f:
            out.append(_grouped(same))
    return out


def _key(f: Finding) -> tuple | None:
    if f.name == GLOBAL_NAME or f.members:
        return None
    said = f.root if f.root is not None else f.message.replace(f.name, "\0")
    return (f.severity, f.cause, f.kind, f.root is not None, said)


def _grouped(same: list[Finding]) -> Finding:
    first = same[0]
    names = tuple(dict.fromkeys(f.name for f in same))
    shown = listed(list(names), SHOWN_NAMES)
    if first.root is not None:
        message = f"{first.root} ({count_noun(len(names), 'parameter')}: {shown})"
    else:
        head, _, tail = first.message.partition(first.name)
        message = head + shown + tail.replace(first.name, "each of them")
    ranks = sorted({r for f in same for r in f.ranks or ()})
    return dataclasses.replace(
        first,
        name=f"{names[0]} (+{len(names) - 1} more)",
        message=message,
        ranks=tuple(ranks) if ranks else None,
        names=names,
        members=tuple(same),
    )


def _absorb_nonfinite(findings: list[Finding]) -> list[Finding]:
    """The model-wide finding that says where non-finite gradients began
    stands for every other non-finite finding of the report."""
    origin = next((f for f in findings if f.name == GLOBAL_NAME and f.cause == Cause.NONFINITE), None)
    if origin is None:
        return findings
    spread = [f for f in findings if f.cause == Cause.NONFINITE and f is not origin and f.kind != "activation"]
    if not spread:
        return findings
    names = tuple(dict.fromkeys(f"{f.name} ({f.kind})" for f in spread))
    merged = dataclasses.replace(
        origin,
        message=(
            f"{origin.message} ({count_noun(len(names), 'tensor')} hold inf/NaN: "
            f"{listed(list(names), SHOWN_NAMES)})"
        ),
        names=tuple(dict.fromkeys(f.name for f in spread)),  # a gradient and its weight: one name
        members=(origin, *spread),  # the origin's own finding first: Report.detailed keeps it
    )
    gone = {id(f) for f in spread}
    return [merged if f is origin else f for f in findings if id(f) not in gone]
