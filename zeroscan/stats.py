"""zeroscan.stats and zeroscan.stats_many: one fused pass, one small result.

Each call runs one native pass over the tensor memory and leaves its results
in one small int64 buffer on the tensor's device ([16] per tensor, see
csrc/stats_record.h). Nothing is read back until a field is: the first field
read copies the whole buffer to the host once, and later reads use that copy.
So calling stats() never waits for the device.

With `histogram=True` the same pass also counts each tensor's log2-magnitude
histogram (zeroscan.histogram), kept beside the rows until `Stats.histogram`
is read.

A CPU tensor of memory torch did not allocate (a file's mapping from
torch.load(mmap=True), say) is read under the SIGBUS guard: a file truncated
under it is an error naming the call, not the end of the process
(zeroscan.mapped_reads). stats_many_mapped is stats_many for the checkpoint
reader: it reads the tensors of a memory-mapped file in place and lists
those that the file's truncation meanwhile made unreadable.

Semantics (also in the README):
  zeros       x == 0, either sign
  subnormal   0 < |x| < torch.finfo(dtype).tiny (0 for integer dtypes)
  near_zero   0 < |x| <= tol, tol defaulting to torch.finfo(dtype).eps
              (0 for integer dtypes); subnormals are near zero too
  nan, posinf, neginf, negative (x < 0; -0.0 and NaN are not negative)
  min_abs, max_abs      over non-NaN values (inf included); nan if none
  min_abs_nonzero       over non-NaN nonzero values; inf if none
  mean, std, norm, sum  over the finite values only: NaN and +-inf are
              counted above and never enter the moments. std uses
              correction=1 like torch.std (nan with fewer than 2 finite
              values); mean is nan with no finite value, sum and norm are 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar, overload

import numpy
import torch

from zeroscan import ops
from zeroscan.histogram import Histogram
from zeroscan.mapped_reads import any_maybe_mapped, guarded_rows, maybe_mapped
from zeroscan.ops import check_tensor, check_tol, refused, require_readable
from zeroscan.readout import Readout
from zeroscan.result_row import COUNT_FIELDS, FIELDS, Column
from zeroscan.words import short_count

# The native scan of one tensor, looked up once: the lookup through
# torch.ops costs 0.5 us a call, a tenth of a small tensor's stats().
_scan = ops.stats

_function_mode_enabled = torch._C._is_torch_function_mode_enabled


def _may_skip_torch_ops() -> bool:
    """Whether an operator may be called from C++ (ops.stats_call,
    ops.stats_many_call), without torch.ops' matching of the Python arguments to
    its schema: not while compiling (the graph must see the operator), nor
    under a TorchFunctionMode, whose __torch_function__ torch.ops calls and
    the dispatcher does not. The C++ calls take plain CPU tensors only and
    answer None for anything else (a subclass, a GPU tensor)."""
    return not _function_mode_enabled() and not torch.compiler.is_compiling()


def _scan_now(x: torch.Tensor, tol: float | None) -> torch.Tensor:
    """_scan(x, tol), from C++ where it may be: 1 us of a small tensor's 2.5
    us call was torch.ops' matching of the arguments."""
    if _may_skip_torch_ops():
        out = ops.stats_call(x, tol)
        if out is not None:
            return out
    return _scan(x, tol)


# What a Stats says about the scanned tensor besides its statistics:
# (dtype, shape, device). A plain tuple: stats_many makes one per tensor.
TensorMeta = tuple[torch.dtype, torch.Size, torch.device]


def meta_of(x: torch.Tensor) -> TensorMeta:
    return (x.dtype, x.shape, x.device)


V = TypeVar("V", int, float)


class Field(Generic[V]):
    """One public field of a Stats (see the module doc), read from its row.

    A count is read from its own int64 word, without decoding the row; any
    other field decodes the whole row once (Readout).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.column = Column[name.upper()] if name in COUNT_FIELDS else None

    def __get__(self, stats: Stats | None, owner: type | None = None) -> V:
        if stats is None:  # Stats.zeros: the field itself, for help() and docs
            return self  # type: ignore[return-value]
        if self.column is not None:
            return stats._readout.count(stats._index, self.column)  # type: ignore[return-value]
        return stats._readout.row(stats._index)[self.name]  # type: ignore[return-value]


class Stats:
    """The statistics of one tensor. Every field is read lazily (see module doc).

    Its fields (numel, zeros, ..., mean, std, norm, sum: zeroscan.FIELDS) are
    the Field attributes set below the class, one per field of a row."""

    __slots__ = ("_readout", "_index", "dtype", "shape", "device", "tol")

    def __init__(self, readout: Readout, index: int, meta: TensorMeta, tol: float | None) -> None:
        self._readout = readout
        self._index = index
        self.dtype, self.shape, self.device = meta
        self.tol = tol

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0

    @property
    def histogram(self) -> Histogram | None:
        """The log2-magnitude histogram of the tensor (zeroscan.histogram), or
        None when it was scanned without histogram=True."""
        return self._readout.histogram(self._index, self.dtype)

    @property
    def buffer(self) -> torch.Tensor:
        """The raw int64 result row on the scanned device (for graph/compile use)."""
        buffer = self._readout.buffer
        return buffer if buffer.dim() == 1 else buffer[self._index]

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
            "device": str(self.device),
        }
        out.update(self._readout.row(self._index))
        histogram = self.histogram
        if histogram is not None:
            out["histogram"] = histogram.to_dict()
        return out

    def __repr__(self) -> str:
        r = self._readout.row(self._index)
        dtype = str(self.dtype).removeprefix("torch.")
        shape = ",".join(str(s) for s in self.shape)
        n = r["numel"]
        parts = [f"{dtype}[{shape}] n={short_count(n)}"]
        if n == 0:
            return f"Stats({parts[0]} empty)"
        parts.append(f"zeros={short_count(r['zeros'])} ({_percent(r['zeros'], n)})")
        if r["subnormal"]:
            parts.append(f"subnormal={short_count(r['subnormal'])}")
        if r["near_zero"]:
            parts.append(f"near0={short_count(r['near_zero'])}")
        # Like subnormal and near0, a kind of non-finite value shows only when
        # present, and each one present is flagged: a "!" after a zero count
        # would alarm about nothing.
        nonfinite = (("NaN", r["nan"]), ("+inf", r["posinf"]), ("-inf", r["neginf"]))
        parts += [f"{kind}={short_count(count)}!" for kind, count in nonfinite if count]
        parts.append(f"|x|∈[{_num(r['min_abs'])}, {_num(r['max_abs'])}]")
        parts.append(f"μ={_num(r['mean'])} σ={_num(r['std'])} ‖x‖={_num(r['norm'])}")
        return "Stats(" + " ".join(parts) + ")"


# One Field per field of a decoded row, from the row's table
# (zeroscan.result_row): a count added there is a Stats attribute here.
for _name in FIELDS:
    setattr(Stats, _name, Field(_name))
del _name


def _percent(part: int, whole: int) -> str:
    if part == 0:
        return "0%"
    if part == whole:
        return "100%"
    return f"{100.0 * part / whole:.3g}%"


def _num(v: float) -> str:
    if v == 0:
        return "0"  # not "0.0" (an integer tensor's |x| read "[0.0, 4]"), as the CLI's fmt_num writes it
    if math.isnan(v) or math.isinf(v):
        return str(v).replace("inf", "∞")
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 else f"{v:.2e}"


class StatsBatch(Sequence[Stats]):
    """The Stats of many tensors from one stats_many call; indexes like a list.

    Built by stats_many, its Stats objects are made when first indexed, so a
    long list costs little until it is looked at.
    """

    def __init__(self, items: list[Stats]) -> None:
        self._items: list[Stats | None] = list(items)
        self._make: Callable[[int], Stats] | None = None

    @classmethod
    def lazy(cls, n: int, make: Callable[[int], Stats]) -> StatsBatch:
        """A batch of n whose i-th Stats is make(i), made on first access."""
        batch = cls([])
        batch._items = [None] * n
        batch._make = make
        return batch

    def _get(self, i: int) -> Stats:
        item = self._items[i]
        if item is None:
            assert self._make is not None
            item = self._items[i] = self._make(i)
        return item

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> Stats: ...
    @overload
    def __getitem__(self, index: slice) -> list[Stats]: ...
    def __getitem__(self, index: int | slice) -> Stats | list[Stats]:
        if isinstance(index, slice):
            return [self._get(i) for i in range(len(self))[index]]
        return self._get(range(len(self))[index])

    def __iter__(self) -> Iterator[Stats]:
        # _get inlined: a hot loop reads one field of every Stats.
        items, make = self._items, self._make
        for i, item in enumerate(items):
            if item is None:
                assert make is not None
                item = items[i] = make(i)
            yield item

    def to_dicts(self) -> list[dict[str, object]]:
        return [s.to_dict() for s in self]

    def __reduce__(self) -> tuple[type[StatsBatch], tuple[list[Stats]]]:
        # The maker of a lazy batch is a closure, which pickle cannot store:
        # a pickled (or deep-copied) batch holds every Stats made, sharing
        # one result buffer as the batch did.
        return StatsBatch, (list(self),)

    def __repr__(self) -> str:
        return f"StatsBatch({len(self)} tensors)"


def stats(x: torch.Tensor, *, tol: float | None = None, histogram: bool = False) -> Stats:
    """Scans `x` once and returns its Stats (see the module doc for each field).

    `tol` sets the near-zero threshold; by default torch.finfo(x.dtype).eps.
    `histogram=True` also counts its log2-magnitude histogram in the same
    pass (`Stats.histogram`).
    Never a collective: a DTensor (FSDP2, tensor parallel) is refused with an
    error that names zeroscan.distributed.stats, the collective call that
    every rank of its mesh makes to get the statistics of the full tensor.
    """
    return scan_one("zeroscan.stats", x, tol=tol, histogram=histogram)


def scan_one(op: str, x: object, *, tol: object = None, histogram: object = False) -> Stats:
    """stats() as the public call `op` (zeroscan.diagnose, say) makes it:
    every refusal names `op` and its argument x."""
    x = check_tensor(op, "x", x)
    if tol is not None:
        tol = check_tol(op, tol)
    if histogram is not False:
        check_flag(op, "histogram", histogram)
    if maybe_mapped(x):  # memory torch did not allocate, perhaps a file's: read under the SIGBUS guard
        rows, fields = guarded_rows(op, [("x", x)], tol, histogram)
        return Stats(Readout(rows, fields) if histogram else Readout(rows[0]), 0, meta_of(x), tol)
    # What the native op refuses (a quantized or nested tensor, a dtype it
    # does not read, freed memory) is named as the caller named it.
    if histogram:
        try:
            rows, fields = ops.stats_many_hist([x], tol)
        except RuntimeError as e:
            refused(op, [("x", x)], e)
        return Stats(Readout(rows, fields), 0, meta_of(x), tol)
    try:
        buffer = _scan_now(x, tol)
    except RuntimeError as e:
        refused(op, [("x", x)], e)
    return Stats(Readout(buffer), 0, meta_of(x), tol)


def stats_many(tensors: Iterable[torch.Tensor], *, tol: float | None = None, histogram: bool = False) -> StatsBatch:
    """Scans every tensor with one native call per device; one Stats each.

    `histogram=True` also counts each tensor's log2-magnitude histogram in
    the same pass (`Stats.histogram`).

    Tensors may mix dtypes, shapes and devices. Their results share one buffer
    per device, so reading any one field copies each device's buffer once.
    Never a collective: DTensors are refused, as by stats().

    The call makes no Python object per tensor: the tensors' dtypes and
    shapes are read natively at the call, and each Stats is made from them
    when first indexed. The batch keeps no tensor alive.
    """
    return scan_many("zeroscan.stats_many", tensors, tol=tol, histogram=histogram)


def scan_many(op: str, tensors: Iterable[torch.Tensor], *, tol: object = None, histogram: object = False) -> StatsBatch:
    """stats_many() as the public call `op` makes it: every refusal names
    `op` and the tensor as tensors[i]."""
    xs = tensor_list(op, tensors, "; use zeroscan.stats(x)")
    tol = check_tol(op, tol)
    check_flag(op, "histogram", histogram)
    if not xs:
        return StatsBatch([])
    # The common case first: plain tensors on one device, one native call that
    # checks every tensor itself. Anything else it refuses -- None, mixed
    # devices, sparse or DTensor inputs -- takes the careful path below, which
    # names the offending argument or splits the work by device.
    # (A lazy parameter's __torch_function__ raises ValueError.) CPU tensors
    # of memory torch did not allocate take it too: they are read under the
    # SIGBUS guard (zeroscan.mapped_reads).
    # torch.compile cannot trace the native metadata reader (a C function of
    # Python objects); under it the metadata is read in Python, and traced away.
    metas = None if torch.compiler.is_compiling() else ops.tensor_metas(xs)
    readout: Readout | None = None
    if not (metas[2] if metas is not None else any_maybe_mapped(xs)):
        try:
            readout = _scan_many_now(xs, tol, histogram)
        except (RuntimeError, TypeError, ValueError):
            readout = None
    if readout is not None and not readout.buffer.is_meta:  # meta inputs reach the fake kernel
        # No Python object per tensor here: a dtype and shape read in Python
        # cost ~150 ns a tensor, plus the garbage collections their tuples set
        # off, and over 2,000 small tensors that alone took several times a
        # GPU's scan of one flat tensor of the same bytes
        # (benchmarks/bench_many_small.py). They are read natively now, and
        # each Stats is made from them when first indexed; the batch keeps no
        # tensor.
        return StatsBatch.lazy(len(xs), _stats_of_rows(readout, xs, tol, metas))
    xs = [require_readable(op, f"tensors[{i}]", x) for i, x in enumerate(xs)]
    items: list[Stats | None] = [None] * len(xs)
    for indices in device_groups(xs):
        group = [xs[i] for i in indices]
        named = [(f"tensors[{i}]", xs[i]) for i in indices]
        if any_maybe_mapped(group):
            rows, fields = guarded_rows(op, named, tol, histogram)
            readout = Readout(rows, fields)
            for row, i in enumerate(indices):
                items[i] = Stats(readout, row, meta_of(xs[i]), tol)
            continue
        try:
            readout = _scan_many_now(group, tol, histogram)
        except RuntimeError as e:
            refused(op, named, e)
        for row, i in enumerate(indices):
            items[i] = Stats(readout, row, meta_of(xs[i]), tol)
    return StatsBatch(items)  # type: ignore[arg-type]


def _stats_of_rows(
    readout: Readout, xs: list[torch.Tensor], tol: float | None, native: tuple[list[torch.dtype], bytes, bool] | None
) -> Callable[[int], Stats]:
    """What makes the Stats of row i of one native call over xs, from the
    tensors' dtypes and shapes at the call (`native`: ops.tensor_metas
    of xs, or None to read them here); it holds no tensor."""
    device = readout.buffer.device
    if native is None:  # compiling, or not every item a plain tensor with concrete sizes
        metas = [(x.dtype, x.shape, device) for x in xs]
        return lambda row: Stats(readout, row, metas[row], tol)
    dtypes, words, _ = native
    n = len(dtypes)
    # n + 1 offsets, then every tensor's sizes; listed on the first Stats
    # made, once: a numpy element read or slice per Stats took ~0.6 us.
    dims: list[int] | None = None

    def make(row: int) -> Stats:
        nonlocal dims
        if dims is None:
            dims = numpy.frombuffer(words, dtype="<i8").tolist()
        shape = torch.Size(dims[n + 1 + dims[row] : n + 1 + dims[row + 1]])
        return Stats(readout, row, (dtypes[row], shape, device), tol)

    return make


def _scan_many_now(xs: list[torch.Tensor], tol: float | None, histogram: bool) -> Readout:
    """The rows of stats_many (and histogram fields) of xs on one device,
    from C++ where they may be, as in _scan_now: torch.ops matches the list
    to the schema tensor by tensor, 0.05-0.2 us a tensor."""
    if _may_skip_torch_ops():
        out = ops.stats_many_call(xs, tol, histogram)
        if isinstance(out, tuple):
            return Readout(*out)
        if out is not None:
            return Readout(out)
    if histogram:
        rows, fields = ops.stats_many_hist(xs, tol)
        return Readout(rows, fields)
    return Readout(ops.stats_many(xs, tol))


def tensor_list(op: str, tensors: object, single_hint: str = "") -> list[torch.Tensor]:
    """`tensors` as a list, or the error naming the public call `op`: a
    single tensor, a str and anything not iterable are refused."""
    if isinstance(tensors, list):
        return tensors
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{op}: tensors must be a list of tensors, got a single tensor{single_hint}")
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise TypeError(f"{op}: tensors must be a list of tensors, got {type(tensors).__name__}")
    return list(tensors)


def check_flag(op: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be True or False, got {type(value).__name__} {value!r}")


def stats_many_mapped(
    tensors: Iterable[torch.Tensor], *, tol: float | None = None, histogram: bool = False
) -> tuple[StatsBatch, list[int]]:
    """stats_many of CPU tensors that view a memory-mapped file, and the
    indices of the tensors that could not be read.

    The tensors are read where they are mapped, with no copy. Another process
    may truncate the file meanwhile (a training job saving the checkpoint
    again), and reading a mapped page past the file's new end raises SIGBUS,
    which would kill the process; here it only marks the tensor being read:
    its index is listed and its Stats holds zeros, which the caller must not
    report (it names the tensor in an error instead). The other tensors'
    Stats are those of stats_many, bit for bit.
    """
    op = "zeroscan.stats_many_mapped"
    xs = tensor_list(op, tensors)
    tol = check_tol(op, tol)
    if not xs:
        return StatsBatch([]), []
    # As in stats_many, the native call checks every tensor itself; what it
    # refuses (None, a meta, sparse or quantized tensor) is then named here.
    try:
        rows, faulted, fields = ops.stats_many_mapped(xs, tol, histogram)
    except (RuntimeError, TypeError, ValueError) as e:
        refused(op, [(f"tensors[{i}]", x) for i, x in enumerate(xs)], e)
    if rows.is_meta:  # meta inputs reach the fake kernel
        refused(op, [(f"tensors[{i}]", x) for i, x in enumerate(xs)], RuntimeError(op))
    readout = Readout(rows, fields if histogram else None)
    metas = [(x.dtype, x.shape, rows.device) for x in xs]
    batch = StatsBatch.lazy(len(xs), lambda row: Stats(readout, row, metas[row], tol))
    return batch, faulted.nonzero().flatten().tolist()


def device_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The indices of `tensors` grouped by device, devices in order of first
    appearance and indices ascending within a group (scan_buffers' row order)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(tensors):
        by_device.setdefault(x.device, []).append(i)
    return list(by_device.values())


def scan_buffers(tensors: Iterable[torch.Tensor], *, tol: float | None = None) -> list[torch.Tensor]:
    """Scans every tensor and returns only the raw result buffers: one int64
    [N_g, 16] tensor per device group (see `device_groups` for the order).

    This is stats_many without the Python result objects: it calls only the
    native op, never reads a value back from a device and never synchronises,
    so it traces into one torch.compile(fullgraph=True) graph and can be
    captured in a CUDA graph. (CPU memory torch did not allocate, a file
    mapping, is scanned under the SIGBUS guard, which reads its one fault
    flag on the host: mapped_reads.py.) Turn a buffer into fields later with `decode`, or merge it across
    ranks with zeroscan.distributed.
    """
    op = "zeroscan.scan_buffers"
    xs = tensor_list(op, tensors)
    tol = check_tol(op, tol)
    return buffers_of(op, [check_tensor(op, "tensors", t, i) for i, t in enumerate(xs)], tol)


def buffers_of(
    op: str, xs: list[torch.Tensor], tol: float | None, names: Callable[[int], str] = lambda i: f"tensors[{i}]"
) -> list[torch.Tensor]:
    """scan_buffers of checked tensors, as the public call `op` makes it:
    a refusal names tensor i as names(i)."""
    buffers = []
    for group in device_groups(xs):
        tensors = [xs[i] for i in group]
        if any_maybe_mapped(tensors):  # read under the SIGBUS guard (zeroscan.mapped_reads)
            buffers.append(guarded_rows(op, [(names(i), xs[i]) for i in group], tol, False)[0])
            continue
        try:
            buffers.append(ops.stats_many(tensors, tol))
        except RuntimeError as e:  # a quantized or nested tensor, a dtype not read, freed memory
            refused(op, [(names(i), xs[i]) for i in group], e)
    return buffers
