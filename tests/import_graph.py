"""Checks zeroscan/'s layout: no import cycles, no module over 500 lines.

Every import counts, the ones inside functions included: a module that imports
another lazily to dodge a cycle still has the cycle.

    python tests/import_graph.py        # prints the cycles and long modules; exit 1 if any
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "zeroscan"
MAX_LINES = 500


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def imported(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """The package's modules `name` imports, at any depth of its code, as
    (named, implied). Named: `import P.x` of a source module, and for
    `from P import x` the submodule P.x where there is one, else P itself (x
    is a name its __init__ defines). Implied: the packages above each of
    them, whose __init__ runs first, and those above a module that is no
    source file (the compiled zeroscan._C). `importlib.import_module` calls
    are not seen: they name their module at run time."""
    is_package = path.name == "__init__.py"
    named: set[str] = set()
    implied: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                if not is_package:
                    anchor = anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target in known:
                named.add(target)
            implied.update(p for p in packages_above(target) if p in known)
    named.discard(name)
    implied.discard(name)
    return named, implied


def packages_above(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules that importing it runs, named or implied. An
    implied package that the importing module is itself inside of is running
    already, and is no edge."""
    known = modules(root)
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        named, implied = imported(name, path, known)
        edges[name] = named | (implied - set(packages_above(name)))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def long_modules(root: Path) -> list[tuple[str, int]]:
    return [
        (str(path.relative_to(root)), n)
        for path in sorted((root / PACKAGE).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    edges = graph(root)
    bad = 0
    for component in cycles(edges):
        bad += 1
        print("import cycle:", " <-> ".join(component))
        for a in component:
            print(f"    {a} -> {', '.join(sorted(edges[a] & set(component)))}")
    for path, n in long_modules(root):
        bad += 1
        print(f"{path}: {n} lines (at most {MAX_LINES})")
    print(f"{len(edges)} modules; {bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
