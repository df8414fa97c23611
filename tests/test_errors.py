"""Bad input gets an error that names the argument and what was received."""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch import nn

import zeroscan
import zeroscan.distributed
from checklist import Checklist
from helpers import DEVICES, assert_matches_reference, ended, fresh_generator, make_values, run_python
from zeroscan import reference_stats
from zeroscan.result_row import decode


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
    with pytest.raises(RuntimeError, match=r"^zeroscan.stats_many: tensors\[1\] is complex"):
        zeroscan.stats_many([torch.ones(2), torch.randn(3, dtype=torch.complex128)])


@pytest.mark.parametrize("tol", [-1e-3, float("nan"), -float("inf")])
def test_bad_tol(tol: float) -> None:
    with pytest.raises(ValueError, match="tol must be a non-negative number"):
        zeroscan.stats(torch.ones(3), tol=tol)
    with pytest.raises(RuntimeError, match="tol must be a non-negative number"):
        torch.ops.zeroscan.stats(torch.ones(3), tol)  # the native check too


@pytest.mark.parametrize("tol", [10**400, -(10**400), 10**5000], ids=["1e400", "-1e400", "1e5000"])
def test_tol_beyond_the_float_range(tol: int) -> None:
    want = r"tol must be a non-negative number within the float range, got an integer of \d+ bits"
    with pytest.raises(ValueError, match=want):
        zeroscan.stats(torch.ones(3), tol=tol)
    with pytest.raises(ValueError, match=want):
        zeroscan.stats_many([torch.ones(3)], tol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_negative_zero_tol_is_zero(dtype: torch.dtype) -> None:
    x = make_values(4096, dtype, fresh_generator(), every=10)  # zeros, subnormals, near-zero, NaN and inf planted
    s = zeroscan.stats(x, tol=-0.0)
    assert s.tol == 0.0 and math.copysign(1.0, s.tol) == 1.0
    assert s.near_zero == reference_stats(x, tol=0.0)["near_zero"] == 0
    assert zeroscan.stats_many([x], tol=-0.0)[0].tol.hex() == "0x0.0p+0"


UNREAD_DTYPES = [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fnuz", "float8_e5m2fnuz")
                 if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", UNREAD_DTYPES, ids=str)
def test_unsupported_dtype_names_x_and_a_true_list(dtype: torch.dtype) -> None:
    with pytest.raises(RuntimeError, match=r"zeroscan.stats: x has unsupported dtype") as info:
        zeroscan.stats(torch.zeros(3, dtype=dtype))
    listed = str(info.value).split("supported: ", 1)[1].replace(" and ", ", ").split(", ")
    assert len(listed) >= 12
    for name in listed:  # every dtype the message offers is one zeroscan scans
        assert zeroscan.stats(torch.ones(3, dtype=getattr(torch, name))).numel == 3
    with pytest.raises(RuntimeError, match=r"\[1\] has unsupported dtype"):
        zeroscan.stats_many([torch.ones(2), torch.zeros(3, dtype=dtype)])


def quantized_per_tensor() -> torch.Tensor:
    return torch.quantize_per_tensor(torch.randn(6), 0.1, 0, torch.qint8)


def quantized_per_channel() -> torch.Tensor:
    return torch.quantize_per_channel(torch.randn(3, 4), torch.rand(3) + 0.1, torch.zeros(3, dtype=torch.long), 0,
                                      torch.quint8)


def nested_strided() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])


def nested_jagged() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged)


ODD_KINDS = {"quantized per tensor": (quantized_per_tensor, "quantized tensor (qint8)"),
             "quantized per channel": (quantized_per_channel, "quantized tensor (quint8)"),
             "nested": (nested_strided, "nested tensor"),
             "nested jagged": (nested_jagged, "nested tensor")}


@pytest.mark.parametrize("kind", ODD_KINDS)
def test_quantized_and_nested_are_named(kind: str) -> None:
    make, words = ODD_KINDS[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated in torch
        odd = make()
    calls = {
        "zeroscan.stats: x": lambda: zeroscan.stats(odd),
        "zeroscan.stats_many: tensors[1]": lambda: zeroscan.stats_many([torch.ones(2), odd]),
        "zeroscan.scan_buffers: tensors[1]": lambda: zeroscan.scan_buffers([torch.ones(2), odd]),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{re.escape(name)} is a {re.escape(words)}; scan ") as info:
            call()
        assert "\n" not in str(info.value)


def test_fields_read_under_grad_and_jvp_are_right() -> None:
    x = torch.randn(64, generator=fresh_generator(), dtype=torch.float64)
    want = reference_stats(x)
    seen: list[float] = []

    def f(y: torch.Tensor) -> torch.Tensor:
        s = zeroscan.stats(y)
        seen.append(s.mean)
        return (y * s.std).sum()

    grad = torch.func.grad(f)(x)
    torch.func.jvp(f, (x,), (torch.ones_like(x),))
    assert seen == [pytest.approx(want["mean"], rel=1e-12, abs=1e-15)] * 2
    assert torch.allclose(grad, torch.full_like(x, want["std"]), rtol=1e-12)  # the stats are constants to autograd


@pytest.mark.parametrize("transform", ["grad", "jvp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_every_scan_reads_its_fields_under_grad_and_jvp(transform: str, dtype: torch.dtype) -> None:
    g = fresh_generator()
    x = make_values(300, dtype, g)
    other = make_values(77, torch.float32, g)
    seen: dict[str, object] = {}

    def f(y: torch.Tensor) -> torch.Tensor:
        seen["stats"] = zeroscan.stats(y).to_dict()
        seen["stats(histogram)"] = zeroscan.stats(y, histogram=True).to_dict()
        seen["stats_many"] = zeroscan.stats_many([y, other]).to_dicts()
        seen["stats_many(histogram)"] = zeroscan.stats_many([y, other], histogram=True).to_dicts()
        seen["ones"] = zeroscan.stats_many([torch.ones(3)])[0].to_dict()
        seen["diagnose"] = zeroscan.diagnose(y).to_dict()
        seen["diagnose_many"] = [d.to_dict() for d in zeroscan.diagnose_many([y, other])]
        seen["decode(scan_buffers)"] = [decode(b) for b in zeroscan.scan_buffers([y, other])]
        return (y.float() * 2).sum()

    if transform == "grad":
        torch.func.grad(f)(x)
    else:
        torch.func.jvp(f, (x,), (torch.ones_like(x),))
    # The same calls outside the transform, themselves checked against the float64 reference.
    assert_matches_reference(zeroscan.stats(x), x)
    assert_matches_reference(zeroscan.stats(other), other)
    want = {
        "stats": zeroscan.stats(x).to_dict(),
        "stats(histogram)": zeroscan.stats(x, histogram=True).to_dict(),
        "stats_many": zeroscan.stats_many([x, other]).to_dicts(),
        "stats_many(histogram)": zeroscan.stats_many([x, other], histogram=True).to_dicts(),
        "ones": zeroscan.stats(torch.ones(3)).to_dict(),
        "diagnose": zeroscan.diagnose(x).to_dict(),
        "diagnose_many": [d.to_dict() for d in zeroscan.diagnose_many([x, other])],
        "decode(scan_buffers)": [decode(b) for b in zeroscan.scan_buffers([x, other])],
    }
    assert repr(seen) == repr(want)  # repr: NaN fields compare equal


def test_histograms_under_vmap_are_refused_by_name() -> None:
    batch = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"^zeroscan.stats: x is batched by torch.func.vmap"):
        torch.func.vmap(lambda y: y * zeroscan.stats(y, histogram=True).max_abs)(batch)
    with pytest.raises(RuntimeError, match=r"^zeroscan.stats_many: tensors\[1\] is batched by torch.func.vmap"):
        torch.func.vmap(lambda y: y * zeroscan.stats_many([batch, y], histogram=True)[1].max_abs)(batch)
    want = zeroscan.stats(batch, histogram=True).max_abs
    out = torch.func.vmap(lambda y: y * zeroscan.stats(batch, histogram=True).max_abs)(torch.ones(3, 2))
    assert torch.equal(out, torch.full((3, 2), want))


def test_vmap_over_the_scanned_tensor_is_refused_by_name() -> None:
    batch = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"zeroscan.stats: x is batched by torch.func.vmap.*stats_many"):
        torch.func.vmap(lambda y: y * zeroscan.stats(y).max_abs)(batch)
    with pytest.raises(RuntimeError, match=r"zeroscan.stats_many: tensors\[1\] is batched by torch.func.vmap"):
        torch.func.vmap(lambda y: y * zeroscan.stats_many([batch, y])[1].max_abs)(batch)


def test_vmap_over_something_else_scans_as_usual() -> None:
    x = torch.randn(16, generator=fresh_generator())
    want = zeroscan.stats(x).max_abs
    out = torch.func.vmap(lambda y: y * zeroscan.stats(x).max_abs)(torch.ones(3, 2))
    assert torch.equal(out, torch.full((3, 2), want))
    out = torch.func.vmap(lambda y: y * zeroscan.stats_many([x, x])[1].max_abs)(torch.ones(3, 2))
    assert torch.equal(out, torch.full((3, 2), want))


def test_tol_type() -> None:
    with pytest.raises(TypeError, match="tol must be a number or None, got str"):
        zeroscan.stats(torch.ones(3), tol="small")  # type: ignore[arg-type]


def test_requires_grad_and_views_are_fine() -> None:
    w = torch.randn(10, 10, requires_grad=True)
    s = zeroscan.stats(w)  # no autograd graph is recorded for the scan
    assert s.numel == 100
    assert not s.buffer.requires_grad


# ---- Refusals name the call and the argument the caller used --------------------------
# Whatever the native op refuses, and whichever native op a public call uses
# underneath (stats(histogram=True) runs stats_many_hist), the error begins
# with the public call and the caller's own argument name.

def _public_calls(bad: torch.Tensor) -> list[tuple[str, Callable[[], object]]]:
    ok = torch.ones(2, device=bad.device if not bad.is_meta else "cpu")
    return [
        ("zeroscan.stats: x", lambda: zeroscan.stats(bad)),
        ("zeroscan.stats: x", lambda: zeroscan.stats(bad, histogram=True)),
        ("zeroscan.stats_many: tensors[1]", lambda: zeroscan.stats_many([ok, bad])),
        ("zeroscan.stats_many: tensors[1]", lambda: zeroscan.stats_many([ok, bad], histogram=True)),
        ("zeroscan.scan_buffers: tensors[1]", lambda: zeroscan.scan_buffers([ok, bad])),
        ("zeroscan.diagnose: x", lambda: zeroscan.diagnose(bad)),
        ("zeroscan.diagnose_many: tensors[1]", lambda: zeroscan.diagnose_many([ok, bad])),
        ("zeroscan.distributed.stats: x", lambda: zeroscan.distributed.stats(bad)),
        ("zeroscan.distributed.stats_many: tensors[1]", lambda: zeroscan.distributed.stats_many([ok, bad])),
        ("zeroscan.headroom_of: x", lambda: zeroscan.headroom_of(bad, "e4m3")),
    ]


def _unscanned_dtype(name: str) -> Callable[[str], torch.Tensor]:
    return lambda device: torch.zeros(16, dtype=torch.uint8, device=device).view(getattr(torch, name))


def _freed(device: str) -> torch.Tensor:
    """A parameter whose memory was freed as FSDP frees it, shape kept."""
    p = nn.Parameter(torch.randn(64, 3, device=device))
    p.untyped_storage().resize_(0)
    return p


def _shrunk(device: str) -> torch.Tensor:
    """A tensor whose storage holds 8 of the 96 bytes its shape needs."""
    x = torch.randn(4, 6, device=device)
    x.untyped_storage().resize_(8)
    return x


def _view_past_the_end(device: str) -> torch.Tensor:
    """A strided view whose offset and strides reach past a shrunk storage."""
    base = torch.randn(100, device=device, dtype=torch.bfloat16)
    view = base[40:].view(6, 10)[:, ::3]
    base.untyped_storage().resize_(2 * 50)
    return view


REFUSED = {
    **{name: _unscanned_dtype(name) for name in (
        "uint16", "uint32", "uint64", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "uint1", "uint4",
        "int2", "int7", "float4_e2m1fn_x2",
    ) if hasattr(torch, name)},
    "lazy parameter": lambda device: nn.UninitializedParameter(device=device),
    "freed parameter": _freed,
    "shrunk storage": _shrunk,
    "view past the end": _view_past_the_end,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", REFUSED)
def test_every_refusal_names_the_call_and_argument_used(kind: str, device: str) -> None:
    bad = REFUSED[kind](device)
    for prefix, call in _public_calls(bad):
        with pytest.raises((RuntimeError, ValueError)) as info:
            call()
        message = str(info.value)
        assert message.startswith(prefix + " "), (prefix, message)
        assert "\n" not in message.strip(), message
        assert info.value.__context__ is None or info.value.__suppress_context__, "one error, not a chain of two"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["freed parameter", "shrunk storage", "view past the end"])
def test_freed_memory_is_never_read(kind: str, device: str) -> None:
    # Errors are caught broadly and checked here: pytest's report of an error raised
    # through frames that hold the freed tensor would print it, and printing it crashes.
    bad = REFUSED[kind](device)
    for prefix, call in _public_calls(bad):
        with pytest.raises((RuntimeError, ValueError)) as info:
            call()
        assert info.type is ValueError, str(info.value)
        assert re.match(rf"{re.escape(prefix)} has no data to scan: its storage holds \d+ bytes", str(info.value))
    # The native ops themselves check it too (direct torch.ops callers, the Monitor's and the guard's fast paths).
    ok = torch.ones(3, device=device)
    native = {
        "zeroscan.stats: x": lambda: torch.ops.zeroscan.stats.default(bad, None),
        "zeroscan.stats_many: xs[1]": lambda: torch.ops.zeroscan.stats_many.default([ok, bad], None),
        "zeroscan.stats_many_hist: xs[0]": lambda: torch.ops.zeroscan.stats_many_hist.default([bad], None),
    }
    if device == "cpu":
        native["zeroscan.stats_many_mapped: xs[1]"] = lambda: torch.ops.zeroscan.stats_many_mapped.default(
            [ok, bad], None, True
        )
    for prefix, call in native.items():
        with pytest.raises((RuntimeError, ValueError)) as info:
            call()
        assert str(info.value).startswith(f"{prefix} has no data to scan"), str(info.value)


@pytest.mark.parametrize("device", DEVICES)
def test_freed_rows_are_refused_by_combine_rows(device: str) -> None:
    rows = torch.zeros(2, 3, 16, dtype=torch.int64, device=device)
    rows.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"^zeroscan\.distributed\.combine_rows: gathered has no data to scan"):
        zeroscan.distributed.combine_rows(rows)
    with pytest.raises(RuntimeError, match=r"^zeroscan.combine_rows: rows has no data to scan"):
        torch.ops.zeroscan.combine_rows.default(rows)


@pytest.mark.parametrize("device", DEVICES)
def test_memory_given_back_scans_as_usual(device: str) -> None:
    g = fresh_generator()
    values = make_values(1000, torch.float32, g)
    p = nn.Parameter(values.clone().to(device))
    p.untyped_storage().resize_(0)
    with pytest.raises((RuntimeError, ValueError)) as info:  # see test_freed_memory_is_never_read
        zeroscan.stats(p)
    assert info.type is ValueError and "has no data to scan" in str(info.value), str(info.value)
    p.untyped_storage().resize_(values.numel() * 4)  # FSDP's all-gather gives the memory back
    with torch.no_grad():
        p.copy_(values)
    empty = torch.empty(0, 5, device=device)
    empty.untyped_storage().resize_(0)  # holds no element: nothing to read
    got = zeroscan.stats_many([p, empty, values.to(device)[::7]])
    assert_matches_reference(got[0], values)
    assert got[1].numel == 0
    assert_matches_reference(got[2], values[::7])


# Refusals that the native ops make, each as the public call names it.
NATIVE_REFUSALS = """
import json, torch, zeroscan
bad = torch.zeros(4, dtype=torch.uint8).view(torch.uint32)
ok = torch.ones(2)
calls = {
    "zeroscan.stats: x": lambda: zeroscan.stats(bad),
    "zeroscan.stats: x (histogram)": lambda: zeroscan.stats(bad, histogram=True),
    "zeroscan.stats_many: tensors[1]": lambda: zeroscan.stats_many([ok, bad]),
    "zeroscan.stats_many: tensors[1] (histogram)": lambda: zeroscan.stats_many([ok, bad], histogram=True),
    "zeroscan.diagnose_many: tensors[0]": lambda: zeroscan.diagnose_many([torch.ones(2, dtype=torch.complex64)]),
}
messages = {}
for name, call in calls.items():
    try:
        call()
        messages[name] = None
    except Exception as e:
        messages[name] = str(e)
print(json.dumps(messages))
"""


def test_refusals_stay_one_line_when_torch_shows_cpp_stack_traces() -> None:
    # TORCH_SHOW_CPP_STACKTRACES=1 makes torch append the C++ stack to every
    # native error; what zeroscan raises in the caller's words stays one line.
    env = {**os.environ, "TORCH_SHOW_CPP_STACKTRACES": "1", "TORCH_DISABLE_ADDR2LINE": "1"}
    done = run_python(NATIVE_REFUSALS, env=env, timeout=120)
    assert done.returncode == 0, ended(done)
    messages = json.loads(done.stdout.strip().splitlines()[-1])
    for name, message in messages.items():
        prefix = name.split(" (")[0]
        assert message is not None, f"{name}: not refused"
        assert message.startswith(prefix + " "), (name, message[:300])
        assert "\n" not in message.strip(), (name, message[:300])


# --- each native refusal in a fresh process ---------------------------------------
# A native refusal whose message holds a number ("xs[1]", "65 dimensions")
# killed the whole process with SIGSEGV on the H200, CPU tensors too: that
# build of the extension held a static copy of libstdc++ (see setup.py), and
# formatting a number in it crashed. In pytest's own process such a crash ends
# the session without a report, so the refusals run here in a fresh
# interpreter, one per device (a CUDA context and torch's import are seconds
# each), and each must end in its one-line error. A call that crashes the
# interpreter is named, and the calls after it run in the next one.
class Refusal(NamedTuple):
    call: str  # evaluated with ok (float32 [2]), bad (uint16), deep (65 dimensions) and flags on the device
    message: str  # the whole error, a regex; it names the call, the argument and what it was given
    devices: tuple[str, ...] = ("cpu", "cuda")


UINT16 = r"has unsupported dtype \(UInt16\); supported: float32, [a-z0-9_, ]+ and int64"
DEEP = r"has 65 dimensions; at most 64 are supported"
REFUSALS = {
    "stats(histogram=True)": Refusal("zeroscan.stats(bad, histogram=True)", rf"zeroscan\.stats: x {UINT16}"),
    "stats_many": Refusal("zeroscan.stats_many([ok, bad])", rf"zeroscan\.stats_many: tensors\[1\] {UINT16}"),
    "stats_many(histogram=True)": Refusal(
        "zeroscan.stats_many([ok, bad], histogram=True)", rf"zeroscan\.stats_many: tensors\[1\] {UINT16}"
    ),
    "scan_buffers": Refusal("zeroscan.scan_buffers([ok, bad])", rf"zeroscan\.scan_buffers: tensors\[1\] {UINT16}"),
    "stats_many_hist op": Refusal(
        "torch.ops.zeroscan.stats_many_hist.default([ok, bad], None)", rf"zeroscan\.stats_many_hist: xs\[1\] {UINT16}"
    ),
    "stats_many_mapped": Refusal(
        "stats_many_mapped([ok, bad])", rf"zeroscan\.stats_many_mapped: tensors\[1\] {UINT16}", ("cpu",)
    ),
    "stats_many_mapped of a CUDA tensor": Refusal(
        "stats_many_mapped([torch.ones(2), ok])",
        r"zeroscan\.stats_many_mapped: tensors\[1\] is on cuda:0; it scans memory-mapped CPU tensors",
        ("cuda",),
    ),
    "stats_many_hist op across devices": Refusal(
        "torch.ops.zeroscan.stats_many_hist.default([torch.ones(2), ok], None)",
        r"zeroscan\.stats_many_hist: all tensors of one call must be on the same device; "
        r"xs\[0\] is on cpu but xs\[1\] is on cuda:0",
        ("cuda",),
    ),
    "stats of 65 dimensions": Refusal("zeroscan.stats(deep)", rf"zeroscan\.stats: x {DEEP}"),
    "stats_many of 65 dimensions": Refusal(
        "zeroscan.stats_many([ok, deep], histogram=True)", rf"zeroscan\.stats_many: tensors\[1\] {DEEP}"
    ),
    "combine_rows op": Refusal(
        "torch.ops.zeroscan.combine_rows.default(ok.view(1, 2))",
        r"zeroscan\.combine_rows: rows must be an int64 \[W, N, 16\] tensor of result rows with W >= 1, "
        r"got Float of shape \[1, 2\]",
    ),
    "mark_nonfinite op": Refusal(
        "torch.ops.zeroscan.mark_nonfinite.default([ok], flags, [3])",
        r"zeroscan\.mark_nonfinite: slots\[0\] is 3, outside flags of 1 entries",
    ),
}

# argv: the device, then the calls. Prints, as each call ends, a line
# "refusal <i> <json>": the error call i raised (null if none).
REFUSE = """
    import json, sys
    import torch, zeroscan
    from zeroscan.stats import stats_many_mapped

    device, calls = sys.argv[1], sys.argv[2:]
    ok = torch.ones(2, device=device)
    bad = torch.zeros(4, dtype=torch.uint8, device=device).view(torch.uint16)
    deep = torch.zeros([1] * 65, device=device)
    flags = torch.zeros(1, dtype=torch.int32, device=device)
    for i, call in enumerate(calls):
        try:
            eval(call)
        except Exception as e:
            error = {"type": type(e).__name__, "message": str(e)}
        else:
            error = None
        print(f"refusal {i} {json.dumps(error)}", flush=True)
"""


def refusals_in_fresh_processes(device: str, calls: list[str]) -> list[dict[str, str] | None | str]:
    """What each call raised, the calls run in turn in a fresh interpreter:
    the error ({"type", "message"}), None if it raised none, or (a str) how
    the interpreter ended if the call crashed it; the calls after a crash run
    in the next interpreter."""
    outcomes: list[dict[str, str] | None | str] = []
    while len(outcomes) < len(calls):
        left = calls[len(outcomes) :]
        proc = run_python(REFUSE, device, *left, timeout=120)
        done = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("refusal ")]
        assert [int(i) for _, i, _ in done] == list(range(len(done))), proc.stdout[-2000:]
        outcomes += [json.loads(error) for _, _, error in done]
        if proc.returncode == 0:
            assert len(done) == len(left), f"{len(done)} of {len(left)} calls ran: {ended(proc)}"
        else:
            assert len(done) < len(left), f"every call ran, then the interpreter ended: {ended(proc)}"
            outcomes.append(f"{left[len(done)]} on {device} crashed the interpreter: {ended(proc)}")
    return outcomes


@pytest.mark.slow  # a fresh interpreter per device
@pytest.mark.parametrize("device", DEVICES)
def test_native_refusal_in_a_fresh_process(device: str) -> None:
    refusals = {kind: refusal for kind, refusal in REFUSALS.items() if device in refusal.devices}
    outcomes = refusals_in_fresh_processes(device, [refusal.call for refusal in refusals.values()])
    with Checklist() as checks:
        for (kind, refusal), error in zip(refusals.items(), outcomes, strict=True):
            with checks.case(kind):
                assert not isinstance(error, str), error
                assert error is not None, f"{refusal.call} on {device} was not refused"
                message = error["message"]
                assert error["type"] == "RuntimeError" and "\n" not in message, (error["type"], message)
                assert re.fullmatch(refusal.message, message), f"{message!r} does not match {refusal.message!r}"
