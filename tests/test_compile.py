"""torch.compile, opcheck and CUDA graphs: the scans inside compiled code.

zeroscan.stats, zeroscan.stats_many and zeroscan.scan_buffers (the Monitor's
per-step scan) must trace into ONE graph under torch.compile(fullgraph=True)
with the native ops in it, and give what eager gives. The CUDA-graph tests
need a GPU and are skipped without one.
"""

from __future__ import annotations

import math

import pytest
import torch

import zeroscan
import zeroscan.distributed as zd
from helpers import ALL_DTYPES, DEVICES, assert_matches_reference, fresh_generator, make_values, stats_of_row

BACKENDS = ["eager", "aot_eager", "inductor"]
OPS = (torch.ops.zeroscan.stats.default, torch.ops.zeroscan.stats_many.default)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def inputs(device: str, g: torch.Generator) -> list[torch.Tensor]:
    """Mixed dtypes and layouts: contiguous, transposed, strided, expanded, 0-d, empty."""
    return [
        make_values(3000, torch.float32, g).to(device),
        make_values(40 * 30, torch.float64, g).reshape(40, 30).t().to(device),
        make_values(2000, torch.bfloat16, g).to(device)[::3],
        make_values(50, torch.float16, g).reshape(50, 1).expand(50, 7).to(device),
        make_values(1, torch.float32, g).reshape(()).to(device),
        make_values(0, torch.int32, g).to(device),
        make_values(500, torch.int8, g).to(device),
    ]


def step(xs: list[torch.Tensor]) -> tuple[zeroscan.Stats, zeroscan.StatsBatch, list[torch.Tensor]]:
    """What a compiled training step does: scan a computed tensor and a list."""
    one = zeroscan.stats(xs[0] * 2.0)
    batch = zeroscan.stats_many(xs, tol=1e-3)
    buffers = zeroscan.scan_buffers(xs)
    return one, batch, buffers


class GraphRecorder:
    """A torch.compile backend that keeps each graph it is given and runs it as is."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        self.graphs.append(gm)
        return gm.forward

    def op_calls(self) -> int:
        return sum(node.target in OPS for gm in self.graphs for node in gm.graph.nodes)


def assert_same_results(got: tuple, want: tuple, xs: list[torch.Tensor]) -> None:
    (g_one, g_batch, g_bufs), (w_one, w_batch, w_bufs) = got, want
    assert torch.equal(g_one.buffer, w_one.buffer)
    assert (g_one.dtype, g_one.shape, g_one.tol) == (w_one.dtype, w_one.shape, w_one.tol)
    assert len(g_batch) == len(w_batch) == len(xs)
    for x, gs, ws in zip(xs, g_batch, w_batch):
        assert torch.equal(gs.buffer, ws.buffer)
        assert (gs.dtype, gs.shape, gs.device, gs.tol) == (x.dtype, x.shape, x.device, 1e-3)
        assert_matches_reference(gs, x, tol=1e-3)
    assert len(g_bufs) == len(w_bufs) == 1
    assert torch.equal(g_bufs[0], w_bufs[0])
    assert_matches_reference(g_one, xs[0] * 2.0)


@pytest.mark.parametrize("device", DEVICES)
def test_one_graph_holds_the_native_ops(device: str) -> None:
    xs = inputs(device, fresh_generator())
    recorder = GraphRecorder()
    got = torch.compile(step, backend=recorder, fullgraph=True)(xs)
    assert len(recorder.graphs) == 1
    assert recorder.op_calls() == 3  # the ops run in the graph, not at trace time
    assert_same_results(got, step(xs), xs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_scans_equal_eager(backend: str, device: str) -> None:
    g = fresh_generator()
    xs = inputs(device, g)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    assert_same_results(compiled(xs), step(xs), xs)
    ys = inputs(device, g)  # new values, same shapes: the compiled code is reused
    assert_same_results(compiled(ys), step(ys), ys)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_models_parameters_trace_into_one_graph(backend: str) -> None:
    """Parameters take check_tensor's full check (plain tensors skip it); no
    step of it may break the graph, the check of their storage included."""
    torch._dynamo.reset()  # step's compiled variants of the other tests count toward the recompile limit
    g = fresh_generator()
    xs = [torch.nn.Parameter(x, requires_grad=x.is_floating_point()) for x in inputs("cpu", g)]
    recorder = GraphRecorder()
    got = torch.compile(step, backend=recorder, fullgraph=True)(xs)
    assert len(recorder.graphs) == 1 and recorder.op_calls() == 3
    assert_same_results(got, step(xs), xs)
    assert_same_results(torch.compile(step, backend=backend, fullgraph=True)(xs), step(xs), xs)


def test_dynamic_shapes_compile_once() -> None:
    g = fresh_generator()
    recorder = GraphRecorder()

    def scan(x: torch.Tensor, y: torch.Tensor) -> tuple[zeroscan.StatsBatch, list[torch.Tensor]]:
        return zeroscan.stats_many([x, y.t()]), zeroscan.scan_buffers([x + 1.0])

    compiled = torch.compile(scan, backend=recorder, fullgraph=True, dynamic=True)
    for n in (5, 17, 1000):
        x, y = make_values(n, torch.float32, g), make_values(3 * n, torch.float64, g).reshape(n, 3)
        batch, (buffer,) = compiled(x, y)
        assert [s.shape for s in batch] == [x.shape, torch.Size([3, n])]
        assert torch.equal(torch.stack([s.buffer for s in batch]), zeroscan.scan_buffers([x, y.t()])[0])
        assert torch.equal(buffer, zeroscan.scan_buffers([x + 1.0])[0])
        assert_matches_reference(batch[1], y.t())
    assert len(recorder.graphs) == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_scan_and_merge_rows_in_one_graph(backend: str) -> None:
    """A per-step scan, then the merge of the rows as if each came from a rank:
    pure torch, so it traces into the same graph."""
    g = fresh_generator()
    parts = [make_values(int(n), torch.float64, g) for n in torch.randint(0, 4000, (3,), generator=g)]

    def scan_and_merge(xs: list[torch.Tensor]) -> torch.Tensor:
        (rows,) = zeroscan.scan_buffers(xs)
        return zd.combine_rows(rows.unsqueeze(1))

    got = torch.compile(scan_and_merge, backend=backend, fullgraph=True)(parts)
    assert torch.equal(got, scan_and_merge(parts))
    whole = torch.cat(parts)
    assert_matches_reference(stats_of_row(got, whole), whole)


def opcheck_samples(device: str, g: torch.Generator) -> list[tuple]:
    samples: list[tuple] = []
    for dtype in ALL_DTYPES:
        samples.append((make_values(257, dtype, g).to(device), None))
    x = make_values(600, torch.float32, g).to(device)
    samples += [
        (x.reshape(20, 30).t(), 1e-3),  # transposed
        (x[::7], 0.5),  # strided
        (x[:40].reshape(40, 1).expand(40, 9), None),  # stride 0
        (x[0].reshape(()), None),  # 0-d
        (x[:0], None),  # empty
        (x.reshape(2, 3, 100)[:, 1:, ::2], None),
        (make_values(300, torch.bfloat16, g).to(device).reshape(10, 30).t(), 0.0),
        (x.clone().requires_grad_(), None),
    ]
    return samples


# opcheck's schema test compares inputs with arithmetic that torch does not
# implement for float8 on the CPU; the other three tests run for float8 too.
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
NO_SCHEMA_TEST = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck(op: torch._ops.OpOverload, args: tuple, dtypes: list[torch.dtype]) -> None:
    if any(d in FP8 for d in dtypes):
        torch.library.opcheck(op, args, test_utils=NO_SCHEMA_TEST)
    else:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_stats(device: str) -> None:
    for x, tol in opcheck_samples(device, fresh_generator()):
        opcheck(torch.ops.zeroscan.stats.default, (x, tol), [x.dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_stats_many(device: str) -> None:
    samples = opcheck_samples(device, fresh_generator())
    lists = [
        [x for x, _ in samples],  # every dtype and layout in one call
        [samples[0][0]],
        [samples[-3][0], samples[-4][0]],  # empty and 0-d
        [samples[-1][0], samples[3][0]],  # requires_grad
    ]
    for xs in lists:
        opcheck(torch.ops.zeroscan.stats_many.default, (xs, 1e-2), [x.dtype for x in xs])
    no_fp8 = [x for x, _ in samples if x.dtype not in FP8]
    opcheck(torch.ops.zeroscan.stats_many.default, (no_fp8, None), [])  # with the schema test


# ------------------------------------------------------------ CUDA graphs


@needs_cuda
def test_scan_buffers_replay_in_a_cuda_graph() -> None:
    """Captured once, replayed after the inputs change in place: the static
    output follows, with no allocation or sync during capture."""
    g = fresh_generator()
    xs = [make_values(n, torch.float32, g, specials=False).cuda() for n in (100_000, 1, 4099)]
    xs.append(make_values(64 * 64, torch.bfloat16, g).cuda().reshape(64, 64).t())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as CUDA graphs require
        zeroscan.scan_buffers(xs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (static_out,) = zeroscan.scan_buffers(xs)
    for trial in range(3):
        for x in xs:
            x.copy_(make_values(x.numel(), x.dtype, g).reshape(x.shape))
        if trial == 1:
            xs[0][12345] = math.nan
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, zeroscan.scan_buffers(xs)[0])
        for x, row in zip(xs, static_out):
            assert_matches_reference(stats_of_row(row, x), x)


# "cuda" in the name: the GPU job (benchmarks/gpu_check.sh) selects -k cuda.
@needs_cuda
def test_cuda_reduce_overhead_mode_matches_eager() -> None:
    g = fresh_generator()
    compiled = torch.compile(zeroscan.scan_buffers, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # the first calls record the CUDA graph, later ones replay it
        xs = inputs("cuda", g)
        got = [b.clone() for b in compiled(xs)]
        want = zeroscan.scan_buffers(xs)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
