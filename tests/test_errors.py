"""Bad input gets an error that names the argument and what was received."""

from __future__ import annotations

import pytest
import torch

import zeroscan


def test_none_explains_missing_gradients() -> None:
    with pytest.raises(TypeError, match=r"zeroscan.stats: x is None.*gradient that was never computed"):
        zeroscan.stats(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tensors\[1\] is None.*never computed"):
        zeroscan.stats_many([torch.ones(2), None])  # type: ignore[list-item]


@pytest.mark.parametrize("bad", [3.0, [1.0, 2.0], "x", object()])
def test_non_tensors(bad: object) -> None:
    with pytest.raises(TypeError, match=f"x must be a torch.Tensor, got {type(bad).__name__}"):
        zeroscan.stats(bad)  # type: ignore[arg-type]


def test_single_tensor_given_to_stats_many() -> None:
    with pytest.raises(TypeError, match="got a single tensor"):
        zeroscan.stats_many(torch.ones(3))  # type: ignore[arg-type]


def test_sparse_and_meta() -> None:
    sparse = torch.eye(4).to_sparse()
    with pytest.raises(ValueError, match=r"x is a torch.sparse_coo tensor.*to_dense"):
        zeroscan.stats(sparse)
    with pytest.raises(ValueError, match="meta device"):
        zeroscan.stats(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match=r"tensors\[1\] is on the meta device"):
        zeroscan.stats_many([torch.ones(2), torch.empty(3, device="meta")])


def test_complex_is_refused_with_a_way_out() -> None:
    with pytest.raises(RuntimeError, match=r"x is complex.*x.abs\(\)"):
        zeroscan.stats(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match=r"xs\[1\] is complex"):
        zeroscan.stats_many([torch.ones(2), torch.randn(3, dtype=torch.complex128)])


@pytest.mark.parametrize("tol", [-1e-3, float("nan")])
def test_bad_tol(tol: float) -> None:
    with pytest.raises(ValueError, match="tol must be a non-negative number"):
        zeroscan.stats(torch.ones(3), tol=tol)
    with pytest.raises(RuntimeError, match="tol must be a non-negative number"):
        torch.ops.zeroscan.stats(torch.ones(3), tol)  # the native check too


def test_tol_type() -> None:
    with pytest.raises(TypeError, match="tol must be a number or None, got str"):
        zeroscan.stats(torch.ones(3), tol="small")  # type: ignore[arg-type]


def test_requires_grad_and_views_are_fine() -> None:
    w = torch.randn(10, 10, requires_grad=True)
    s = zeroscan.stats(w)  # no autograd graph is recorded for the scan
    assert s.numel == 100
    assert not s.buffer.requires_grad
