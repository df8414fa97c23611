"""zeroscan.plot: the gradient-flow picture of a report and the picture of a
checkpoint scan are written, are not blank, and show problem layers in the
finding colours (and no such colour when there is no finding)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from helpers import fresh_generator, train_monitored
from torch import nn

from zeroscan import plot

ERROR_RGB = (0xC6 / 255, 0x28 / 255, 0x28 / 255)
WARNING_RGB = (0xEF / 255, 0x6C / 255, 0x00 / 255)


def pixels(path: Path) -> Any:
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    return image[..., :3]


def not_blank(path: Path) -> Any:
    assert path.exists() and path.stat().st_size > 5_000
    image = pixels(path)
    assert image.shape[0] > 200 and image.shape[1] > 400
    assert float(image.std()) > 0.05  # not one flat colour
    return image


def count_color(image: Any, rgb: tuple[float, float, float]) -> int:
    import numpy as np

    return int((np.abs(image - np.array(rgb)).max(axis=-1) < 0.03).sum())


def report_dict(g: torch.Generator, n: int, steps: int, problems: bool) -> dict[str, Any]:
    names = [f"blocks.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(n)]
    tensors = []
    for i, name in enumerate(names):
        r = torch.rand(4, generator=g, dtype=torch.float64).tolist()
        tensors.append({"name": name, "kind": "weight", "numel": 100, "zero_fraction": 0.0, "subnormal_fraction": 0.0,
                        "near_zero_fraction": 0.0, "nan": 0, "inf": 0, "norm": 1.0, "mean": 0.0, "std": 1.0,
                        "min_abs": 0.0, "max_abs": 1.0})
        if problems and i == 1:
            continue  # no gradient
        tensors.append({"name": name, "kind": "grad", "numel": 100, "zero_fraction": r[0] * 0.2,
                        "subnormal_fraction": r[1] * 0.01, "near_zero_fraction": r[2] * 0.05, "nan": 0, "inf": 0,
                        "norm": 10 ** (-6 * r[3]), "mean": 0.0, "std": 1.0, "min_abs": 0.0, "max_abs": 1.0})
    findings = []
    if problems:
        findings = [{"name": names[1], "kind": "grad", "severity": "error", "cause": "detached", "message": "cut"},
                    {"name": names[3], "kind": "grad", "severity": "warning", "cause": "underflow", "message": "tiny"}]
    history_names = [nm for i, nm in enumerate(names) if not (problems and i == 1)]
    grid = [[10 ** (-6 * float(torch.rand((), generator=g))) for _ in history_names] for _ in range(steps)]
    history = {"steps": list(range(steps)), "names": history_names, "grad_norm": grid,
               "zero_fraction": [[0.1] * len(history_names)] * steps,
               "subnormal_fraction": [[0.0] * len(history_names)] * steps}
    return {"step": steps - 1, "findings": findings, "tensors": tensors, "history": history}


@pytest.fixture(autouse=True)
def _needs_matplotlib(request: pytest.FixtureRequest) -> None:
    if "drawn" not in request.fixturenames:  # the recording stand-in needs no matplotlib
        pytest.importorskip("matplotlib")


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the plots draw, recorded instead of drawn: matplotlib's Figure and the
    modules the plots import replaced by mocks, so that the data each panel gets
    can be read back (and checked where matplotlib is not installed). Returns the
    axes grids that each figure's subplots() made, in order."""
    grids: list[Any] = []

    def figure(*args: Any, **kwargs: Any) -> Any:
        fig = mock.MagicMock()

        def subplots(rows: int, cols: int, **options: Any) -> Any:
            axes = np.empty((rows, cols), dtype=object)
            for index in np.ndindex(rows, cols):
                axes[index] = mock.MagicMock()
            grids.append(axes)
            return axes

        fig.subplots.side_effect = subplots
        return fig

    monkeypatch.setattr(plot, "require_matplotlib", lambda: figure)
    for name in ("matplotlib", "matplotlib.patches", "matplotlib.colors"):
        monkeypatch.setitem(sys.modules, name, mock.MagicMock())
    return grids


def panels(axes: Any) -> dict[str, Any]:
    """The axes of one row of a recorded figure, by the title each was given."""
    return {ax.set_title.call_args.args[0]: ax for ax in axes if ax.set_title.called}


def bars(ax: Any) -> list[list[float]]:
    """The bar lengths of each barh call on a recorded axes."""
    return [list(call.args[1]) for call in ax.barh.call_args_list]


def test_underflow_is_the_subnormal_share_and_near_zero_a_panel_of_its_own(drawn: list[Any]) -> None:
    """One definition: the "underflow %" panel draws the subnormal share alone (the
    report's subnormal_fraction, the loggers' underflow_pct), and near-zero % is drawn
    in its own panel, under its own name, never added to it."""
    report = report_dict(fresh_generator(), 8, 1, problems=False)
    grads = [t for t in report["tensors"] if t["kind"] == "grad"]
    plot.plot_report(report, "flow")
    (grid,) = drawn
    by_title = panels(grid[0])
    (underflow,) = [t for t in by_title if t.startswith("underflow %")]
    assert bars(by_title[underflow]) == [pytest.approx([100 * t["subnormal_fraction"] for t in grads])]
    assert "near" not in underflow and "+" not in underflow
    (near,) = [t for t in by_title if t.startswith("near zero %")]
    assert bars(by_title[near]) == [pytest.approx([100 * t["near_zero_fraction"] for t in grads])]

    rows = [{"name": f"t{i}", "numel": 100, "zeros": i, "subnormal": i, "near_zero": 3 * i, "nan": 0, "posinf": 0,
             "neginf": 0, "min_abs_nonzero": 1e-3, "max_abs": 1.0, "severity": "ok"} for i in range(5)]
    plot.plot_scan(rows, "scan")
    by_title = panels(drawn[1][0])
    (underflow,) = [t for t in by_title if t.startswith("underflow %")]
    assert bars(by_title[underflow]) == [pytest.approx([float(i) for i in range(5)])]
    (near,) = [t for t in by_title if t.startswith("near zero %")]
    assert bars(by_title[near]) == [pytest.approx([3.0 * i for i in range(5)])]


@pytest.mark.parametrize("key", ["subnormal_fraction", "underflow_fraction"])
def test_the_underflow_heat_map_reads_the_history(drawn: list[Any], key: str) -> None:
    """The history's per-step underflow share is "subnormal_fraction", the tensor rows'
    name; a report saved before the rename ("underflow_fraction") draws the same."""
    report = report_dict(fresh_generator(), 4, 3, problems=False)
    history = report["history"]
    history.pop("subnormal_fraction")
    history[key] = [[0.01 * (step + 1) * (k + 1) for k in range(4)] for step in range(3)]
    plot.plot_report(report, "flow")
    (grid,) = drawn
    by_title = panels(grid[1])
    (title,) = [t for t in by_title if t.startswith("underflow %")]
    (call,) = by_title[title].imshow.call_args_list
    shown = np.ma.filled(call.args[0], np.nan)  # rows: parameters, columns: steps
    np.testing.assert_allclose(shown.T, 100 * np.array(history[key]), rtol=1e-12)


@pytest.mark.parametrize("steps", [1, 6])
def test_report_plot_highlights_problem_layers(tmp_path: Path, steps: int) -> None:
    g = fresh_generator()
    bad, good = tmp_path / "bad.png", tmp_path / "good.png"
    assert plot.plot_report(report_dict(g, 8, steps, problems=True), bad) == str(bad)
    plot.plot_report(report_dict(g, 8, steps, problems=False), good)
    bad_img, good_img = not_blank(bad), not_blank(good)
    assert count_color(bad_img, ERROR_RGB) > 50 and count_color(bad_img, WARNING_RGB) > 50
    assert count_color(good_img, ERROR_RGB) == 0 and count_color(good_img, WARNING_RGB) == 0
    if steps > 1:  # the heat maps make a second row
        single = tmp_path / "single.png"
        plot.plot_report(report_dict(g, 8, 1, problems=True), single)
        assert bad_img.shape[0] > pixels(single).shape[0] * 1.5


def test_report_plot_many_layers_and_empty(tmp_path: Path) -> None:
    g = fresh_generator()
    tall = tmp_path / "tall.png"
    plot.plot_report(report_dict(g, 60, 8, problems=True), tall)
    not_blank(tall)
    empty = tmp_path / "empty.png"
    plot.plot_report({"step": 0, "findings": [], "tensors": [], "history": {}}, empty)
    assert empty.exists()
    with pytest.raises(TypeError, match="report must be a zeroscan Report"):
        plot.plot_report(3, tmp_path / "x.png")


def test_real_monitor_report_plot(tmp_path: Path) -> None:
    g = fresh_generator()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model[2].weight.requires_grad_(False)  # frozen: no gradient
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    report = train_monitored(model, opt, g, steps=4)
    path = tmp_path / "flow.png"
    report.plot(str(path))
    not_blank(path)
    data = report.to_dict()
    assert len(data["history"]["steps"]) == 4


def test_scan_plot(tmp_path: Path) -> None:
    g = fresh_generator()
    rows = []
    for i in range(10):
        x = torch.randn(50, generator=g)
        rows.append({"name": f"t{i}", "numel": 50, "zeros": 0, "subnormal": 0, "near_zero": 0, "nan": 0, "posinf": 0,
                     "neginf": 0, "min_abs_nonzero": float(x.abs().min()), "max_abs": float(x.abs().max()),
                     "severity": "ok"})
    clean = tmp_path / "clean.png"
    plot.plot_scan(rows, clean, title="clean")
    assert count_color(not_blank(clean), ERROR_RGB) == 0
    rows[3].update(nan=2, severity="error")
    rows[5].update(zeros=50, min_abs_nonzero=math.inf, max_abs=0.0, severity="warning")
    rows[6].update(subnormal=50, near_zero=50, min_abs_nonzero=1e-42, max_abs=1e-40, severity="warning")
    flagged = tmp_path / "flagged.png"
    plot.plot_scan(rows, flagged)
    image = not_blank(flagged)
    assert count_color(image, ERROR_RGB) > 50 and count_color(image, WARNING_RGB) > 50
    empty = tmp_path / "none.png"
    plot.plot_scan([], empty)
    assert empty.exists()


def test_missing_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot.plot_report({"step": 0, "findings": [], "tensors": []}, tmp_path / "x.png")
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot.plot_scan([], tmp_path / "x.png")


@pytest.mark.parametrize(("given", "written"), [("flow", "flow.png"), ("flow.", "flow.png"), ("flow.SVG", "flow.SVG")])
@pytest.mark.parametrize("draw", ["report", "scan"])
def test_plot_returns_the_file_it_wrote(tmp_path: Path, given: str, written: str, draw: str) -> None:
    if draw == "report":
        path = plot.plot_report({"step": 0, "findings": [], "tensors": []}, tmp_path / given)
    else:
        path = plot.plot_scan([], tmp_path / given)
    assert path == str(tmp_path / written)
    assert [p.name for p in tmp_path.iterdir()] == [written]


@pytest.mark.parametrize("draw", [plot.plot_report, plot.plot_scan])
def test_plot_refuses_a_format_matplotlib_cannot_write(tmp_path: Path, draw: Any) -> None:
    with pytest.raises(ValueError, match=r"x\.xyz: matplotlib cannot write \.xyz files; it writes .*\.png"):
        draw({"step": 0, "findings": [], "tensors": []} if draw is plot.plot_report else [], tmp_path / "x.xyz")
    assert not any(tmp_path.iterdir())
