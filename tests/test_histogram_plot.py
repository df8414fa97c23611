"""zeroscan.histogram_plot.plot_histograms and `zeroscan scan --histogram --plot`: the
picture is written as a valid PNG or SVG, shows the dtype's overflow region
and the target format's limits only where asked, and a scan's JSON rows turn
back into the histograms they came from."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from helpers import fresh_generator, make_values, save_file_in_order

import zeroscan
from zeroscan import histogram_plot as plot
from zeroscan.cli import main
from zeroscan.histogram import Histogram, reference_histogram

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def needs_matplotlib() -> None:
    pytest.importorskip("matplotlib")


def rgb(hex_color: str) -> tuple[float, float, float]:
    return tuple(int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def pixels_of(path: Path, color: str) -> int:
    """How many pixels of the PNG at `path` have `color`."""
    import matplotlib.image

    image = matplotlib.image.imread(str(path))[..., :3]
    return int((numpy.abs(image - numpy.array(rgb(color))).max(axis=-1) < 0.02).sum())


def items_of(g: torch.Generator) -> list[tuple[str, Histogram]]:
    """Histograms of random tensors of several dtypes, specials planted."""
    dtypes = (torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.int8)
    return [(f"layers.{i}.weight", zeroscan.stats(make_values(2000, d, g), histogram=True).histogram)
            for i, d in enumerate(dtypes)]  # type: ignore[misc]


def test_png_with_and_without_a_target(tmp_path: Path) -> None:
    needs_matplotlib()
    items = items_of(fresh_generator())
    plain, marked = tmp_path / "plain.png", tmp_path / "marked.png"
    assert plot.plot_histograms(items, plain) == str(plain)
    assert plot.plot_histograms(items, marked, target="e4m3", title="t") == str(marked)
    for path in (plain, marked):
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000
    assert pixels_of(marked, plot.TARGET_COLOR) > 50 and pixels_of(plain, plot.TARGET_COLOR) == 0
    assert pixels_of(plain, plot.OVERFLOW_COLOR) > 1_000  # float16's and int8's overflow regions are in view


def test_svg_and_an_appended_extension(tmp_path: Path) -> None:
    needs_matplotlib()
    items = items_of(fresh_generator())[:2]
    svg = plot.plot_histograms(items, tmp_path / "h.svg", target="e2m1")
    text = Path(svg).read_text()
    assert svg.endswith("h.svg") and text.lstrip().startswith("<?xml") and "<svg" in text and "layers.1.weight" in text
    bare = plot.plot_histograms(items, tmp_path / "bare")
    assert bare == str(tmp_path / "bare.png") and Path(bare).read_bytes()[:8] == PNG_MAGIC


def test_no_items_and_an_empty_tensor(tmp_path: Path) -> None:
    needs_matplotlib()
    empty = zeroscan.stats(torch.zeros(0), histogram=True).histogram
    zeros = zeroscan.stats(torch.zeros(5, dtype=torch.float64), histogram=True).histogram
    for items, name in (([], "none.png"), ([("empty", empty), ("zeros", zeros)], "empty.png")):
        out = Path(plot.plot_histograms(items, tmp_path / name))  # type: ignore[arg-type]
        assert out.read_bytes()[:8] == PNG_MAGIC


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    needs_matplotlib()
    items = items_of(fresh_generator())[:1]
    with pytest.raises(ValueError, match="target must be one of e4m3, e5m2, e2m1 or None, got 'fp8'"):
        plot.plot_histograms(items, tmp_path / "x.png", target="fp8")
    with pytest.raises(TypeError, match=r"items\[1\] must be a \(name, Histogram\) pair"):
        plot.plot_histograms([items[0], ("w", {"binades": {}})], tmp_path / "x.png")  # type: ignore[list-item]
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot.plot_histograms([], tmp_path / "x.png")


def test_dtype_limits_and_targets() -> None:
    assert plot.dtype_limits(torch.float16) == (-24.0, -14.0, math.log2(65504.0))
    assert plot.dtype_limits(torch.bfloat16)[:2] == (-133.0, -126.0)
    assert plot.dtype_limits(torch.float8_e4m3fn) == (-9.0, -6.0, math.log2(448.0))
    assert plot.dtype_limits(torch.int8) == (0.0, 0.0, 8.0) and plot.dtype_limits(torch.bool) == (0.0, 0.0, 1.0)
    assert plot.TARGET_FORMATS == {"e4m3": (2.0**-9, 2.0**-6, 448.0), "e5m2": (2.0**-16, 2.0**-14, 57344.0),
                                   "e2m1": (0.5, 1.0, 6.0)}


def same(a: Histogram, b: Histogram) -> bool:
    return (a.dtype, a.min_exponent, a.zeros, a.subnormal, a.posinf, a.neginf, a.nan) == (
        b.dtype, b.min_exponent, b.zeros, b.subnormal, b.posinf, b.neginf, b.nan
    ) and numpy.array_equal(a.counts, b.counts)


def test_json_rows_turn_back_into_histograms(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    g = fresh_generator()
    tensors: dict[str, torch.Tensor] = {str(d): make_values(500, d, g) for d in (torch.float32, torch.float16,
                                                                                 torch.int16)}
    tensors["complex"] = torch.complex(make_values(60, torch.float64, g), make_values(60, torch.float64, g))
    path = tmp_path / "m.pt"
    torch.save(tensors, path)
    capsys.readouterr()
    assert main(["scan", "--json", "--histogram", "--fail-on", "none", str(path)]) == 0
    rows = json.loads(capsys.readouterr().out)["files"][0]["tensors"]
    for row in rows:
        x = tensors[row["name"]]
        assert same(plot.histogram_of_row(row), reference_histogram(torch.view_as_real(x) if x.is_complex() else x))
    with pytest.raises(ValueError, match="has no \"histogram\""):
        plot.histogram_of_row({k: v for k, v in rows[0].items() if k != "histogram"})


def test_cli_draws_the_histograms(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    needs_matplotlib()
    g = fresh_generator()
    path = tmp_path / "m.safetensors"
    save_file_in_order({"a": make_values(400, torch.float32, g), "b": make_values(90, torch.bfloat16, g)}, path)
    drawn: list[list[tuple[str, Any]]] = []
    real = plot.plot_histograms

    def spy(items: list[tuple[str, Any]], *args: Any, **kwargs: Any) -> str:
        drawn.append(list(items))
        return real(items, *args, **kwargs)

    monkeypatch.setattr(plot, "plot_histograms", spy)
    png = tmp_path / "h.png"
    capsys.readouterr()
    rc = main(["scan", "--histogram", "--plot", str(png), "--target-format", "e5m2", "--fail-on", "none", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and f"plot written to {png}" in out and png.read_bytes()[:8] == PNG_MAGIC
    assert [name for name, _ in drawn[0]] == ["a", "b"]
    assert pixels_of(png, plot.TARGET_COLOR) > 50
