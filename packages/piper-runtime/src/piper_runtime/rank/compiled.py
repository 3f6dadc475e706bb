"""Segments through torch.compile's stack (``ExecutionOptions.compile``): F, B, BI and BW as
compiled functions of their own.

Wrapping a segment's module in ``torch.compile`` gives AOTAutograd one fused backward node:
``BI`` (the gradients of the inputs) would run the whole backward and ``BW`` run it again.
So a segment is traced here instead, once per input signature (shapes, dtypes, which inputs
take a gradient), as one joint forward/backward graph of its parameters, buffers and inputs
(``aot_export_joint_simple``: aten operators, functionalized), which AOTAutograd's
``default_partition`` cuts into a forward ``F`` (the outputs plus what the backward reads,
its *residuals*) and a backward ``B`` (residuals and output gradients in, every gradient
out). ``split_backward`` cuts ``B`` once more, by which output each node feeds:

- ``BI``: the nodes the input gradients need; it returns those gradients and the *stash*,
  the intermediate results (say the gradient at a layer's output) that the weight gradients
  read;
- ``BW``: the rest, the nodes only the weight gradients need, from the stash and the
  residuals they read.

Every node of ``B`` runs once, in ``BI`` or in ``BW``, so the pair costs what ``B`` costs
(less what one compiled kernel could have fused across the cut; docs/compile.md has the
figures). ``F`` is compiled when the segment is traced, ``B`` or ``BI`` and ``BW`` when a plan
first runs them (``backend``: ``inductor``, or ``aot_eager``, which runs the traced aten
graphs as they are: the machinery without code generation); all are kept for the run, and
inductor's own on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) serves a restarted run. Each
inductor compile is said on stderr (``piper: compiled BI of segment s1 (inductor) in 1.9 s``)
and counted in ``CompileStats``.

Weight gradients added inside their product: a weight in ``fused`` (``nn.Linear``'s of
``grad_fusion_min_bytes`` or more, as in eager: ``piper_runtime.rank.accumulation``) whose
gradient the traced ``B`` or ``BW`` computes as one matrix product (under transposes only)
is returned as that product's two operands instead (``weight_products``), and the runtime
adds ``a @ b`` into ``.grad`` with one ``addmm_`` (``WeightProduct.add_into``): without it a
compiled backward returned each microbatch's gradient whole, and adding it into ``.grad``
took a pass over the weight of its own, which eager's fused layers do not pay.

Random numbers: inductor normally draws its own (Philox) numbers; here it is told to call
aten's random operators (``fallback_random``), which draw from the generators that
``piper_runtime.rank.randomness.seeded`` seeded, in the order the model draws them, so dropout
masks are eager's. Parameters and buffers are inputs of the compiled functions, not
constants: an optimizer step or a gathered ZeRO-3 shard is seen by the next call. A segment
that cannot be traced (a buffer updated in place, which capture refuses already; a collective
inside the forward) raises ``CompileError`` naming it.
"""

from __future__ import annotations

import operator
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence

import attrs
import torch
from torch import fx, nn

from piper_runtime.options import COMPILE_BACKENDS as BACKENDS
from piper_runtime.rank.accumulation import accumulates_into
from piper_runtime.rank.freed_memory import keep_freed_memory
from piper_runtime.rank.kernel_gil import releasing_gil

# Tracing and inductor are not thread-safe (global tracing state, config patches); ranks of
# the local runtime are threads of one process.
_COMPILE_LOCK = threading.Lock()

Signature = tuple[object, ...]
_MM = torch.ops.aten.mm.default
_TRANSPOSE = torch.ops.aten.t.default
Compiled = Callable[..., Sequence[torch.Tensor | None]]


@attrs.define
class CompileStats:
    """What compiling cost one rank: seconds and graphs compiled, by segment."""

    seconds: dict[str, float] = attrs.field(factory=dict)
    graphs: dict[str, int] = attrs.field(factory=dict)

    def add(self, segment: str, seconds: float, graphs: int = 1) -> None:
        self.seconds[segment] = self.seconds.get(segment, 0.0) + seconds
        self.graphs[segment] = self.graphs.get(segment, 0) + graphs

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def signature(args: Sequence[torch.Tensor], grads: Sequence[bool]) -> Signature:
    """What a compiled segment is specialised to: each input's shape, dtype, device and
    whether it takes a gradient (a program per piece shape gets one entry per shape)."""
    return tuple((tuple(a.shape), a.dtype, a.device, g) for a, g in zip(args, grads, strict=True))


@attrs.frozen
class WeightProduct:
    """A weight's gradient as the matrix product ``a @ b`` (``transposed``: its transpose),
    not yet computed: ``add_into`` computes it into the weight's ``.grad`` (module doc)."""

    a: torch.Tensor
    b: torch.Tensor
    transposed: bool

    def operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``x, y`` with ``x @ y`` the gradient itself: ``(a @ b).T`` is ``b.T @ a.T``."""
        return (self.b.t(), self.a.t()) if self.transposed else (self.a, self.b)

    def add_into(self, param: torch.Tensor) -> None:
        """``param.grad += x @ y`` in one kernel where the sum may take it in place (the rule of
        eager's deferred products, ``accumulation.accumulates_into``), else a new sum; a first
        gradient is the product itself, in the parameter's layout (as autograd makes one)."""
        x, y = self.operands()
        grad = param.grad
        if grad is None:
            product = torch.mm(x, y)
            param.grad = product if product.stride() == param.stride() else torch.empty_like(param).copy_(product)
        elif accumulates_into(grad, x, param):
            grad.addmm_(x, y)
        else:
            param.grad = grad + torch.mm(x, y)


class CompiledSegment:
    """One segment's F, B, BI and BW at one input signature (module doc)."""

    def __init__(
        self,
        segment: str,
        module: nn.Module,
        args: Sequence[torch.Tensor],
        arg_grads: Sequence[bool],
        backend: str,
        stats: CompileStats,
        cast: torch.dtype | None = None,
        fused: Collection[torch.Tensor] = (),
    ) -> None:
        """``fused``: the parameters whose gradients a backward returns as ``WeightProduct``
        where it computes them as one matrix product (module doc)."""
        self.segment = segment
        self.backend = backend
        self.stats = stats
        keep_freed_memory()  # compiled calls free and allocate their buffers every call (freed_memory)
        # Unique tensors (a name tied to another reads the same input); buffers after parameters.
        self.state: list[torch.Tensor] = []
        index: dict[int, int] = {}
        uses: list[tuple[str, int]] = []
        named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
        for name, t in named:
            if id(t) not in index:
                index[id(t)] = len(self.state)
                self.state.append(t)
            uses.append((name, index[id(t)]))
        self.params = [t for t in self.state if isinstance(t, nn.Parameter) and t.requires_grad]
        self.param_index = [i for i, t in enumerate(self.state) if isinstance(t, nn.Parameter) and t.requires_grad]
        n_state = len(self.state)
        self._clone_outputs = False  # set where an output aliases an input (``_trace``)

        def joint_fn(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # Each use of a name casts on its own, as ``cast_forward`` does (tied names too).
            values = {name: _cast(flat[i], cast) for name, i in uses}
            out = torch.func.functional_call(module, values, tuple(flat[n_state:]), strict=False, tie_weights=False)
            outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
            return tuple(o.clone() for o in outs) if self._clone_outputs else outs

        primals = [t.detach().requires_grad_(t.requires_grad and isinstance(t, nn.Parameter)) for t in self.state]
        primals += [a.detach().requires_grad_(g) for a, g in zip(args, arg_grads, strict=True)]
        started = time.perf_counter()
        with _COMPILE_LOCK:
            joint, n_outs = self._trace(joint_fn, primals)
            from torch._functorch.partitioners import default_partition

            try:
                self.fw_graph, self.bw_graph = default_partition(joint, primals, num_fwd_outputs=n_outs)
            except Exception as exc:  # the graph's, so the segment's: named
                raise CompileError(f"segment {segment} cannot be compiled ({type(exc).__name__}: "
                                   f"{_first_line(exc)}); run it without --compile") from exc
        self.n_outs = n_outs
        # The backward's inputs: the residuals F returns after its outputs, then one gradient
        # per output that takes one (``takes_grad``).
        bw_inputs = [n for n in self.bw_graph.graph.nodes if n.op == "placeholder"]
        self.tangent_vals = [n.meta["val"] for n in bw_inputs if n.name.startswith("tangents")]
        self.takes_grad = _takes_grad(joint_fn, primals, n_outs)
        if sum(self.takes_grad) != len(self.tangent_vals):
            raise CompileError(f"segment {segment} cannot be compiled: {sum(self.takes_grad)} differentiable "
                               f"outputs, {len(self.tangent_vals)} output gradients traced")
        self.input_slots = [n_state + k for k, g in enumerate(arg_grads) if g]
        self.weight_slots = self.param_index
        fused_ids = {id(t) for t in fused}
        self._fused = [j for j, t in enumerate(self.params) if id(t) in fused_ids]  # positions in ``params``
        self._b_products: list[tuple[int, bool]] = []  # (position in ``params``, transposed), B's extra outputs
        self._bw_products: list[tuple[int, bool]] = []  # the same for BW
        stats.add(segment, time.perf_counter() - started, graphs=0)
        # F now, outside any seeded region (compiling must not draw from its generators).
        self._f: Compiled = self._compile(self.fw_graph, "F")
        self._b: Compiled | None = None
        self._bi: Compiled | None = None
        self._bw: Compiled | None = None
        self._bw_inputs: list[int] = []  # the residual/tangent positions BW reads

    def _trace(self, fn: Callable[..., tuple[torch.Tensor, ...]], primals: list[torch.Tensor]) -> tuple[fx.GraphModule, int]:
        from torch._functorch.aot_autograd import aot_export_joint_simple

        try:
            try:
                joint = aot_export_joint_simple(fn, tuple(primals), trace_joint=True)
            except RuntimeError as exc:
                if "alias" not in str(exc):
                    raise
                self._clone_outputs = True  # an output is (a view of) an input: hand out a copy
                joint = aot_export_joint_simple(fn, tuple(primals), trace_joint=True)
        except Exception as exc:  # any tracing failure is the segment's: named
            raise CompileError(f"segment {self.segment} cannot be compiled ({type(exc).__name__}: "
                               f"{_first_line(exc)}); run it without --compile") from exc
        outputs = _outputs(joint)
        return joint, len(outputs) - (len(primals))

    # -- the four functions ----------------------------------------------------------------------------

    def _compile(self, gm: fx.GraphModule, what: str) -> Compiled:
        started = time.perf_counter()
        with _COMPILE_LOCK:
            fn = compile_graph(gm, self.backend)
        seconds = time.perf_counter() - started
        self.stats.add(self.segment, seconds)
        if self.backend == "inductor":
            print(f"piper: compiled {what} of segment {self.segment} ({self.backend}) in {seconds:.1f} s",
                  file=sys.stderr, flush=True)
        return fn

    def forward(self, args: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs and the residuals the backward reads (no autograd)."""
        with torch.no_grad():
            result = list(self._f(*[t.detach() for t in self.state], *args))
        return result[: self.n_outs], result[self.n_outs:]

    def tangents(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The backward's output gradients: ``grads``, one per output that takes one
        (``takes_grad``), zeros where none arrived."""
        return [_example(v) if g is None else g for g, v in zip(grads, self.tangent_vals, strict=True)]

    def backward(self, residuals: list[torch.Tensor], tangents: list[torch.Tensor]) -> tuple[list, list]:
        """B: (input gradients, weight gradients) from one call."""
        if self._b is None:
            gm, self._b_products = weight_products(self.bw_graph, [self.weight_slots[j] for j in self._fused])
            self._b_products = [(self.weight_slots.index(slot), t) for slot, t in self._b_products]
            self._b = self._compile(gm, "B")
        with torch.no_grad():
            grads = list(self._b(*residuals, *tangents))
        weights = _with_products([grads[i] for i in self.weight_slots], grads, self._b_products)
        return [grads[i] for i in self.input_slots], weights

    def backward_input(self, residuals: list[torch.Tensor], tangents: list[torch.Tensor]) -> tuple[list, list]:
        """BI: (input gradients, what BW reads)."""
        if self._bi is None:
            bi, bw, self._bw_inputs = split_backward(self.bw_graph, self.input_slots, self.weight_slots)
            bw, self._bw_products = weight_products(bw, self._fused)
            self._bi = self._compile(bi, "BI")
            self._bw = self._compile(bw, "BW")
        inputs = [*residuals, *tangents]
        with torch.no_grad():
            result = list(self._bi(*inputs))
        n = len(self.input_slots)
        return result[:n], [inputs[i] for i in self._bw_inputs] + result[n:]

    def backward_weight(self, pending: list[torch.Tensor]) -> list[torch.Tensor | WeightProduct | None]:
        """BW: the weight gradients from what ``backward_input`` handed on."""
        assert self._bw is not None, "BW before BI"
        with torch.no_grad():
            grads = list(self._bw(*pending))
        return _with_products(grads[: len(self.params)], grads, self._bw_products)


def _with_products(weights: list, outputs: list, products: Sequence[tuple[int, bool]]) -> list:
    """``weights`` with the gradient of each parameter in ``products`` (its position, and
    whether transposed) as the ``WeightProduct`` of the two operands that end ``outputs``."""
    if products:
        extra = outputs[len(outputs) - 2 * len(products):]
        for k, (j, transposed) in enumerate(products):
            weights[j] = WeightProduct(extra[2 * k], extra[2 * k + 1], transposed)
    return weights


def weight_products(gm: fx.GraphModule, slots: Sequence[int]) -> tuple[fx.GraphModule, list[tuple[int, bool]]]:
    """``gm`` with each output at ``slots`` that is one matrix product (``aten.mm``, seen
    through transposes only, no other user of any of them) returned as its two operands
    instead: that output becomes ``None`` and the operands follow the outputs, in the order
    of the returned ``(slot, transposed)`` pairs. ``gm`` itself is left as it is; without
    such an output it is returned as it is."""
    results = _outputs(gm)
    found: list[tuple[int, fx.Node, bool]] = []
    for slot in slots:
        node, transposed = results[slot], False
        if not isinstance(node, fx.Node) or sum(r is node for r in results) != 1 or len(node.users) != 1:
            continue
        while node.target is _TRANSPOSE and len(node.users) == 1:
            node, transposed = node.args[0], not transposed
        if node.target is _MM and len(node.users) == 1:
            found.append((slot, node, transposed))
    if not found:
        return gm, []
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(gm.graph, env)
    fused = {slot for slot, _, _ in found}
    outs = [None if k in fused else (env[r] if isinstance(r, fx.Node) else r) for k, r in enumerate(results)]
    outs += [env[operand] for _, mm, _ in found for operand in mm.args]
    graph.output(tuple(outs))
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph), [(slot, transposed) for slot, _, transposed in found]


class CompileError(RuntimeError):
    """A segment that cannot be traced or compiled (names it)."""


def compile_graph(gm: fx.GraphModule, backend: str) -> Compiled:
    """``gm`` (an aten graph) as a callable: inductor's code for it, or the graph itself."""
    if backend not in BACKENDS:
        raise ValueError(f"compile backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "aot_eager":
        return gm
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    example = [_example(n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"]
    with config.patch(fallback_random=True), releasing_gil():
        return compile_fx(gm, example)


def split_backward(bw: fx.GraphModule, input_slots: Sequence[int], weight_slots: Sequence[int]
                   ) -> tuple[fx.GraphModule, fx.GraphModule, list[int]]:
    """``bw`` cut in two (module doc): ``BI(*bw inputs) -> (*input grads, *stash)`` and
    ``BW(*bw inputs it reads, *stash) -> weight grads`` (``None`` where ``bw`` has none), and
    the positions of the ``bw`` inputs that BW reads."""
    nodes = list(bw.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    results = _outputs(bw)
    bi_roots = [results[i] for i in input_slots]
    bw_roots = [results[i] for i in weight_slots]
    bi = _ancestors(r for r in bi_roots if isinstance(r, fx.Node))
    # A multi-output node's items go with it: the stash holds tensors only.
    for n in list(bi):
        bi.update(u for u in n.users if u.op == "call_function" and u.target is operator.getitem)
    weight_only = _ancestors((r for r in bw_roots if isinstance(r, fx.Node)), stop=bi)
    order = {n: k for k, n in enumerate(nodes)}

    def reads(n: fx.Node) -> Iterable[fx.Node]:
        return n.all_input_nodes

    outside = {d for n in weight_only for d in reads(n) if d not in weight_only}
    outside |= {r for r in bw_roots if isinstance(r, fx.Node) and r not in weight_only}
    stash = sorted((n for n in outside if n in bi), key=order.__getitem__)
    inputs = sorted((n for n in outside if n.op == "placeholder"), key=order.__getitem__)

    g_bi = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in placeholders:
        env[n] = g_bi.node_copy(n, env.__getitem__)
    for n in nodes:
        if n in bi:
            env[n] = g_bi.node_copy(n, env.__getitem__)
    g_bi.output(tuple(env[r] if isinstance(r, fx.Node) else r for r in bi_roots) + tuple(env[n] for n in stash))

    g_bw = fx.Graph()
    env = {}
    for n in (*inputs, *stash):
        env[n] = g_bw.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in nodes:
        if n in weight_only:
            env[n] = g_bw.node_copy(n, env.__getitem__)
    g_bw.output(tuple(env[r] if isinstance(r, fx.Node) else r for r in bw_roots))
    return (fx.GraphModule(bw, g_bi), fx.GraphModule(bw, g_bw), [placeholders.index(n) for n in inputs])


def _ancestors(roots: Iterable[fx.Node], stop: set[fx.Node] | None = None) -> set[fx.Node]:
    """The non-placeholder nodes ``roots`` are computed from (``roots`` included), not
    entering ``stop``."""
    stop = stop or set()
    seen: set[fx.Node] = set()
    todo = [r for r in roots if r not in stop]
    while todo:
        n = todo.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        todo.extend(d for d in n.all_input_nodes if d not in stop)
    return seen


def _outputs(gm: fx.GraphModule) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    (values,) = out.args
    return list(values) if isinstance(values, list | tuple) else [values]


def _takes_grad(fn: Callable[..., tuple[torch.Tensor, ...]], primals: Sequence[torch.Tensor], n_outs: int
                ) -> list[bool]:
    """Which of ``fn``'s outputs take a gradient: ``fn`` run once on meta copies (no data,
    no random numbers drawn)."""
    meta = [p.detach().to("meta").requires_grad_(p.requires_grad) for p in primals]
    with torch.enable_grad():
        outs = fn(*meta)
    assert len(outs) == n_outs
    return [o.requires_grad for o in outs]


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _example(val: object) -> object:
    """A real tensor like the fake one tracing recorded (shape, strides, dtype, device)."""
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device).zero_()
    return val


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
