"""The package's shape: what `import zeroscan` loads, which names are reachable
from it, no import cycles or overlong modules (import_graph.py), one table of
the result row's columns, and install hints that name this project's
distribution."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from import_graph import cycles, graph, long_modules

from zeroscan.result_row import Column, Merge

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = "torch-zeroscan"
# Submodules a user reaches as attributes of a bare `import zeroscan`.
SUBMODULES = ["checkpoint", "cli", "distributed", "histogram_plot", "integrations", "loggers", "plot", "testing"]

# What a bare `import zeroscan` must not load: each costs start-up time (torch._dynamo
# about a second) or is an optional dependency.
NOT_AT_IMPORT = (
    "torch._dynamo",
    "matplotlib",
    "transformers",
    "lightning",
    "pytorch_lightning",
    "accelerate",
    "tensorboard",
    "tqdm",  # torch may load it itself: only what zeroscan adds counts
    "zeroscan.checkpoint",
    "zeroscan.cli",
    "zeroscan.plot",
    "zeroscan.loggers",
    "zeroscan.integrations.transformers",
)


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def readme_names() -> list[str]:
    """Every `zeroscan.NAME` that README.md and examples/ use as an attribute
    (not a logged tag such as `zeroscan.grad/zero_pct`, nor csrc/zeroscan.cpp)."""
    texts = [(ROOT / "README.md").read_text()] + [p.read_text() for p in sorted((ROOT / "examples").glob("*"))
                                                 if p.suffix in (".py", ".md")]
    return sorted({m for text in texts for m in re.findall(r"(?<![\w/])zeroscan\.([A-Za-z_]\w*)(?![\w/])", text)})


@pytest.fixture(scope="module")
def bare_import() -> dict[str, object]:
    """In a fresh process, after `import torch; import zeroscan` alone: the
    modules loaded, then each README name's lookup in turn."""
    code = f"""
import json, sys, types
import torch
before = set(sys.modules)
import zeroscan
loaded = sorted(m for m in {list(NOT_AT_IMPORT)!r} if m in sys.modules and m not in before)
found = {{}}
for name in {sorted(set(readme_names()) | set(SUBMODULES))!r}:
    try:
        value = getattr(zeroscan, name)
        found[name] = "module" if isinstance(value, types.ModuleType) else "ok"
    except AttributeError as e:
        found[name] = str(e)
print(json.dumps({{"loaded": loaded, "found": found}}))
"""
    return json.loads(run_python(code).strip().splitlines()[-1])


def test_import_loads_no_dynamo_framework_or_lazy_submodule(bare_import: dict[str, object]) -> None:
    assert bare_import["loaded"] == []


@pytest.mark.parametrize("name", readme_names())
def test_each_name_the_readme_uses_is_reachable_after_a_bare_import(bare_import: dict[str, object], name: str) -> None:
    found = bare_import["found"]
    assert isinstance(found, dict) and found[name] in ("ok", "module")


def test_readme_names_include_the_submodules() -> None:
    # The parametrization above is only as good as this list.
    assert {"loggers", "distributed", "integrations", "guard", "stats"} <= set(readme_names())


@pytest.mark.parametrize("name", SUBMODULES)
def test_submodule_is_a_module_after_a_bare_import(bare_import: dict[str, object], name: str) -> None:
    found = bare_import["found"]
    assert isinstance(found, dict) and found[name] == "module"


def test_unknown_attribute_is_an_attribute_error() -> None:
    import zeroscan

    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        zeroscan.no_such_thing  # noqa: B018


def test_no_import_cycles() -> None:
    assert cycles(graph(ROOT)) == []


def test_no_module_over_500_lines() -> None:
    assert long_modules(ROOT) == []


def test_the_monitor_class_decides_when_and_stays_small() -> None:
    # The Monitor holds hooks, lifecycle and cadence; what it reads, how, and what
    # the reads mean live in their own modules (monitor/step_reads.py, rules.py, ...).
    tree = ast.parse((ROOT / "zeroscan" / "monitor" / "monitor.py").read_text())
    (monitor,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Monitor"]
    assert monitor.end_lineno - monitor.lineno + 1 <= 300


def test_only_ops_py_reaches_the_native_library() -> None:
    # One module names the native ops and the library's direct calls; the rest
    # of zeroscan calls them through it, so a schema change is read in one place.
    reach = re.compile(r"torch\.ops\.zeroscan\b|zeroscan\._C\b|from zeroscan import _C\b")
    outside = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "zeroscan").rglob("*.py"))
        if path.name != "ops.py" or path.parent.name != "zeroscan"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if reach.search(line.split("#", 1)[0])
    ]
    assert outside == []


# The modules that may list the result row's columns: its table, and the
# float64 reference, which defines each field itself, apart from the kernels
# it checks.
ROW_LISTERS = ("zeroscan/result_row.py", "zeroscan/reference.py")
COLUMN_OF_FIELD = {c.name.lower(): c for c in Column if c.merge is not Merge.SPARE}
RUN = 4  # this many columns in a row, in the row's order, is a copy of the table


def named_column(node: ast.AST) -> Column | None:
    """The column an item of a list, tuple, dict, call or class body names:
    its field as a string, a keyword or a declared name, or the one Column.X
    in it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return COLUMN_OF_FIELD.get(node.value)
    if isinstance(node, ast.keyword):
        return COLUMN_OF_FIELD.get(node.arg or "")
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if len(targets) == 1 and isinstance(targets[0], ast.Name) and targets[0].id in COLUMN_OF_FIELD:
            return COLUMN_OF_FIELD[targets[0].id]
    named = {
        sub.attr for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "Column"
    }
    return Column[named.pop()] if len(named) == 1 and next(iter(named)) in Column.__members__ else None


def column_lists(root: Path) -> list[str]:
    """path:line of every run of RUN or more items, in any list of a module's
    syntax tree, that name consecutive columns of the result row in order,
    outside ROW_LISTERS."""
    found = []
    for path in sorted((root / "zeroscan").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in ROW_LISTERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for items in ast.iter_fields(node):
                if not isinstance(items[1], list):
                    continue
                run, last = 0, None
                for item in items[1]:
                    column = named_column(item) if isinstance(item, ast.AST) else None
                    run = run + 1 if column is not None and last is not None and column == last + 1 else 1
                    last = column
                    if column is not None and run == RUN:
                        found.append(f"{rel}:{item.lineno}")
    return sorted(found)


def test_only_the_row_table_lists_the_columns() -> None:
    # A new count is a line of result_row.Column (and its definition in
    # reference.py); everything else derives the columns from that table.
    assert column_lists(ROOT) == []


def test_a_hand_list_of_columns_is_found(tmp_path: Path) -> None:
    package = tmp_path / "zeroscan"
    package.mkdir()
    (package / "fields.py").write_text(
        'PICKED = ("numel", "zeros", "subnormal")\n'  # three: a view's choice, not a copy
        'BINS = ("zeros", "subnormal", "posinf", "neginf", "nan")\n'  # not in the row's order
        'COUNTS = ("numel", "zeros", "subnormal", "near_zero", "nan")\n'
        "class Stats:\n    nan = 1\n    posinf = 2\n    neginf = 3\n    negative = 4\n"
        "WORDS = [f(row[Column.MIN_ABS]), f(row[Column.MIN_ABS_NONZERO]), ~f(row[Column.MAX_ABS]), g(Column.MEAN)]\n"
    )
    assert column_lists(tmp_path) == ["zeroscan/fields.py:3", "zeroscan/fields.py:8", "zeroscan/fields.py:9"]


def test_import_graph_sees_function_level_imports(tmp_path: Path) -> None:
    # A cycle made only by an import inside a function is still found.
    package = tmp_path / "zeroscan"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from zeroscan.b import g\n")
    (package / "b.py").write_text("def g():\n    from zeroscan import a\n    return a\n")
    assert cycles(graph(tmp_path)) == [["zeroscan.a", "zeroscan.b"]]


def test_import_graph_sees_a_package_init_run_by_a_submodule_import(tmp_path: Path) -> None:
    # Importing zeroscan.sub.leaf runs zeroscan/sub/__init__.py, which imports a back.
    package = tmp_path / "zeroscan"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import zeroscan.sub.leaf\n")
    (package / "sub" / "__init__.py").write_text("from zeroscan.a import x\n")
    (package / "sub" / "leaf.py").write_text("")
    assert cycles(graph(tmp_path)) == [["zeroscan.a", "zeroscan.sub"]]


def test_import_graph_sees_a_name_taken_from_a_package_init(tmp_path: Path) -> None:
    # `from zeroscan import helper` takes a name the package's __init__ defines, and that __init__ imports b.
    package = tmp_path / "zeroscan"
    package.mkdir()
    (package / "__init__.py").write_text("from zeroscan.b import helper\n")
    (package / "b.py").write_text("def helper():\n    from zeroscan import version\n")
    assert cycles(graph(tmp_path)) == [["zeroscan", "zeroscan.b"]]


# `pip install zeroscan` (with or without extras) installs PyPI's unrelated project of that name.
BARE_NAME_HINT = re.compile(r"""pip3? install\b[^\n;&|#]*?(?<![\w./-])["']?zeroscan(\[[^\]]*\])?["']?(?=[\s`)]|$)""")


def test_install_hints_never_name_the_bare_distribution() -> None:
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    bad = []
    for rel in tracked:
        path = ROOT / rel
        if rel == "tests/test_layout.py":  # this file's examples of what the pattern catches
            continue
        if path.suffix not in (".py", ".md", ".toml", ".txt", ".sh", ".cfg", "") or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        bad += [f"{rel}: {m.group(0)}" for m in BARE_NAME_HINT.finditer(text)]
    assert bad == []


@pytest.mark.parametrize(
    "line, names_bare",
    [
        ('pip install "zeroscan[transformers]"', True),
        ("pip install zeroscan", True),
        ("pip install 'zeroscan[plot,progress]' numpy", True),
        ('pip install "torch-zeroscan[transformers]"', False),
        ('pip install --no-build-isolation -e ".[transformers]"', False),
        ("pip install zeroscan-tools", False),
        ("pip install -e . && zeroscan demo", False),
    ],
)
def test_the_hint_pattern(line: str, names_bare: bool) -> None:
    assert bool(BARE_NAME_HINT.search(line)) == names_bare


def test_the_distribution_is_named_in_pyproject() -> None:
    assert re.search(rf'^name = "{DISTRIBUTION}"$', (ROOT / "pyproject.toml").read_text(), re.M)
