"""Reports as plain data: what the loggers, the plots, the CLI and Report share.

The loggers and the plots take a Monitor Report or its ``to_dict()`` dict
alike (`report_dict`), so that a report saved as JSON can be replayed; the
loggers, the CLI and Report.to_json_lines write strict JSON, which has no
NaN or infinity (`json_safe`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def report_dict(report: object) -> Mapping[str, Any]:
    """A Report's to_dict(), or the dict itself."""
    if isinstance(report, Mapping):
        return report
    to_dict = getattr(report, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"report must be a zeroscan Report or its to_dict() dict, got {type(report).__name__}")


def json_safe(obj: Any) -> Any:
    """NaN and infinities -> None, recursively, so the output is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
