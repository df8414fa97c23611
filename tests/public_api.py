"""zeroscan's public API as the tests walk it: every callable of every
module that declares `__all__`, found by reading the sources, so that a new
public module or name is walked without being listed anywhere first."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import zeroscan

ROOT = Path(zeroscan.__file__).parent


def modules_declaring_all() -> list[str]:
    """Every zeroscan module whose source assigns `__all__` at its top level."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
               for node in tree.body):
            parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.append(".".join(parts))
    return found


def public_callables() -> dict[str, object]:
    """{qualified public name: callable} over every module declaring __all__
    (and the modules an __all__ names); an object public under several names
    is listed under its shortest (zeroscan.diagnose, not zeroscan.diagnosis.diagnose)."""
    names: dict[int, tuple[str, object]] = {}
    modules = [importlib.import_module(m) for m in modules_declaring_all()]
    while modules:
        module = modules.pop(0)
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, ModuleType):
                if hasattr(obj, "__all__"):
                    modules.append(obj)
                continue
            if not callable(obj):
                continue
            qualified = f"{module.__name__}.{name}"
            known = names.get(id(obj))
            if known is None or len(qualified) < len(known[0]):
                names[id(obj)] = (qualified, obj)
    return dict(names.values())


def public_classes() -> dict[str, type]:
    """{qualified public name: class} of public_callables."""
    return {name: obj for name, obj in public_callables().items() if isinstance(obj, type)}
