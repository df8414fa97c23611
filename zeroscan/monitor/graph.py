"""Reading the autograd graph and the hooks on it, for the cause analysis.

A forward pass leaves, behind each output, a graph of `Node`s whose
`next_functions` lead to one `AccumulateGrad` leaf per parameter
(`AccumulateGrad.variable`). The walks here say which parameters an output
reaches, and which custom `autograd.Function`s (a user's, or the one that
runs a torch.compile graph) sit on the way to a parameter: a Function whose
backward returns None for an input cuts the graph there although the walk
still reaches the parameter. Hooks that can change a gradient on its way
(tensor hooks, post-accumulate-grad hooks, a module's backward hooks) are
listed with where they were defined, leaving out torch's own and zeroscan's.

A walk follows a way from the outputs at most MAX_WALK_DEPTH nodes deep,
and raises TooDeep past it; what asked then says nothing (see TooDeep).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import cached_property
from typing import Any, NamedTuple

import torch
from torch import nn

Node = Any  # torch.autograd.graph.Node; the C++ node classes share no Python base
MAX_WALK_DEPTH = 6000  # nodes on one way from the outputs that a walk follows


class TooDeep(RuntimeError):
    """A way from the outputs runs past MAX_WALK_DEPTH nodes (a cell unrolled
    thousands of times). Reading a node from Python gives it a Python object
    that it then owns, and torch 2.13 frees a chain of such nodes
    recursively, one level of the C stack per node: a walk down a chain of
    30,000 overflows an 8 MB stack when the graph is freed (15,000 did not,
    here). So the walk stops, and the analysis that asked answers nothing
    rather than something a partial walk would make up."""


class Root(NamedTuple):
    """One output of the model's forward pass that carries a graph: where it
    sits in the output (`label`: "the output", "output[1]", "output['aux']")
    and its grad_fn."""

    label: str
    node: Node


def output_roots(
    output: Any, found: list[Root], tensors: list[torch.Tensor], label: str = "the output", depth: int = 0
) -> None:
    """Appends a Root for every tensor with a grad_fn in `output` (nested
    lists, tuples and dicts, 4 levels deep), and the tensor to `tensors`."""
    if isinstance(output, torch.Tensor):
        if output.grad_fn is not None:
            found.append(Root(label, own_node(output)))
            tensors.append(output)
        return
    if depth >= 4:
        return
    base = "output" if label == "the output" else label
    if isinstance(output, (list, tuple)):
        for k, o in enumerate(output):
            output_roots(o, found, tensors, f"{base}[{k}]", depth + 1)
    elif isinstance(output, dict):
        for key, o in output.items():
            output_roots(o, found, tensors, f"{base}[{key!r}]", depth + 1)


def own_node(output: torch.Tensor) -> Node:
    """The node behind one output tensor. DDP passes all outputs through one
    Function of its own (a sink, output k its input k), whose node would
    make every output reach every parameter: the node behind its input is
    the output's own."""
    node = output.grad_fn
    forward = getattr(node, "_forward_cls", None)
    if forward is not None and (getattr(forward, "__module__", "") or "").startswith("torch.nn.parallel"):
        edges = node.next_functions
        if output.output_nr < len(edges) and edges[output.output_nr][0] is not None:
            return edges[output.output_nr][0]
    return node


def nodes_behind(nodes: Iterable[Node], *, through_functions: bool = True) -> Iterator[Node]:
    """Every node of the graph behind `nodes`, each once (depth first, with a
    stack: graphs are deep); with through_functions=False, a custom
    autograd.Function's node (see function_kind) is the last on its way."""
    seen: set[int] = set()
    stack = [(node, 1) for node in nodes]
    while stack:
        node, depth = stack.pop()
        if id(node) in seen:
            continue
        if depth > MAX_WALK_DEPTH:
            raise TooDeep(f"a way from the outputs runs past {MAX_WALK_DEPTH} nodes")
        seen.add(id(node))
        yield node
        if not through_functions and function_kind(node) is not None:
            continue
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None and id(nxt) not in seen:
                stack.append((nxt, depth + 1))


def reachable(nodes: Iterable[Node], pindex: dict[int, int], *, through_functions: bool = True) -> set[int]:
    """The parameters (indices by id of the tensor, `pindex`) that the graph
    behind `nodes` reaches; with through_functions=False, without going
    behind a custom autograd.Function (see function_kind)."""
    found: set[int] = set()
    for node in nodes_behind(nodes, through_functions=through_functions):
        var = getattr(node, "variable", None)
        if var is not None:
            i = pindex.get(id(var))
            if i is not None:
                found.add(i)
    return found


class Crossing(NamedTuple):
    """A custom autograd.Function on the way from the outputs to a parameter:
    its name, the input (0-based) through which the way goes on, and whether
    it runs a torch.compile graph."""

    name: str
    input: int
    compiled: bool


MAX_FUNCTIONS = 64  # custom Function nodes looked behind, per question (one walk per input of each)


def crossings(roots: Iterable[Node], targets: set[int], pindex: dict[int, int]) -> dict[int, list[Crossing]]:
    """For each parameter of `targets` that a custom autograd.Function in
    the graph behind `roots` leads to: those Functions, and through which
    input (torch's own pass-through Functions, such as FSDP's and the
    module-hook ones, left out). One walk of the graph, and one more behind
    each input of each such Function: a graph without any costs one walk."""
    functions = []
    for node in nodes_behind(roots):
        kind = function_kind(node)
        if kind is not None and len(functions) < MAX_FUNCTIONS:
            functions.append((node, kind))
    out: dict[int, list[Crossing]] = {}
    for node, (name, compiled) in functions:
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is not None:
                for i in reachable([nxt], pindex) & targets:
                    out.setdefault(i, []).append(Crossing(name, k, compiled))
    return out


def function_kind(node: Node) -> tuple[str, bool] | None:
    """(the Function's name, whether it runs a torch.compile graph) for the
    node of a custom autograd.Function that is not one of torch's own
    pass-through Functions; None for any other node."""
    forward = getattr(node, "_forward_cls", None)
    if forward is None:
        return None
    module = getattr(forward, "__module__", "") or ""
    if module.startswith("torch._functorch") or module.startswith("torch._dynamo"):
        return "the torch.compile graph", True
    if module.startswith("torch.") or module.startswith("zeroscan."):
        return None
    return getattr(forward, "__qualname__", type(node).__name__), False


# Backward nodes of the ops whose result does not change when their input moves by a shift
# they normalize away: softmax along its dimension, a norm by the mean it subtracts. By a
# fragment of the node's class name, lower-cased (log_softmax before softmax), across
# devices and torch versions (NativeBatchNormBackward0, CudnnBatchNormBackward0, ...).
NORMALIZERS = (
    ("logsoftmax", "log_softmax"),
    ("softmax", "softmax"),
    ("scaleddotproduct", "scaled_dot_product_attention"),
    ("batchnorm", "batch norm"),
    ("groupnorm", "group norm"),
    ("layernorm", "layer norm"),
)
COMPILED_GATE = "a torch.compile graph"  # hides which ops are on the way


def normalizer_kind(node: Node) -> str | None:
    """The normalizing op (NORMALIZERS) a backward node is, a compiled graph, or None."""
    name = type(node).__name__.lower()
    for fragment, words in NORMALIZERS:
        if fragment in name:
            return words
    kind = function_kind(node)
    return COMPILED_GATE if kind is not None and kind[1] else None


def normalizer_gates(roots: Iterable[Node], pindex: dict[int, int]) -> dict[int, frozenset[str]]:
    """For each parameter (indices by id of the tensor, `pindex`) that every
    way from `roots` reaches only through a normalizing op (or a compiled
    graph, which hides its ops): the nearest such ops on those ways. One walk
    that carries the nearest op seen so far, so each node is visited once per
    kind (a handful), not once per way."""
    kinds: dict[int, set[str | None]] = {}
    seen: set[tuple[int, str | None]] = set()
    held: list[Node] = []  # visited nodes stay alive during the walk, so that their ids stay theirs
    stack: list[tuple[Node, str | None, int]] = [(node, None, 1) for node in roots]
    while stack:
        node, gate, depth = stack.pop()
        if (id(node), gate) in seen:
            continue
        if depth > MAX_WALK_DEPTH:
            raise TooDeep(f"a way from the outputs runs past {MAX_WALK_DEPTH} nodes")
        seen.add((id(node), gate))
        held.append(node)
        var = getattr(node, "variable", None)
        if var is not None and (i := pindex.get(id(var))) is not None:
            kinds.setdefault(i, set()).add(gate)
        below = normalizer_kind(node) or gate
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None and (id(nxt), below) not in seen:
                stack.append((nxt, below, depth + 1))
    return {i: frozenset(k for k in found if k is not None) for i, found in kinds.items() if None not in found}


def hook_label(hook: Callable[..., Any]) -> str:
    """A hook as messages name it: its qualified name and where it was defined."""
    fn = getattr(hook, "func", hook)  # a functools.partial names its function
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    code = getattr(fn, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def user_hooks(hooks: Any) -> list[Callable[..., Any]]:
    """The hooks of one hook dict that are neither torch's own nor zeroscan's."""
    if not isinstance(hooks, dict):
        return []
    out = []
    for hook in hooks.values():
        fn = getattr(hook, "func", hook)
        module = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "") or ""
        if not (module.startswith("torch.") or module.startswith("zeroscan.")):
            out.append(hook)
    return out


def tensor_hooks(p: torch.Tensor) -> list[tuple[str, Callable[..., Any]]]:
    """The user's hooks on parameter `p`: register_hook (which sees its
    gradient before it is accumulated) and register_post_accumulate_grad_hook."""
    found = [("register_hook", h) for h in user_hooks(getattr(p, "_backward_hooks", None))]
    found += [
        ("register_post_accumulate_grad_hook", h)
        for h in user_hooks(getattr(p, "_post_accumulate_grad_hooks", None))
    ]
    return found


def module_backward_hooks(module: nn.Module) -> list[tuple[str, Callable[..., Any]]]:
    """The user's backward hooks on `module`: full backward hooks (which may
    change the gradient of its inputs) and backward pre-hooks (which may
    change the gradient of its output)."""
    found = [("register_full_backward_hook", h) for h in user_hooks(getattr(module, "_backward_hooks", None))]
    found += [
        ("register_full_backward_pre_hook", h) for h in user_hooks(getattr(module, "_backward_pre_hooks", None))
    ]
    return found


class GraphView:
    """The graph behind one step's outputs, as the cause analysis asks about
    the parameters `targets` (indices): each answer is computed when first
    asked (a graph walk or a few), so a question never asked costs nothing.

    roots: the outputs; fired: those a gradient reached (by position);
    loss: the loss's grad_fn when Monitor.step(loss) gave one; index: ids of
    tensors to parameter indices, wrappers' stand-ins included; own: the
    parameters' own tensors only.
    """

    def __init__(
        self, roots: list[Root], fired: set[int], loss: Node | None, index: dict[int, int], own: dict[int, int],
        targets: set[int],
    ) -> None:
        self.roots = roots
        self.fired = fired
        self.loss = loss
        self.index = index
        self.own_index = own
        self.targets = targets

    @cached_property
    def nodes(self) -> list[Node]:
        """Every output's node, and the loss's."""
        return [r.node for r in self.roots] + ([self.loss] if self.loss is not None else [])

    @cached_property
    def through(self) -> list[Node]:
        """The nodes backward went through: the loss's, else the outputs' that
        a gradient reached (all of them when that is not known)."""
        if self.loss is not None:
            return [self.loss]
        return [r.node for k, r in enumerate(self.roots) if k in self.fired] or [r.node for r in self.roots]

    @cached_property
    def reached(self) -> set[int]:
        """Reached from the outputs."""
        return reachable([r.node for r in self.roots], self.index)

    @cached_property
    def from_loss(self) -> set[int] | None:
        """Reached from the loss; None without one."""
        return None if self.loss is None else reachable([self.loss], self.index)

    @property
    def some_left_out(self) -> bool:
        """Whether backward went through some of the outputs and not others."""
        return self.loss is None and 0 < len(self.fired) < len(self.roots)

    @cached_property
    def from_fired(self) -> set[int]:
        """Reached from the outputs that backward went through."""
        return reachable(self.through, self.index)

    @cached_property
    def left_out(self) -> dict[int, list[str]]:
        """For each parameter, the outputs backward never went through that reach it."""
        out: dict[int, list[str]] = {}
        for k, r in enumerate(self.roots):
            if k not in self.fired:
                for i in reachable([r.node], self.index) & self.targets:
                    out.setdefault(i, []).append(r.label)
        return out

    @cached_property
    def own(self) -> set[int]:
        """Reached, from where backward went, as the parameters' own tensors
        (under FSDP2 the graph holds unsharded stand-ins instead)."""
        return reachable(self.through, self.own_index)

    @cached_property
    def crossings(self) -> dict[int, list[Crossing]]:
        """The custom Functions on the way from where backward went to each target."""
        return crossings(self.through, self.targets, self.index)

    @cached_property
    def free(self) -> set[int]:
        """Reached from where backward went without going behind any custom
        Function: a parameter not in it has a Function on every way to it."""
        return reachable(self.through, self.index, through_functions=False)

    @cached_property
    def root_reach(self) -> list[set[int]]:
        """Reached from each output, in order."""
        return [reachable([r.node], self.index) for r in self.roots]

    def without_graph(self) -> GraphView:
        """This view with what explain_zeros asks worked out now, holding no
        node of the graph (a closed Monitor keeps no graph alive)."""
        for name in ("root_reach", "crossings", "free"):
            getattr(self, name)
        self.roots = [Root(r.label, None) for r in self.roots]
        self.__dict__.update(nodes=[], through=[])
        return self
