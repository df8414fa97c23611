"""The static cost of the CUDA scan: issue slots per element, read off the SASS.

The scan is meant to run at memory speed, where an H200 (132 SMs at 1.98 GHz,
four warp instructions issued per SM clock, about 4.2 TB/s) leaves about 32
issue slots per float32 element and 16 per 2-byte element. Whether a kernel
fits is a count, not a measurement, so it needs no GPU: this script compiles
the kernels for sm_90 with the flags .ci/cuda_check.sh uses, disassembles
them (nvdisasm: the toolkit's, or the PyPI wheel nvidia-cuda-nvdisasm's),
finds each kernel's hot loop as the innermost back edge of its control flow
that holds the most element loads (16-byte loads for the contiguous walk,
single loads for the strided one), and prices every instruction by its pipe
(WEIGHTS, measured on an H200 by benchmarks/pipe_rates.cu):

    slots/element = hot-loop slots / elements per iteration
                  + per-tile slots / elements per thread per tile

The per-tile slots are the cheapest path through the tile loop that passes
the hot loop (each block counted once, the hot loop itself left out, calls
priced by their callees): the tile lookup, the block reduction and the
partial's store that every tile pays, amortized over the smallest tile a
tensor gets (kMinTileBytes / element size / kThreads elements per thread). Weights add:
the model ignores that the integer and float pipes overlap, so it is an
upper bound on the issue time (on the H200 of 2026-11-27 it predicted the
measured element rate of the old kernels within 15 %). The strided hot loop
is a lane's run of groups inside one row of the innermost dimension (rows of
at least 32 positions per element of a group: 1,024 for most types); a
group that crosses rows goes element by element through the cursor's carry,
which this count does not price.

    python benchmarks/sass_cost.py              # the table
    python benchmarks/sass_cost.py --check      # exit 1 when a kernel is over its budget
    python benchmarks/sass_cost.py --self-test  # the counter on a kernel of known cost
    python benchmarks/sass_cost.py --json out.json
    python benchmarks/sass_cost.py --calibration  # the H200 runs the prediction is fitted to

BUDGETS, HIST_RATIO and STRIDED_RATIO are enforced (.ci/cuda_check.sh runs
--self-test and --check) on the slots as counted. The table's last columns
are what the calibration predicts an H200 would measure: the slots
calibrated against its runs (sass_calibration.py), as a share of its copy's
GB/s.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import sass_calibration

ROOT = Path(__file__).resolve().parent.parent
CUDA_DIR = ROOT / "csrc" / "cuda"

# What torch.utils.cpp_extension passes to nvcc for the extension, as .ci/cuda_check.sh does.
NVCC_FLAGS = [
    "-std=c++20", "-O3", "-lineinfo",
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr", "-gencode=arch=compute_90,code=sm_90",
]

# Issue slots per warp instruction (an SM sub-partition issues one per clock).
# The FP32 pipes take a warp instruction per clock; the integer ALU, the
# integer multiplier (IMAD), FP64 and the f16 -> f32 conversion one per two
# clocks; VIADDMNMX one per four; conversions, POPC and MUFU one per eight
# (benchmarks/pipe_rates.cu on an H200). Loads, stores, branches, barriers and
# uniform-datapath instructions cost their issue slot. Opcodes not listed
# count 2 and are reported.
WEIGHTS: dict[str, float] = {
    **dict.fromkeys(["FADD", "FMUL", "FFMA", "FADD32I", "FMUL32I", "FFMA32I", "HADD2", "HMUL2", "HFMA2",
                     "FSWZADD"], 1.0),
    **dict.fromkeys(["IADD3", "IADD", "VIADD", "LOP3", "LOP", "ISETP", "SEL", "SHF", "SHL", "SHR", "PRMT",
                     "LEA", "IMNMX", "VIMNMX", "VIMNMX3", "IABS", "FSETP", "FSET", "FSEL", "FMNMX", "FMNMX3",
                     "HSETP2", "HSET2", "HMNMX2", "VHMNMX", "PLOP3", "P2R", "R2P", "MOV", "SGXT", "BMSK",
                     "IMAD", "IMUL", "IDP", "IMAD32I", "DADD", "DMUL", "DFMA", "DSETP", "DMNMX"], 2.0),
    "VIADDMNMX": 4.0,
    "REDUX": 2.0,  # not measured: priced as the integer ALU
    **dict.fromkeys(["F2F", "F2I", "I2F", "I2FP", "F2IP", "FRND", "MUFU", "POPC", "FLO", "BREV", "F2FP"], 8.0),
    **dict.fromkeys(["NOP"], 0.0),
}
# Counted at their issue slot: memory, control and the uniform datapath.
ISSUE_ONLY = re.compile(r"^(LD|ST|ATOM|RED|SHFL|BAR|MEMBAR|FENCE|ERRBAR|CCTL|BRA|BRX|JMP|CALL|RET|EXIT|BSSY|BSYNC|"
                        r"WARPSYNC|VOTE|MATCH|S2R|CS2R|S2UR|U[A-Z0-9]+|YIELD|DEPBAR|LDC|LDS|LDG|LDL)")
# The same for HADD2.F32 (f16 -> f32): measured at half rate.
SLOW_VARIANTS = {("HADD2", "F32"): 2.0}
# The float pipes' arithmetic (FP32 and packed FP16), which the calibration
# below prices apart from everything else.
FLOAT_PIPE = frozenset({"FADD", "FMUL", "FFMA", "FADD32I", "FMUL32I", "FFMA32I", "HADD2", "HMUL2", "HFMA2", "FSWZADD"})

# Budgets in slots per element, which --check enforces: memory speed on an
# H200 (about 32 slots per float32 element, 16 per 2-byte element) with the
# margin issue 42 set.
BUDGETS: dict[str, float] = {"float32": 32, "bfloat16": 20, "float16": 20, "float8_e4m3fn": 12, "float8_e5m2": 12}
HIST_RATIO = 1.10    # the histogram kernel over its plain kernel
STRIDED_RATIO = 2.0  # the strided kernel over the contiguous one

# dtype -> (kernel file, the storage type as it appears in the mangled name, element size)
KERNELS: dict[str, tuple[str, str, int]] = {
    "float32": ("stats_cuda_f32.cu", "If", 4),
    "float64": ("stats_cuda_f64.cu", "Id", 8),
    "float16": ("stats_cuda_f16.cu", "INS_5f16_t", 2),
    "bfloat16": ("stats_cuda_bf16.cu", "INS_6bf16_t", 2),
    "float8_e4m3fn": ("stats_cuda_e4m3.cu", "INS_6e4m3_t", 1),
    "float8_e5m2": ("stats_cuda_e5m2.cu", "INS_6e5m2_t", 1),
}


@dataclass
class Instr:
    addr: int
    opcode: str  # with modifiers, e.g. LDG.E.128.CONSTANT
    predicated: bool
    target: int | None = None  # branch or call target address

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def weight(self) -> float:
        mods = self.opcode.split(".")[1:]
        for (base, mod), w in SLOW_VARIANTS.items():
            if self.base == base and mod in mods:
                return w
        if self.base in WEIGHTS:
            return WEIGHTS[self.base]
        if ISSUE_ONLY.match(self.base):
            return 1.0
        return 2.0

    @property
    def known(self) -> bool:
        return self.base in WEIGHTS or bool(ISSUE_ONLY.match(self.base))


@dataclass
class Block:
    instrs: list[Instr]
    succ: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # blocks entered by CALL

    @property
    def weight(self) -> float:
        return sum(i.weight for i in self.instrs)


@dataclass
class Function:
    """One kernel's control-flow graph: basic blocks, block 0 the entry."""

    name: str
    instrs: list[Instr] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)

    def build(self) -> None:
        ends = ("BRA", "BRX", "JMP", "RET", "EXIT")
        leaders = {0}
        index = {ins.addr: k for k, ins in enumerate(self.instrs)}
        for k, ins in enumerate(self.instrs):
            if ins.target is not None and ins.target in index:
                leaders.add(index[ins.target])
            if ins.base in ends or ins.base == "CALL":
                leaders.add(k + 1)
        starts = sorted(j for j in leaders if j < len(self.instrs))
        block_of = {}
        for b, j in enumerate(starts):
            stop = starts[b + 1] if b + 1 < len(starts) else len(self.instrs)
            self.blocks.append(Block(self.instrs[j:stop]))
            block_of[j] = b
        for b, block in enumerate(self.blocks):
            last = block.instrs[-1]
            target = block_of.get(index.get(last.target, -1)) if last.target is not None else None
            if last.base == "CALL":
                if target is not None:
                    block.calls.append(target)
                if b + 1 < len(self.blocks):
                    block.succ.append(b + 1)
                continue
            if last.base == "BRA" and target is not None:
                block.succ.append(target)
            if (last.predicated or last.base not in ends) and b + 1 < len(self.blocks):
                block.succ.append(b + 1)

    def dominators(self) -> list[set[int]]:
        """dom[b]: the blocks on every path from the entry to b (b reachable;
        code reached only by CALL, or not at all, dominates nothing)."""
        n = len(self.blocks)
        reachable, stack = {0}, [0]
        while stack:
            for s in self.blocks[stack.pop()].succ:
                if s not in reachable:
                    reachable.add(s)
                    stack.append(s)
        preds: list[list[int]] = [[] for _ in range(n)]
        for b in reachable:
            for s in self.blocks[b].succ:
                preds[s].append(b)
        everything = set(reachable)
        dom = [set(everything) if b in reachable else {b} for b in range(n)]
        dom[0] = {0}
        changed = True
        while changed:
            changed = False
            for b in sorted(reachable - {0}):
                new = set.intersection(*(dom[p] for p in preds[b])) | {b}
                if new != dom[b]:
                    dom[b], changed = new, True
        return dom

    def loops(self) -> list[Loop]:
        """Natural loops: a back edge u -> h (h dominates u) and every block
        that reaches u without passing h."""
        dom = self.dominators()
        preds: list[list[int]] = [[] for _ in self.blocks]
        for b, block in enumerate(self.blocks):
            for s in block.succ:
                preds[s].append(b)
        found: dict[int, Loop] = {}
        for u, block in enumerate(self.blocks):
            for h in block.succ:
                if h in dom[u]:
                    body, stack = {h, u}, ([u] if u != h else [])
                    while stack:
                        for p in preds[stack.pop()]:
                            if p not in body:
                                body.add(p)
                                stack.append(p)
                    lp = found.setdefault(h, Loop(h, set(), set()))
                    lp.body |= body
                    lp.latches.add(u)
        return list(found.values())

    def cheapest(self, start: int, goals: set[int], allowed: set[int] | None, free: set[int]) -> float:
        """Least weight of a path of blocks from start to any goal (both
        counted), inside `allowed` (None: anywhere), `free` blocks weighing
        nothing, calls priced by their callees' cheapest path to a RET."""
        best = {start: self.block_cost(start, free)}
        heap = [(best[start], start)]
        while heap:
            cost, b = heapq.heappop(heap)
            if cost > best.get(b, float("inf")):
                continue
            if b in goals:
                return cost
            for s in self.blocks[b].succ:
                if (allowed is None or s in allowed) and s != start:
                    c = cost + self.block_cost(s, free)
                    if c < best.get(s, float("inf")):
                        best[s] = c
                        heapq.heappush(heap, (c, s))
        return float("inf")

    def block_cost(self, b: int, free: set[int]) -> float:
        if b in free:
            return 0.0
        return self.blocks[b].weight + sum(self.callee_cost(c) for c in self.blocks[b].calls)

    def callee_cost(self, entry: int) -> float:
        if not hasattr(self, "_callees"):
            self._callees: dict[int, float] = {}
        if entry not in self._callees:
            self._callees[entry] = 0.0  # recursion adds nothing
            returns = {b for b, blk in enumerate(self.blocks) if blk.instrs[-1].base == "RET"}
            cost = self.cheapest(entry, returns, None, set())
            self._callees[entry] = 0.0 if cost == float("inf") else cost
        return self._callees[entry]


@dataclass
class Loop:
    head: int
    body: set[int]
    latches: set[int]


LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
LABEL = re.compile(r"^\s*(\.L_x_\d+|\$[\w$.]+):")  # branch targets and local subroutines
TARGET = re.compile(r"`\((\.L_x_\d+|\$[\w$.]+)\)")


def find_tool(name: str, env: str) -> str:
    """A CUDA tool from $env, CUDA_HOME, /usr/local/cuda, PATH or the PyPI wheels' nvidia/cu*/bin."""
    candidates = [os.environ.get(env, "")]
    for home in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", name))
    candidates.append(shutil.which(name) or "")
    site = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    candidates += [str(p) for p in sorted(site.glob(f"cu*/bin/{name}"))]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    hint = " (pip install nvidia-cuda-nvdisasm)" if name == "nvdisasm" else ""
    raise SystemExit(f"sass_cost: {name} not found in ${env}, CUDA_HOME, /usr/local/cuda, PATH or {site}{hint}")


def compile_cubin(nvcc: str, source: Path, out: Path) -> None:
    cmd = [nvcc, *NVCC_FLAGS, "-I", str(ROOT / "csrc"), "-cubin", "-o", str(out), str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"sass_cost: {source.name} does not compile:\n{done.stderr}")


def disassemble(nvdisasm: str, cubin: Path) -> list[Function]:
    """Every function of a cubin, as a control-flow graph."""
    text = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    functions: list[Function] = []
    labels: dict[str, int] = {}
    pending: list[tuple[Function, int, str]] = []
    current: Function | None = None
    last_addr = -1
    for raw in text.splitlines():
        header = re.match(r"^\s*\.text\.(\S+):", raw)
        if header:
            current = Function(header.group(1))
            functions.append(current)
            last_addr = -1
            continue
        label = LABEL.match(raw)
        if label and current is not None:
            labels[f"{current.name}:{label.group(1)}"] = last_addr + 0x10
            continue
        m = LINE.search(raw)
        if m and current is not None:
            last_addr = int(m.group(1), 16)
            pred = m.group(2) or ""
            current.instrs.append(Instr(last_addr, m.group(3), bool(pred) and "PT" not in pred))
            t = TARGET.search(m.group(4))
            if t:
                pending.append((current, len(current.instrs) - 1, t.group(1)))
    for fn, i, label in pending:
        fn.instrs[i].target = labels.get(f"{fn.name}:{label}")
    for fn in functions:
        fn.build()
    return functions


@dataclass
class KernelCost:
    name: str
    elements_per_iteration: float
    loop_instructions: int
    loop_slots: float
    tile_slots: float
    elements_per_thread_tile: float
    mix: Counter
    unknown: set[str]
    float_slots: float = 0.0  # the hot loop's slots on the float pipes (FLOAT_PIPE)

    @property
    def per_element(self) -> float:
        return self.loop_slots / self.elements_per_iteration

    @property
    def float_per_element(self) -> float:
        return self.float_slots / self.elements_per_iteration

    @property
    def other_per_element(self) -> float:
        """Every other slot an element, the per-tile code's included."""
        return self.total - self.float_per_element

    @property
    def instructions_per_element(self) -> float:
        return self.loop_instructions / self.elements_per_iteration

    @property
    def tile_per_element(self) -> float:
        return self.tile_slots / self.elements_per_thread_tile

    @property
    def total(self) -> float:
        return self.per_element + self.tile_per_element


def is_element_load(ins: Instr, strided: bool) -> bool:
    """The kernels read tensor data through the read-only path (__ldg:
    LDG...CONSTANT) and nothing else; the contiguous walk 16 bytes at a time."""
    return ins.base == "LDG" and ".CONSTANT" in ins.opcode and (strided or ".128" in ins.opcode)


def cost_of(fn: Function, elem_size: int, strided: bool, per_thread_tile: float) -> KernelCost:
    """The hot loop is the innermost loop with the most element loads; the
    tile loop the outermost loop around it."""
    loops = fn.loops()

    def element_loads(lp: Loop) -> int:
        return sum(1 for b in lp.body for i in fn.blocks[b].instrs if is_element_load(i, strided))

    loading = [lp for lp in loops if element_loads(lp)]
    innermost = [lp for lp in loading if not any(o.body < lp.body for o in loading)]
    if not innermost:
        raise SystemExit(f"sass_cost: no loop of {fn.name} loads elements through __ldg")
    hot = max(innermost, key=element_loads)
    body = [i for b in sorted(hot.body) for i in fn.blocks[b].instrs]
    per_iteration = element_loads(hot) * (1 if strided else 16 // elem_size)
    outer = [lp for lp in loops if hot.body < lp.body]
    tile = 0.0
    if outer:
        # Through the hot loop: a path that skips it skips the tile's work.
        tile_loop = max(outer, key=lambda lp: len(lp.body))
        tile = fn.cheapest(tile_loop.head, {hot.head}, tile_loop.body, hot.body) + fn.cheapest(
            hot.head, tile_loop.latches, tile_loop.body, hot.body)
    return KernelCost(
        name=fn.name,
        elements_per_iteration=per_iteration,
        loop_instructions=len(body),
        loop_slots=sum(i.weight for i in body),
        tile_slots=tile,
        elements_per_thread_tile=per_thread_tile,
        mix=Counter(i.base for i in body),
        unknown={i.base for i in body if not i.known},
        float_slots=sum(i.weight for i in body if i.base in FLOAT_PIPE),
    )


def header_constant(name: str) -> int:
    """kThreads or kMinTileBytes from stats_cuda.cuh."""
    text = (CUDA_DIR / "stats_cuda.cuh").read_text()
    m = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*([^;]+);", text)
    if not m:
        raise SystemExit(f"sass_cost: {name} not found in stats_cuda.cuh")
    expr = re.sub(r"int64_t\((\d+)\)", r"\1", m.group(1).split("//")[0])
    if not re.fullmatch(r"[\d\s<*()+]+", expr):
        raise SystemExit(f"sass_cost: cannot read {name} = {m.group(1)!r}")
    return int(eval(expr))  # digits, shifts and products only (checked above)


def kernel_functions(functions: list[Function], mangled_type: str) -> dict[str, Function]:
    """{'contig', 'contig_hist', 'strided', 'strided_hist'} -> function."""
    out = {}
    for fn in functions:
        for kind in ("contig", "strided"):
            prefix = f"scan_{kind}_kernel{mangled_type}"
            for hist, flag in ((False, "Lb0E"), (True, "Lb1E")):
                if prefix in fn.name and flag in fn.name.split(prefix, 1)[1][:8]:
                    out[kind + ("_hist" if hist else "")] = fn
    return out


def measure(jobs: int) -> dict[str, dict[str, KernelCost]]:
    nvcc, nvdisasm = find_tool("nvcc", "NVCC"), find_tool("nvdisasm", "NVDISASM")
    threads = header_constant("kThreads")
    tile_bytes = header_constant("kMinTileBytes")
    with tempfile.TemporaryDirectory() as tmp:
        def one(dtype: str) -> tuple[str, dict[str, KernelCost]]:
            source, mangled, size = KERNELS[dtype]
            cubin = Path(tmp) / f"{dtype}.cubin"
            compile_cubin(nvcc, CUDA_DIR / source, cubin)
            fns = kernel_functions(disassemble(nvdisasm, cubin), mangled)
            if len(fns) != 4:
                raise SystemExit(f"sass_cost: expected 4 scan kernels in {source}, found {sorted(fns)}")
            per_thread = tile_bytes / size / threads
            return dtype, {kind: cost_of(fn, size, kind.startswith("strided"), per_thread)
                           for kind, fn in fns.items()}

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return dict(pool.map(one, KERNELS))


SELF_TEST = r"""
// One FADD per element: the counter must find 4 FADD per 16-byte load.
extern "C" __global__ void fadd_scan(const float4* x, long n, float* out) {
  float s = 0.f;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    const float4 v = __ldg(x + i);
    s += v.x; s += v.y; s += v.z; s += v.w;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def self_test() -> None:
    nvcc, nvdisasm = find_tool("nvcc", "NVCC"), find_tool("nvdisasm", "NVDISASM")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "fadd.cu", Path(tmp) / "fadd.cubin"
        src.write_text(SELF_TEST)
        compile_cubin(nvcc, src, cubin)
        (fn,) = disassemble(nvdisasm, cubin)
        cost = cost_of(fn, 4, False, 1.0)
    fadds = cost.mix["FADD"] / cost.elements_per_iteration
    print(f"self-test: {cost.elements_per_iteration:g} elements per iteration, {fadds:g} FADD per element, "
          f"{cost.per_element:.2f} slots per element ({dict(cost.mix)})")
    if fadds != 1.0:
        raise SystemExit(f"sass_cost: self-test found {fadds} FADD per element, not 1")
    if cost.float_per_element != 1.0:
        raise SystemExit(f"sass_cost: self-test found {cost.float_per_element} float-pipe slots per element, not 1")
    worst = sass_calibration.worst_fitted_error()
    print(f"self-test: the calibration predicts the H200 runs it is fitted to within {worst:.1%}")
    if worst > 0.15:
        raise SystemExit(f"sass_cost: the calibration misses a fitted H200 run by {worst:.0%} (over 15 %)")


def report(costs: dict[str, dict[str, KernelCost]]) -> tuple[list[str], list[str]]:
    """Prints the table; returns the budgets missed and the open targets missed."""
    missed, open_missed = [], []
    print("| dtype | kernel | instructions / elt (loop) | slots / elt (loop) | per tile (slots / thread) | "
          "slots / elt (total) | budget | H200 slots / elt (calibrated) | H200 % of copy | with atomics bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype, kinds in costs.items():
        plain = kinds["contig"].total
        for kind in ("contig", "contig_hist", "strided", "strided_hist"):
            c = kinds[kind]
            enforced = False
            if kind == "contig":
                limit = BUDGETS.get(dtype)
                enforced = limit is not None
                budget = f"<= {limit:g}" if limit else "-"
                over = limit is not None and c.total > limit
            elif kind == "contig_hist":
                budget = f"<= {HIST_RATIO:.2f} x plain ({c.total / plain:.2f}x)"
                over = c.total > HIST_RATIO * plain
                enforced = True
            elif kind == "strided":
                budget = f"<= {STRIDED_RATIO:g} x contig ({c.total / plain:.2f}x)"
                over = c.total > STRIDED_RATIO * plain
                enforced = True
            else:
                budget, over = "-", False
            line = f"{dtype} {kind}: {c.total:.1f} slots/element, budget {budget}"
            if over:
                (missed if enforced else open_missed).append(line)
            mark = (" **over**" if enforced else " (open)") if over else ""
            size = KERNELS[dtype][2]
            atomics = c.mix["ATOMS"] / c.elements_per_iteration
            share, bounded = sass_calibration.predict_share(c.float_per_element, c.other_per_element, size, atomics)
            h200 = sass_calibration.h200_slots(c.float_per_element, c.other_per_element)
            print(f"| {dtype} | {kind} | {c.instructions_per_element:.1f} | {c.per_element:.1f} | {c.tile_slots:.0f} | "
                  f"{c.total:.1f} | {budget}{mark} | {h200:.1f} | {share:.0%} | {bounded:.0%} |")
    unknown = sorted({u for kinds in costs.values() for c in kinds.values() for u in c.unknown})
    if unknown:
        print(f"\nopcodes priced at 2 slots for want of a measured weight: {', '.join(unknown)}")
    return missed, open_missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a kernel is over its budget")
    parser.add_argument("--self-test", action="store_true", help="check the counter on a one-FADD kernel")
    parser.add_argument("--json", type=Path, help="write every kernel's figures here")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    parser.add_argument("--mix", action="store_true", help="print each contiguous hot loop's opcode mix")
    parser.add_argument("--calibration", action="store_true", help="print the H200 runs the prediction is fitted to")
    args = parser.parse_args()
    if args.self_test:
        self_test()
        return 0
    if args.calibration:
        print("\n".join(sass_calibration.calibration_table()))
        return 0
    costs = measure(args.jobs)
    missed, open_missed = report(costs)
    if args.mix:
        for dtype, kinds in costs.items():
            print(f"\n{dtype} contig hot loop, per iteration of {kinds['contig'].elements_per_iteration:g} elements:")
            print("  " + ", ".join(f"{op} {n}" for op, n in kinds["contig"].mix.most_common()))
    if args.json:
        args.json.write_text(json.dumps({d: {k: {"slots_per_element": c.total, "loop_slots_per_element": c.per_element,
                                                   "tile_slots": c.tile_slots,
                                                   "float_slots_per_element": c.float_per_element,
                                                   "instructions_per_element": c.instructions_per_element}
                                               for k, c in kinds.items()} for d, kinds in costs.items()}, indent=1))
    if open_missed:
        print("\nopen targets, not met yet:\n  " + "\n  ".join(open_missed))
    if missed:
        print("\nover budget:\n  " + "\n  ".join(missed))
        return 1 if args.check else 0
    print(f"\nwithin budget: {', '.join(BUDGETS)}; histogram / plain and strided / contiguous of every dtype")
    return 0


if __name__ == "__main__":
    sys.exit(main())
