"""How a tensor-parallel cut travels through the code between column and row Linears (torch side).

``shard_groups`` finds the column groups; this module follows the cut from each cut column's
output (its last axis, in ``degree`` contiguous blocks) through the operations after it,
op by op, on the full shapes shape propagation recorded (``meta["tensor_meta"]``), and says
what the code must change to run on a shard (``HeadPlan``):

- ``sizes``: size constants a reshape, view or expand holds for the cut axis (export bakes
  ``view(b, t, 4, 8)``; on a shard it is ``view(b, t, 4 // degree, 8)``). The cut axis after
  a reshape is the outermost factor of the cut input axis (the heads of ``n_heads * d_head``),
  which must divide by ``degree``;
- ``groups``: a cut column whose output a reshape splits first into blocks the degree does not
  divide (a fused q/k/v projection viewed as ``(b, t, 3, heads, d_head)``) is cut within each
  block (``ParamShard.groups``);
- ``narrows``: whole tensors (not cut: a key/value projection replicated because the degree
  does not divide its heads, a side input) that meet a cut one on the cut axis with more
  than one entry there. Each rank takes its block (its query heads' key/value heads:
  ``TensorParallelComm`` ``"local"``, whose backward all-reduces the gradient);
- ``summed``: whole tensors broadcast over the cut axis (a per-head norm's weight, rotary
  tables, a mask): each rank's gradient of them comes from its heads only, so they are read
  through Megatron's ``f`` (its backward sums the gradient over the group; nothing is sent
  for a tensor that needs no gradient).

An operation it does not know to act per block of the cut axis is refused, naming it, its
module and line, and the rule (``Refusal``); a reshape whose heads the degree does not
divide is reported as ``Undivided`` (``shard_groups`` then replicates that column, or
refuses).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

import attrs
import torch
import torch.fx

from piper_directives.diagnose import describe

# Operations that act entry by entry (with broadcasting): the cut stays where it is.
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "log", "pow", "rsqrt",
    "sqrt", "to", "_to_copy", "type_as", "contiguous", "clone", "alias", "detach", "where", "masked_fill",
    "float", "double", "half", "bfloat16", "type", "abs", "square", "reciprocal", "erf", "mish", "softplus",
    "rsub", "truediv", "floordiv", "_assert_tensor_metadata", "dropout", "lift_fresh_copy", "copy",
})
_ALONG = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum"})
_REDUCE = frozenset({"mean", "sum", "amax", "amin", "max", "min", "var", "std", "norm"})
_RESHAPE = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten"})


class Refusal(Exception):
    """An operation on cut activations that tensor parallelism cannot run per block."""

    def __init__(self, node: torch.fx.Node, rule: str) -> None:
        self.node, self.rule = node, rule
        super().__init__(f"{describe(node)}: {rule}")


class Undivided(Refusal):
    """A reshape splits the cut axis into heads the degree does not divide."""

    def __init__(self, node: torch.fx.Node, rule: str, heads: int) -> None:
        super().__init__(node, rule)
        self.heads = heads


@attrs.define
class HeadPlan:
    """What a shard's code changes (module doc): ``sizes`` lists ``(node, argument, index,
    new size)`` edits (``index``: into a size list argument, None: the argument itself); ``narrows`` lists ``(node, input, dim)``; ``cut`` is each
    cut node's cut axis and ``origin`` the cut columns it comes from."""

    cut: dict[torch.fx.Node, int] = attrs.field(factory=dict)
    origin: dict[torch.fx.Node, frozenset] = attrs.field(factory=dict)
    sizes: list[tuple[torch.fx.Node, int, int | None, int]] = attrs.field(factory=list)
    narrows: list[tuple[torch.fx.Node, torch.fx.Node, int]] = attrs.field(factory=list)
    groups: dict[torch.fx.Node, int] = attrs.field(factory=dict)  # per cut column: its blocks (fused q/k/v: 3)
    summed: list[tuple[torch.fx.Node, torch.fx.Node]] = attrs.field(factory=list)


def op_name(target: object) -> str:
    """``view`` for ``torch.ops.aten.view.default``, ``Tensor.view`` and ``"view"``."""
    if isinstance(target, str):
        return target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    name = getattr(target, "__name__", str(target))
    return name


def shape(n: object) -> tuple[int, ...] | None:
    meta = n.meta.get("tensor_meta") if isinstance(n, torch.fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def follow(columns: Iterable[torch.fx.Node], region: set[torch.fx.Node], order: list[torch.fx.Node],
           degree: int) -> HeadPlan:
    """The plan for the cut columns ``columns`` (each cut on its last axis) through ``region``
    (the nodes between them and their row Linear, in graph ``order``)."""
    plan = HeadPlan()
    for c in columns:
        plan.cut[c] = len(shape(c)) - 1
        plan.origin[c] = frozenset({c})
        plan.groups[c] = 1
    for n in order:
        if n not in region:
            continue
        ins = [a for a in n.all_input_nodes if a in plan.cut]
        if not ins:
            continue
        plan.origin[n] = frozenset().union(*(plan.origin[a] for a in ins))
        axis = _rule(n, plan, degree)
        if axis is not None:
            plan.cut[n] = axis
        narrowed = {a for m, a, _ in plan.narrows if m is n}
        plan.summed.extend((n, a) for a in n.all_input_nodes
                           if a not in plan.cut and a not in narrowed and shape(a) is not None)
    return plan


def _arg(n: torch.fx.Node, i: int, key: str, default: object = None) -> object:
    return n.args[i] if len(n.args) > i else n.kwargs.get(key, default)


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _rule(n: torch.fx.Node, plan: HeadPlan, degree: int) -> int | None:
    """The cut axis of ``n``'s output (None: not a tensor), recording edits in ``plan``."""
    name = op_name(n.target)
    x = n.args[0] if n.args else None
    out = shape(n)
    cut_x = plan.cut.get(x) if isinstance(x, torch.fx.Node) else None
    if n.op == "call_function" and n.target is operator.getitem:
        if shape(x) is None and isinstance(n.args[1], int):
            return cut_x  # an element of a split's list keeps the list's cut axis
        return _indexed(n, cut_x, len(shape(x)), shape(x))
    if name == "sym_size" or (n.op == "call_method" and name == "size"):
        return None  # a size of a cut tensor is its shard's size: code built from it is the shard's
    if name in _ELEMENTWISE or (n.op == "call_function" and n.target in (operator.add, operator.sub,
                                                                          operator.mul, operator.truediv)):
        return _broadcast(n, plan, degree, out)
    if name in ("scaled_dot_product_attention",):
        return _attention(n, plan, degree)
    if name in ("matmul", "bmm"):
        a, b = n.args[0], n.args[1]
        for t in (a, b):
            if t in plan.cut and plan.cut[t] >= len(shape(t)) - 2:
                raise Refusal(n, "a matrix product over the cut axis (each rank holds only its heads' part)")
        return _broadcast(n, plan, degree, out, skip_last=2)
    if name in ("cat", "stack"):
        return _joined(n, name, plan)
    if cut_x is None:
        raise Refusal(n, "an operation on a cut activation whose first argument is not the cut one")
    nd = len(shape(x))
    if name in _ALONG:
        if _norm(_arg(n, 1, "dim"), nd) == cut_x:
            raise Refusal(n, f"{name} along the cut (heads) axis")
        return cut_x
    if name in _REDUCE:
        dims = _arg(n, 1, "dim")
        dims = list(range(nd)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
        dims = [_norm(d, nd) for d in dims]
        if cut_x in dims:
            raise Refusal(n, f"{name} over the cut (heads) axis: each rank would reduce only its part")
        keep = _arg(n, 2, "keepdim", False)
        return cut_x if keep else cut_x - sum(d < cut_x for d in dims)
    if name == "transpose":
        d0, d1 = _norm(n.args[1], nd), _norm(n.args[2], nd)
        return d1 if cut_x == d0 else d0 if cut_x == d1 else cut_x
    if name == "permute":
        dims = n.args[1] if isinstance(n.args[1], list | tuple) else n.args[1:]
        return [_norm(d, nd) for d in dims].index(cut_x)
    if name == "unsqueeze":
        d = _norm(n.args[1], nd + 1)
        return cut_x + 1 if d <= cut_x else cut_x
    if name == "squeeze":
        dims = _arg(n, 1, "dim")
        dims = [i for i, s in enumerate(shape(x)) if s == 1] if dims is None else [dims] if isinstance(dims, int) else dims
        return cut_x - sum(_norm(d, nd) < cut_x for d in dims if shape(x)[_norm(d, nd)] == 1)
    if name in ("slice", "select", "narrow", "split", "chunk", "split_with_sizes", "unbind", "cat", "stack",
                "repeat_interleave", "expand"):
        return _indexing(n, name, x, cut_x, plan, degree)
    if name in _RESHAPE:
        return _reshape(n, name, x, cut_x, plan, degree)
    if name == "dropout" or name.startswith("dropout"):
        return cut_x
    raise Refusal(n, f"{name} is not known to act on each rank's heads separately (known: element-wise "
                     "operations, reshapes, transposes, reductions and softmax over other axes, attention)")


def _broadcast(n: torch.fx.Node, plan: HeadPlan, degree: int, out: tuple[int, ...] | None,
               skip_last: int = 0) -> int | None:
    """Element-wise with broadcasting: the cut inputs agree on the (right-aligned) axis;
    whole inputs with more than one entry there are narrowed to the rank's block."""
    if out is None:
        return None
    tensors = [a for a in n.all_input_nodes if shape(a) is not None]
    axes = {len(out) - len(shape(a)) + plan.cut[a] for a in tensors if a in plan.cut}
    if len(axes) != 1:
        raise Refusal(n, "combines activations cut on different axes")
    axis = axes.pop()
    if axis >= len(out) - skip_last:
        raise Refusal(n, "a matrix product over the cut axis")
    for a in tensors:
        if a in plan.cut:
            continue
        pos = axis - (len(out) - len(shape(a)))
        if pos >= 0 and shape(a)[pos] > 1:
            _narrow(n, a, pos, plan, degree)
    return axis


def _narrow(n: torch.fx.Node, a: torch.fx.Node, pos: int, plan: HeadPlan, degree: int) -> None:
    size = shape(a)[pos]
    if size % degree and degree % size:
        raise Refusal(n, f"a whole activation with {size} heads meets cut ones: the degree {degree} neither "
                         "divides them nor is a multiple of them")
    plan.narrows.append((n, a, pos))


def _attention(n: torch.fx.Node, plan: HeadPlan, degree: int) -> int:
    """Attention is per head (axis -3 of query, key, value and mask): whole keys and values
    (replicated because the degree does not divide their heads) are narrowed to the rank's
    query heads' key/value heads."""
    q = n.args[0]
    if q not in plan.cut:
        raise Refusal(n, "attention whose query is not cut by heads")
    nd = len(shape(q))
    if plan.cut[q] != nd - 3:
        raise Refusal(n, "attention whose query is cut on another axis than its heads")
    for i, a in enumerate(n.args[1:4], start=1):
        if not isinstance(a, torch.fx.Node):
            continue
        if a in plan.cut:
            if plan.cut[a] != len(shape(a)) - 3:
                raise Refusal(n, f"attention input {i} cut on another axis than its heads")
        elif len(shape(a)) >= 3 and shape(a)[-3] > 1:
            _narrow(n, a, len(shape(a)) - 3, plan, degree)
    return nd - 3


def _indexing(n: torch.fx.Node, name: str, x: torch.fx.Node, cut_x: int, plan: HeadPlan, degree: int) -> int:
    nd = len(shape(x))
    if name == "expand":
        listed = isinstance(n.args[1], list | tuple)
        sizes = list(n.args[1]) if listed else list(n.args[1:])
        axis = len(sizes) - nd + cut_x
        if isinstance(sizes[axis], int) and sizes[axis] != -1:
            plan.sizes.append((n, 1, axis, sizes[axis] // degree) if listed else (n, 1 + axis, None, sizes[axis] // degree))
        return axis
    dim = _norm(_arg(n, 2 if name == "repeat_interleave" else 1, "dim", 0), nd)
    if name == "repeat_interleave":
        if not isinstance(n.args[1], int):
            raise Refusal(n, "repeat_interleave by a tensor of counts on a cut activation")
        return cut_x
    if dim != cut_x:
        return cut_x - (name in ("select", "unbind") and dim < cut_x)
    if name == "slice":
        start, end, step = _arg(n, 2, "start", 0), _arg(n, 3, "end", None), _arg(n, 4, "step", 1)
        if start in (0, None) and step == 1 and (end is None or end >= shape(x)[dim]):
            return cut_x
    raise Refusal(n, f"{name} along the cut (heads) axis: each rank holds only its block of it")


def _joined(n: torch.fx.Node, name: str, plan: HeadPlan) -> int:
    parts = n.args[0]
    if any(p not in plan.cut or plan.cut[p] != plan.cut[parts[0]] for p in parts):
        raise Refusal(n, f"{name} of cut and whole activations")
    axis, nd = plan.cut[parts[0]], len(shape(parts[0]))
    dim = _norm(_arg(n, 1, "dim", 0), nd + (name == "stack"))
    if name == "cat" and dim == axis:
        raise Refusal(n, "cat along the cut (heads) axis")
    return axis + 1 if name == "stack" and dim <= axis else axis


def _indexed(n: torch.fx.Node, cut_x: int, nd: int, full: tuple[int, ...]) -> int:
    """``x[index]``: where the cut axis goes; indexing into it is refused."""
    index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    if sum(i is not None and i is not Ellipsis for i in index) > nd or any(
        not (i is None or i is Ellipsis or isinstance(i, int | slice)) for i in index
    ):
        raise Refusal(n, "indexing a cut activation by tensors")
    if Ellipsis in index:
        k = index.index(Ellipsis)
        used = sum(i is not None for i in index) - 1
        index = (*index[:k], *(slice(None),) * (nd - used), *index[k + 1 :])
    dim = out = 0
    for i in index:
        if i is None:
            out += 1
            continue
        if dim == cut_x:
            if isinstance(i, int) or i != slice(None) and not (i.start in (0, None) and i.step in (1, None)
                                                               and (i.stop is None or i.stop >= full[dim])):
                raise Refusal(n, "indexing along the cut (heads) axis: each rank holds only its block of it")
            return out
        dim, out = dim + 1, out + (not isinstance(i, int))
    return out + cut_x - dim


def regroup(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """The axes of shape ``a`` and of shape ``b`` (same number of entries) that a reshape maps
    onto each other, as groups of equal product."""
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        pa, pb, ii, jj = a[i], b[j], [i], [j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa, i = pa * a[i], i + 1
                ii.append(i - 1)
            else:
                pb, j = pb * b[j], j + 1
                jj.append(j - 1)
        out.append((ii, jj))
    if out:
        out[-1][0].extend(range(i, len(a)))
        out[-1][1].extend(range(j, len(b)))
    return out


def _reshape(n: torch.fx.Node, name: str, x: torch.fx.Node, cut_x: int, plan: HeadPlan, degree: int) -> int:
    a, b = shape(x), shape(n)
    ii, jj = next((ii, jj) for ii, jj in regroup(a, b) if cut_x in ii)
    if any(a[k] != 1 for k in ii if k < cut_x):
        raise Refusal(n, f"{name} merges the cut (heads) axis under an outer axis: each rank's block would "
                         "not be contiguous")
    o = jj[0]  # the outermost factor: the heads (one head: 1, which no degree divides)
    if b[o] % degree and x in plan.groups and plan.groups[x] == 1:
        # A fused projection's output (q, k and v: ``view(b, t, 3, heads, d_head)``): the
        # outer factors the degree does not divide are blocks, each cut by heads.
        inner = next((k for k in jj[:-1] if b[k] % degree == 0 and b[k] > 1), None)  # never d_head
        if inner is not None and math.prod(b[k] for k in jj if k < inner) > 1:
            plan.groups[x] = math.prod(b[k] for k in jj if k < inner)
            o = inner
    if b[o] % degree:
        raise Undivided(n, f"the tensor-parallel degree {degree} does not divide the {b[o]} heads this "
                           f"{name} makes of the cut axis", b[o])
    if name in ("view", "reshape", "_unsafe_view"):
        listed = len(n.args) == 2 and isinstance(n.args[1], list | tuple)
        sizes = n.args[1] if listed else n.args[1:]
        if isinstance(sizes[o], int) and sizes[o] != -1:
            plan.sizes.append((n, 1, o, b[o] // degree) if listed else (n, 1 + o, None, b[o] // degree))
        elif not isinstance(sizes[o], int | torch.fx.Node):
            raise Refusal(n, f"{name} with a size of the cut axis it cannot rewrite")
    elif name == "unflatten":
        dim = _norm(n.args[1], len(a))
        if 0 <= o - dim < len(n.args[2]) and isinstance(n.args[2][o - dim], int) and n.args[2][o - dim] != -1:
            plan.sizes.append((n, 2, o - dim, b[o] // degree))
    return o
