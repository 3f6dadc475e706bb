"""Sequence parallelism: the code between tensor-parallel regions on sequence shards (torch side).

Megatron-LM's sequence parallelism, as a second rewrite of a segment ``shard_code`` has cut
(``Sharding.sequence_parallel``). Between the tensor-parallel regions (a column group's or
pair's ``f`` ... ``g``) every rank of the group holds the *whole* activation and runs the
same norms, residual adds and dropout; here each rank runs them on its ``1/degree`` of the
sequence instead:

- a row's ``g`` (all-reduce) and a vocabulary-cut embedding's become a reduce-scatter along
  the sequence (``"sp_scatter"``; backward: all-gather);
- a column's (or vocabulary head's) ``f`` becomes an all-gather along the sequence
  (``"sp_gather"``; backward: reduce-scatter of the partial gradients); where only Linears
  read it, it and they become one ``gathered_linears`` call, which keeps the rank's slice for
  the backward and gathers it again there (Megatron's trade: one more all-gather, not the
  whole input kept per microbatch);
- a replicated column (key/value heads the degree does not divide: its output meets the cut
  ones through a ``"local"`` narrowing) reads its input whole (``"sp_collect"``);
- a size the code reads of the sequence axis of a slice (``x.size(1)``) is scaled back to the
  whole sequence's (``sequence_length``);
- the *zone*, every node reached from those sources through code outside the tensor-parallel
  regions, must act per position along the sequence (element-wise with broadcasting,
  reductions and norms over later axes, dropout, uncut Linears); anything else (a
  cumulative sum, a reshape that moves the sequence, attention outside a cut group) is refused,
  naming the operation, its module and line;
- the sequence axis is the second-to-last of the row's output (``(batch, seq, hidden)``); its
  length must divide by the degree (refused otherwise, naming the source);
- whole tensors meeting the zone: the segment's activation inputs and any tensor that has the
  full sequence on the aligned axis are narrowed to the rank's slice (``"sp_split"``;
  backward: all-gather), so a stage's first norm already runs on the slice; every other whole
  tensor (norm weights, biases, uncut Linear weights) is read through ``f``: computed on a
  slice, its gradient is partial and ``f``'s backward sums it over the group (one small
  all-reduce per such parameter per backward);
- dropout in the zone draws single-device training's mask: every rank of a group has the
  same generator state (``piper_semantics.randomness``: the data-parallel replica's), draws
  the mask of the whole activation and keeps its slice (``sequence_dropout``);
- the segment's outputs in the zone are all-gathered (``"sp_collect"``; backward: the rank's
  slice of the gradient, which is whole and equal on every rank): pipeline boundaries carry
  whole activations, so SEND/RECV, the next stage's (or the loss's) code and the memory plan
  of a boundary are those of tensor parallelism without SP.

Collectives run on the communicator's ``all_gather`` / ``reduce_scatter`` (rows of dimension
0, in group order), the sequence axis moved first.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from piper_directives.diagnose import describe
from piper_directives.shard_heads import op_name
from piper_ir import DirectiveError, Sharding

SP_OPS = ("sp_gather", "sp_scatter", "sp_split", "sp_collect")

# Per position along every axis: element-wise with broadcasting (the sequence axis stays).
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "log", "pow", "rsqrt",
    "sqrt", "to", "_to_copy", "type_as", "contiguous", "clone", "alias", "detach", "float", "double", "half",
    "bfloat16", "type", "abs", "square", "reciprocal", "erf", "mish", "softplus", "rsub", "truediv", "floordiv",
    "iadd", "imul", "_assert_tensor_metadata", "lift_fresh_copy", "masked_fill", "where", "gelu_", "silu_",
    "relu_", "tanh_", "clamp", "clamp_min", "clamp_max", "maximum", "minimum",
})
_REDUCE = frozenset({"mean", "sum", "amax", "amin", "var", "std", "norm", "softmax", "log_softmax", "_softmax",
                     "_log_softmax"})
_NORMS = frozenset({"layer_norm", "rms_norm", "group_norm_last"})
_DROPOUT = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout"})
_PARAMETER_FREE = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Mish, nn.Softplus)


def collective(comm: nn.Module, x: torch.Tensor, op: str, dim: int) -> torch.Tensor:
    """``TensorParallelComm``'s sequence-parallel ops (module doc); unbound: the identity."""
    if not comm.bound:
        return x
    fn = {"sp_gather": _Gather, "sp_scatter": _Scatter, "sp_split": _Split, "sp_collect": _Collect}[op]
    return fn.apply(x, comm, dim)


def _all_gather(comm: nn.Module, x: torch.Tensor, dim: int, backward: bool) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] * comm.degree, *moved.shape[1:]))
    comm.timed((comm.backward_comm if backward else comm.comm).all_gather, out, moved)
    return out.movedim(0, dim)


def _reduce_scatter(comm: nn.Module, x: torch.Tensor, dim: int, backward: bool) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // comm.degree, *moved.shape[1:]))
    comm.timed((comm.backward_comm if backward else comm.comm).reduce_scatter, out, moved)
    return out.movedim(0, dim)


def _slice(comm: nn.Module, x: torch.Tensor, dim: int) -> torch.Tensor:
    n = x.shape[dim] // comm.degree
    return x.narrow(dim, comm.position * n, n).contiguous()


class _Gather(torch.autograd.Function):
    """All-gather forward, reduce-scatter backward: a column's input (its gradient partial)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: nn.Module, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(comm, x, dim, False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return _reduce_scatter(ctx.comm, grad, ctx.dim, True), None, None


class _Scatter(torch.autograd.Function):
    """Reduce-scatter forward (a row's partial products), all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: nn.Module, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(comm, x, dim, False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return _all_gather(ctx.comm, grad, ctx.dim, True), None, None


class _Split(torch.autograd.Function):
    """The rank's slice of a whole tensor; backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: nn.Module, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _slice(comm, x, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return _all_gather(ctx.comm, grad, ctx.dim, True), None, None


class _Collect(torch.autograd.Function):
    """All-gather forward into a whole tensor every rank uses alike; backward: the slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: nn.Module, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(comm, x, dim, False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return _slice(ctx.comm, grad, ctx.dim), None, None


class _GatheredLinears(torch.autograd.Function):
    """Column Linears reading one all-gathered input, keeping only the rank's slice for
    their backward (Megatron's): the backward gathers it again for the weight gradients and
    reduce-scatters the input gradient, summed over the columns."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: nn.Module, dim: int, *weights: torch.Tensor | None) -> tuple:
        full = _all_gather(comm, x, dim, False)
        pairs = list(zip(weights[0::2], weights[1::2], strict=True))
        ctx.comm, ctx.dim, ctx.biased = comm, dim, [b is not None for _, b in pairs]
        ctx.save_for_backward(x, *(w for w, _ in pairs))
        return tuple(F.linear(full, w, b) for w, b in pairs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        x, *ws = ctx.saved_tensors
        full = _all_gather(ctx.comm, x, ctx.dim, True).flatten(0, -2)
        grad_in, out = None, []
        for g, w, biased in zip(grads, ws, ctx.biased, strict=True):
            if g is None:
                out += [None, None]
                continue
            part = g.matmul(w.to(g.dtype))  # under autocast the output's dtype, not the weight's
            grad_in = part if grad_in is None else grad_in + part
            flat = g.flatten(0, -2)
            out += [flat.t().matmul(full.to(flat.dtype)).to(w.dtype), flat.sum(0).to(w.dtype) if biased else None]
        grad_x = None if grad_in is None else _reduce_scatter(ctx.comm, grad_in.to(x.dtype), ctx.dim, True)
        return (grad_x, None, None, *out)


def gathered_linears(comm: nn.Module, x: torch.Tensor, dim: int, *weights: torch.Tensor | None) -> tuple:
    """``F.linear(all_gather(x), w, b)`` for each ``(w, b)`` of ``weights`` (a flat
    sequence), keeping ``x``'s slice, not the gathered input, for the backward. Unbound:
    the Linears on ``x``."""
    if not comm.bound:
        return tuple(F.linear(x, w, b) for w, b in zip(weights[0::2], weights[1::2], strict=True))
    return _GatheredLinears.apply(x, comm, dim, *weights)


def _fuse_gathers(gm: torch.fx.GraphModule, comm: str) -> None:
    """Each ``sp_gather`` read only by Linears (as their input) becomes one
    ``gathered_linears`` call: the ranks keep their slice of the input, not the gathered one."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    for node in [n for n in g.nodes if _comm_op(n, comm) == "sp_gather"]:
        users = sorted(node.users, key=order.__getitem__)
        names = [_linear_params(gm, u, node) for u in users]
        if not users or any(p is None for p in names):
            continue
        with g.inserting_before(users[0]):
            flat = [g.get_attr(name) if name is not None else None for pair in names for name in pair]
            call = g.call_function(gathered_linears, (g.get_attr(comm), node.args[0], node.args[2], *flat))
            for i, u in enumerate(users):
                item = g.call_function(operator.getitem, (call, i))
                u.replace_all_uses_with(item)
        for u in users:
            g.erase_node(u)
        g.erase_node(node)


def _linear_params(gm: torch.fx.GraphModule, u: torch.fx.Node, x: torch.fx.Node) -> tuple[str, str | None] | None:
    """The weight and bias names of Linear call ``u`` reading ``x`` as its input, or None."""
    if not u.args or u.args[0] is not x or any(a is x for a in [*u.args[1:], *u.kwargs.values()]):
        return None
    if u.op == "call_module":
        m = gm.get_submodule(u.target)
        if type(m) is not nn.Linear:
            return None
        return f"{u.target}.weight", (f"{u.target}.bias" if m.bias is not None else None)
    if u.op != "call_function" or op_name(u.target) != "linear" or len(u.args) < 2:
        return None
    w = u.args[1]
    b = u.args[2] if len(u.args) > 2 else u.kwargs.get("bias")
    if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"):
        return None
    if b is not None and not (isinstance(b, torch.fx.Node) and b.op == "get_attr"):
        return None
    return str(w.target), (str(b.target) if b is not None else None)


def sequence_dropout(comm: nn.Module, x: torch.Tensor, p: float, dim: int, training: bool = True) -> torch.Tensor:
    """Dropout of a sequence slice with single-device training's mask: the whole
    activation's mask is drawn (the same generator state on every rank of the group) and the
    rank's slice kept. Unbound (one rank): ``F.dropout``."""
    if not (training and comm.training) or p == 0:
        return x
    if not comm.bound:
        return F.dropout(x, p, True)
    shape = list(x.shape)
    shape[dim] *= comm.degree
    noise = F.dropout(torch.ones(shape, dtype=x.dtype, device=x.device), p, True)
    return x * noise.narrow(dim, comm.position * x.shape[dim], x.shape[dim])


def sequence_length(comm: nn.Module, length: int) -> int:
    """The whole sequence's length, from a shard's (a size the code reads of the sequence axis)."""
    return length * comm.degree if comm.bound else length


def _shape(n: object) -> tuple[int, ...] | None:
    meta = n.meta.get("tensor_meta") if isinstance(n, torch.fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _comm_op(n: torch.fx.Node, comm: str) -> str | None:
    if n.op == "call_module" and n.target == comm and len(n.args) > 1:
        return n.args[1]
    return None


def _dims(n: torch.fx.Node) -> list[int] | None:
    """The reduced axes of a reduction (or the axis of a softmax); None: every axis."""
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    if dim is None:
        return None
    return list(dim) if isinstance(dim, list | tuple) else [dim]


def rewrite(gm: torch.fx.GraphModule, sh: Sharding, comm: str) -> int:
    """Rewrite ``gm`` (already tensor-parallel, nodes carrying full shapes) for sequence
    parallelism (module doc); the number of zone sources (reduce-scatters per forward)."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    refuse = _refuser(sh)
    # The tensor-parallel regions: reached from an f (or a local narrowing) without passing a g.
    region: set[torch.fx.Node] = set()
    todo = [n for n in g.nodes if _comm_op(n, comm) in ("f", "local")]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in region and _comm_op(u, comm) != "g" and u.op != "output" and not _is_embedding(u):
                region.add(u)
                todo.append(u)
    sources = [n for n in g.nodes if _comm_op(n, comm) == "g" or _is_embedding(n)]
    if not sources:
        return 0
    zone: dict[torch.fx.Node, int] = {}  # node -> its sequence axis (from the left)
    length: list[int] = []

    def axis_of_source(n: torch.fx.Node) -> int:
        if _comm_op(n, comm) == "g":  # named by its row Linear's call (module, line)
            n = n.args[0]
        s = _shape(n)
        if s is None or len(s) < 2:
            raise refuse(n, "its output has no sequence axis (a (batch, seq, hidden) activation, seq second-to-last)")
        if s[-2] % sh.degree:
            raise refuse(n, f"the sequence length {s[-2]} does not divide by the tensor-parallel degree {sh.degree}")
        if length and s[-2] != length[0]:
            raise refuse(n, f"sequence length {s[-2]} differs from {length[0]} elsewhere in the region")
        length.append(s[-2])
        return len(s) - 2

    for n in sources:
        zone[n] = axis_of_source(n)
    split_of: dict[torch.fx.Node, torch.fx.Node] = {}
    lengths: list[torch.fx.Node] = []  # sizes read of the sequence axis on a shard: scaled to the whole
    wholes: list[tuple[torch.fx.Node, torch.fx.Node]] = []  # (whole column Linear, its input in the zone)
    changed = True
    while changed:
        changed = False
        spread = True
        while spread:  # the zone forward, in graph order, before any whole input is judged
            spread = False
            for n in sorted(zone, key=lambda n: order.get(n, -1)):
                for u in list(n.users):
                    if u in zone or u.op == "output" or _comm_op(u, comm) is not None:
                        continue
                    if _shape(u) is None and not u.users:  # an assertion on metadata
                        continue
                    if op_name(u.target) in ("size", "sym_size") and u.op != "call_module":
                        dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
                        if not isinstance(dim, int):
                            raise refuse(u, "reads the whole shape of an activation on sequence shards (read one "
                                            "axis, x.size(d))")
                        if dim % len(_shape(n)) == zone[n]:
                            lengths.append(u)
                        continue
                    if _linear(gm, u) and _reaches_local(u, comm):  # a whole (replicated) column of a group
                        wholes.append((u, n))
                        continue
                    if u in region:
                        raise refuse(u, "it mixes activations on sequence shards with a tensor-parallel region's "
                                        "cut ones")
                    zone[u] = _axis(gm, u, zone, length[0], refuse)
                    spread = changed = True
        for n in sorted(zone, key=lambda n: order.get(n, -1)):  # whole inputs meeting the zone
            if n in sources or _comm_op(n, comm) is not None:
                continue
            for a in n.all_input_nodes:
                if a in zone:
                    continue
                if _full_sequence(a, n, zone, length[0]):
                    if a.op == "placeholder":  # an activation input: every use reads the slice
                        s = split_of.get(a) or _insert(
                            g, comm, a, "sp_split", zone[n] - (len(_shape(n)) - len(_shape(a))),
                            before=next(m for m in g.nodes if m.op != "placeholder"))
                        split_of[a] = s
                        a.replace_all_uses_with(s, delete_user_cb=lambda user, s=s: user is not s)
                        zone[s] = s.args[2]
                        s.meta["tensor_meta"] = a.meta.get("tensor_meta")
                    else:
                        dim = zone[n] - (len(_shape(n)) - len(_shape(a)))
                        s = _insert(g, comm, a, "sp_split", dim, before=n)
                        n.replace_input_with(a, s)
                        zone[s] = dim
                        s.meta["tensor_meta"] = a.meta.get("tensor_meta")
                    changed = True
    # whole tensors into the zone: through f (partial gradients summed)
    for n in sorted(zone, key=lambda n: order.get(n, -1)):
        if n in sources or _comm_op(n, comm) is not None:
            continue
        for a in n.all_input_nodes:
            if a in zone or not _tensor(a):
                continue
            with g.inserting_before(n):
                f = g.call_module(comm, (a, "f"))
            n.replace_input_with(a, f)
    # sources, column inputs, outputs, modules and dropout
    for n in sources:
        if _comm_op(n, comm) == "g":
            n.args = (n.args[0], "sp_scatter", zone[n])
        else:
            n.args = (*n.args[:3], "sp_scatter")
    for n in list(g.nodes):
        op = _comm_op(n, comm)
        if op == "f" and n.args[0] in zone:
            n.args = (n.args[0], "sp_gather", zone[n.args[0]])
        elif op in ("local",) and n.args[0] in zone:
            raise refuse(n, "a whole tensor narrowed per rank is computed on sequence shards")
        elif n.op == "output":
            def collect(a: object, out: torch.fx.Node = n) -> object:
                if isinstance(a, torch.fx.Node) and a in zone:
                    return _insert(g, comm, a, "sp_collect", zone[a], before=out)
                return a
            n.args = torch.fx.node.map_aggregate(n.args, collect)
    for n in [n for n in zone if n not in sources]:
        _local_module(gm, n, zone[n], comm, refuse)
    for u, a in wholes:  # every rank computes the whole column: the whole input, the slice of its gradient
        u.replace_input_with(a, _insert(g, comm, a, "sp_collect", zone[a], before=u))
    _fuse_gathers(gm, comm)
    for n in dict.fromkeys(lengths):
        with g.inserting_after(n):
            holder = g.get_attr(comm)
        with g.inserting_after(holder):
            whole = g.call_function(sequence_length, (holder, n))
        n.replace_all_uses_with(whole, delete_user_cb=lambda user, whole=whole: user is not whole)
    return len(sources)


def _insert(g: torch.fx.Graph, comm: str, a: torch.fx.Node, op: str, dim: int, *,
            before: torch.fx.Node | None = None, after: torch.fx.Node | None = None) -> torch.fx.Node:
    ctx = g.inserting_before(before) if before is not None else g.inserting_after(after)
    with ctx:
        return g.call_module(comm, (a, op, dim))


def _linear(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(gm.get_submodule(n.target), nn.Linear)
    return n.op == "call_function" and op_name(n.target) == "linear"


def _reaches_local(n: torch.fx.Node, comm: str) -> bool:
    """Whether ``n``'s output reaches a ``"local"`` narrowing (a whole tensor meeting a
    group's cut ones) before any other collective: ``n`` is a replicated column of a group
    (grouped-query key/value heads the degree does not divide)."""
    seen, todo = set(), list(n.users)
    while todo:
        u = todo.pop()
        if u in seen or u.op == "output":
            continue
        seen.add(u)
        op = _comm_op(u, comm)
        if op == "local":
            return True
        if op is None:
            todo.extend(u.users)
    return False


def _is_embedding(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "vocab_embedding"


def _tensor(a: torch.fx.Node) -> bool:
    return a.meta.get("tensor_meta") is not None and hasattr(a.meta["tensor_meta"], "shape")


def _full_sequence(a: torch.fx.Node, n: torch.fx.Node, zone: dict, length: int) -> bool:
    """Whether whole tensor ``a``, an input of zone node ``n``, has the full sequence on the
    axis aligned (from the right, as broadcasting aligns) with ``n``'s sequence axis."""
    sa, sn = _shape(a), _shape(n)
    if sa is None or sn is None:
        return False
    dim = zone[n] - (len(sn) - len(sa))
    return 0 <= dim < len(sa) and sa[dim] == length and length > 1


def _axis(gm: torch.fx.GraphModule, n: torch.fx.Node, zone: dict, length: int, refuse) -> int:
    """The sequence axis of zone node ``n``'s output, or a refusal if ``n`` mixes positions."""
    ins = [a for a in n.all_input_nodes if a in zone]
    out = _shape(n)
    if n.op == "call_function" and n.target is operator.getitem:
        raise refuse(n, "indexes an activation on sequence shards")
    if out is None:
        raise refuse(n, "its output on sequence shards is not a tensor")
    a = ins[0]
    ax = zone[a]
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        per_position = isinstance(m, (*_PARAMETER_FREE, nn.modules.dropout._DropoutNd, nn.Linear)) or (
            isinstance(m, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm)))
            and len(m.normalized_shape) < len(_shape(a)) - ax
        )
        if not per_position or n.args[0] is not a or len(ins) > 1:
            raise refuse(n, f"module {type(m).__name__} is not known to act per position along the sequence")
        return ax
    name = op_name(n.target).removeprefix("native_")
    if name in _ELEMENTWISE or name in _DROPOUT or name in ("linear",) and n.args[0] is a and len(ins) == 1:
        axes = {zone[i] + len(out) - len(_shape(i)) for i in ins}
        if len(axes) > 1:
            raise refuse(n, "its inputs have the sequence on different axes")
        return axes.pop()
    if name in _REDUCE and len(ins) == 1:
        dims = _dims(n)
        nd = len(_shape(a))
        if dims is not None and all(d % nd > ax for d in dims):
            return ax
    if name in _NORMS and n.args[0] is a and len(ins) == 1:
        shape = n.args[1] if len(n.args) > 1 else n.kwargs.get("normalized_shape")
        if isinstance(shape, list | tuple) and len(shape) < len(_shape(a)) - ax:
            return ax
    raise refuse(n, "it is not known to act per position along the sequence (it may mix positions, as a "
                    "cumulative sum or a reshape of the sequence axis does)")


def _local_module(gm: torch.fx.GraphModule, n: torch.fx.Node, ax: int, comm: str, refuse) -> None:
    """Replace a zone module call holding parameters by its function on ``f``-read
    parameters, and dropout (module or function) by ``sequence_dropout``."""
    g = gm.graph
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        if isinstance(m, nn.modules.dropout._DropoutNd):
            if isinstance(m, nn.Dropout) and m.p > 0:
                with g.inserting_before(n):
                    new = g.call_function(sequence_dropout, (g.get_attr(comm), n.args[0], m.p, ax))
                n.replace_all_uses_with(new)
                g.erase_node(n)
            elif m.p > 0:
                raise refuse(n, f"{type(m).__name__} on sequence shards is not supported (only nn.Dropout)")
            return
        params = dict(m.named_parameters(recurse=False))
        if not params:
            return
        with g.inserting_before(n):
            read = {k: g.call_module(comm, (g.get_attr(f"{n.target}.{k}"), "f")) for k in params}
            if isinstance(m, nn.Linear):
                new = g.call_function(F.linear, (n.args[0], read["weight"], read.get("bias")))
            elif isinstance(m, nn.LayerNorm):
                new = g.call_function(F.layer_norm, (n.args[0], tuple(m.normalized_shape), read.get("weight"),
                                                     read.get("bias"), m.eps))
            else:
                new = g.call_function(F.rms_norm, (n.args[0], tuple(m.normalized_shape), read.get("weight"), m.eps))
        n.replace_all_uses_with(new)
        g.erase_node(n)
        return
    name = op_name(n.target).removeprefix("native_")
    if name in _DROPOUT:
        if name != "dropout":
            raise refuse(n, f"{name} on sequence shards is not supported (only dropout)")
        p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
        train = n.kwargs.get("training", n.kwargs.get("train", n.args[2] if len(n.args) > 2 else True))
        if not isinstance(p, int | float) or not isinstance(train, bool):
            raise refuse(n, "dropout with a probability or training flag computed at run time")
        with g.inserting_before(n):
            new = g.call_function(sequence_dropout, (g.get_attr(comm), n.args[0], float(p), ax, train))
        n.replace_all_uses_with(new)
        g.erase_node(n)


def _refuser(sh: Sharding):
    def refuse(n: torch.fx.Node, rule: str) -> DirectiveError:
        return DirectiveError(
            f"sequence parallelism cannot put {describe(n)} on sequence shards: {rule}. Run without "
            "sequence parallelism (--sp, sequence_parallel=True), or change that code",
            directive=sh.origin,
        )
    return refuse
