"""Context parallelism as a rewrite of the captured segments' code (torch side);
docs/context-parallel.md.

``context_modules(graph, modules)`` takes a graph after ``Strategy.apply`` whose
``Graph.sharding`` holds ``kind="cp"`` records (``piper_directives.context_parallel``) and the
captured segment modules, and returns both rewritten so that each rank of a group of ``N``
computes chunk ``position`` (its place in the group) of every sequence, ``L = T / N`` tokens
along dimension 1 (the convention: dimension 1 of every input, target and activation is the
sequence), exactly as one device computes those tokens of the whole sequence:

- **attention** sees the keys and values of the whole sequence: they are all-gathered along
  the sequence over the group (whose backward is a reduce-scatter of their gradients), and
  causal masking is offset by the chunk's place, query ``i`` of the chunk (global position
  ``position * L + i``) seeing keys ``0 .. position * L + i``. Recognised:
  ``F.scaled_dot_product_attention(q, k, v, is_causal=...)`` without an explicit mask or
  dropout (fx or aten level), and attention written out, ``softmax(q @ k^T ...) @ v``,
  whose mask (if any) is a buffer narrowed to the sequence length
  (``mask.narrow(0, 0, t).narrow(1, 0, t)``). All-gather rather than ring attention: one
  collective per tensor, the same summation order as one device (exact to the last bit of
  the softmax's inputs), at the price of holding one layer's whole keys and values at a time;
- **positions**: a buffer or parameter narrowed or sliced along dimension 0 from 0 to the
  sequence length (a positional embedding ``pos.narrow(0, 0, t)``, rotary tables
  ``cos[:t]``, a causal mask's rows) starts at the chunk's first position instead, and
  ``torch.arange(t)`` is offset by it: the code sees its global positions;
- **the loss** reads its chunk of the targets (every rank of a group receives whole target
  rows, ``ContextLayout``), and a mean-reduced ``cross_entropy``/``nll_loss`` becomes its sum
  over the chunk divided by the whole sequences' count of non-ignored targets (times ``N``,
  as the runtime averages the group's losses): the mean over every token of the full
  sequences, also where ignored (``-100``) targets fall unevenly between chunks.

``Graph.values`` get each rank's shapes (the rewritten code run on one rank's inputs), and
each ``Sharding`` the number of collectives its forward issues.

Refused (``DirectiveError`` naming the ``ContextParallel`` and, where one is to blame, the
operation with its module and the model's line): a sequence length the degree does not
divide, an input or target without a sequence dimension 1, no attention anywhere that this
rewrite recognises, an attention with an explicit mask (or one computed from data),
attention dropout or any random draw in a context-parallel region (no rank could draw one
device's mask for its chunk), a recomputed region, and a region whose code is not a
``torch.fx`` graph.

The collectives call a ``ContextParallelComm`` submodule (``piper_cp``) that the runtime binds
to the group's ``cp`` communicators (``all_gather``/``reduce_scatter``; this package never
calls ``torch.distributed``). Unbound, it is one rank of a group whose members all hold the
same chunk (gathers tile it): the shapes are right, for the rewrite's own shape run.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from piper_directives.collective_code import GroupCollectives
from piper_directives.diagnose import describe
from piper_directives.segment_module import like
from piper_directives.shard_heads import op_name
from piper_ir import (
    DirectiveError,
    Graph,
    Program,
    SegmentRole,
    Sharding,
    ShardKind,
    TensorMeta,
    Value,
    grad_of,
    is_grad,
)

COMM = "piper_cp"
_SDPA = "scaled_dot_product_attention"
_RANDOM = ("dropout", "native_dropout", "feature_dropout", "alpha_dropout", "bernoulli", "rand", "randn",
           "rand_like", "randn_like", "randint", "randint_like", "normal", "multinomial")
_PASS_THROUGH = {"mul", "div", "add", "sub", "truediv", "to", "type_as", "float", "double", "contiguous", "clone"}
_MASKING = {"masked_fill", "masked_fill_", "where"}
_SCORES = {"matmul", "bmm", "baddbmm", "einsum", "linear", "mm", "addmm"}  # where a softmax's input chain ends


class Gather(Protocol):
    """What ``ContextParallelComm`` needs of a communicator (the runtime's provide it)."""

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None: ...

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None: ...


class ContextParallelComm(GroupCollectives[Gather]):
    """The communicators of a context-parallel group (module doc) and this rank's place in it."""

    position: int = 0

    def bind_communicator(self, comm: Gather, backward_comm: Gather | None = None, position: int = 0) -> None:
        super().bind_communicator(comm, backward_comm)
        self.position = position

    def offset(self, length: int) -> int:
        """The global position of this rank's first token, for chunks of ``length`` tokens."""
        return self.position * length

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` of every rank of the group, concatenated along ``dim`` in group order."""
        return _GatherSequence.apply(x, dim, self)

    def forward(self, *args: Any, op: str, **kwargs: Any) -> Any:
        if op == "offset":
            return self.offset(*args)
        if op == "gather":
            return self.gather(*args, **kwargs)
        if op == _SDPA:
            return self.attention(*args, **kwargs)
        raise ValueError(f"unknown context-parallel op {op!r}")

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """Scaled dot-product attention of this chunk's queries over the whole sequence's keys
        and values; causal: query ``i`` sees keys up to global position ``offset + i``, and
        the keys after this chunk's last query are not used at all."""
        length = q.shape[-2]
        k, v = self.gather(k, -2), self.gather(v, -2)
        extra = {"scale": scale} if scale is not None else {}
        if enable_gqa:
            extra["enable_gqa"] = True
        if not is_causal:
            return F.scaled_dot_product_attention(q, k, v, **extra)
        start = self.offset(length)
        keys = start + length
        k, v = k.narrow(-2, 0, keys), v.narrow(-2, 0, keys)
        rows = torch.arange(start, keys, device=q.device).unsqueeze(-1)
        mask = torch.arange(keys, device=q.device) <= rows
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)


class _GatherSequence(torch.autograd.Function):
    """All-gather along a dimension; backward: reduce-scatter of the gradient (each rank's
    chunk gets the sum of every rank's gradient for it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, comm: ContextParallelComm) -> torch.Tensor:
        ctx.dim, ctx.comm = dim, comm
        moved = x.movedim(dim, 0).contiguous()
        if comm.comm is None:
            out = torch.cat([moved] * comm.degree)
        else:
            out = moved.new_empty((moved.shape[0] * comm.degree, *moved.shape[1:]))
            comm.timed(comm.comm.all_gather, out, moved)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        comm: ContextParallelComm = ctx.comm
        moved = grad.movedim(ctx.dim, 0).contiguous()
        size = moved.shape[0] // comm.degree
        if comm.comm is None:
            out = sum(moved.split(size))
        else:
            out = moved.new_empty((size, *moved.shape[1:]))
            comm.timed((comm.backward_comm or comm.comm).reduce_scatter, out, moved)
        return out.movedim(0, ctx.dim), None, None


class _MeanOverSequences(TorchFunctionMode):
    """A mean-reduced ``cross_entropy``/``nll_loss`` over a chunk as its share of the mean over
    the whole sequences: the chunk's sum times ``degree`` over the whole targets' count of
    non-ignored entries (the runtime then averages the group's losses)."""

    def __init__(self, whole: torch.Tensor, degree: int) -> None:
        super().__init__()
        self.whole, self.degree = whole, degree

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (F.cross_entropy, F.nll_loss):
            names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            plain = bound.get("size_average") is None and bound.get("reduce") is None
            if bound.get("reduction", "mean") == "mean" and bound.get("weight") is None and plain:
                bound["reduction"] = "sum"
                total = func(**bound)
                count = (self.whole != bound.get("ignore_index", -100)).sum().to(total.dtype)
                return total * self.degree / count
        return func(*args, **kwargs)


class ContextLoss(nn.Module):
    """The loss segment of a context-parallel group: the captured loss on this rank's chunk
    of the outputs and of the (whole) targets (module doc)."""

    def __init__(self, loss: nn.Module, n_outputs: int, degree: int) -> None:
        super().__init__()
        self.loss = loss
        self.n_outputs = n_outputs
        self.piper_cp = ContextParallelComm(degree)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        outputs, targets = args[: self.n_outputs], args[self.n_outputs :]
        length = outputs[0].shape[1]
        start = self.piper_cp.offset(length)
        local = tuple(t.narrow(1, start, length) for t in targets)
        ints = [t for t in targets if not t.is_floating_point()]
        mode = _MeanOverSequences(ints[0], self.piper_cp.degree) if len(ints) == 1 else contextlib.nullcontext()
        with mode:
            return self.loss(*outputs, *local)


def _refuse(sh: Sharding, what: str, node: torch.fx.Node | None = None) -> DirectiveError:
    at = f": {describe(node)}" if node is not None else ""
    return DirectiveError(f"context parallelism: {what}{at}", directive=sh.origin)


def _name(n: object) -> str:
    """The operation a function or method call calls (``""`` for modules, attributes, inputs)."""
    return op_name(n.target) if isinstance(n, torch.fx.Node) and n.op in ("call_function", "call_method") else ""


def _is_seq_size(n: object) -> bool:
    """``x.size(1)``, ``x.shape[1]`` / ``aten.sym_size.int(x, 1)``: the (local) sequence length."""
    if not isinstance(n, torch.fx.Node):
        return False
    if _name(n) == "getitem" and len(n.args) == 2 and n.args[1] == 1:
        shape = n.args[0]
        return isinstance(shape, torch.fx.Node) and (
            (_name(shape) == "getattr" and shape.args[1:] == ("shape",)) or (_name(shape) == "size" and len(shape.args) == 1))
    if _name(n) not in ("size", "sym_size"):
        return False
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return dim == 1


def _narrowing(n: torch.fx.Node) -> tuple[torch.fx.Node, int, object, object] | None:
    """(source, dim, start, length-or-end node) of a narrow or a slice, else None."""
    name = _name(n)
    if name == "narrow" and len(n.args) >= 4:
        return n.args[0], n.args[1], n.args[2], n.args[3]
    if name == "slice" and len(n.args) >= 4 and (len(n.args) < 5 or n.args[4] == 1):
        return n.args[0], n.args[1], n.args[2], n.args[3]
    return None


def _weight(product: torch.fx.Node) -> bool:
    """Whether a matmul's second operand is a parameter or buffer (possibly transposed)."""
    other = product.args[1] if len(product.args) > 1 else None
    while isinstance(other, torch.fx.Node) and _name(other) in ("t", "transpose", "permute", "to", "contiguous"):
        other = other.args[0]
    return isinstance(other, torch.fx.Node) and other.op == "get_attr"


def _random(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    if n.op == "call_module":
        sub = gm.get_submodule(str(n.target))
        return "Dropout" in type(sub).__name__ and getattr(sub, "p", 0) > 0
    name = _name(n)
    if name in _RANDOM or (name.startswith("dropout") and n.op != "get_attr"):
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        return not (isinstance(p, int | float) and p == 0)
    return False


@attrs.define
class _Rewrite:
    """One segment's rewrite (module doc); ``collectives`` counts the gathers of a forward."""

    gm: torch.fx.GraphModule
    sh: Sharding
    collectives: int = 0
    attentions: int = 0
    key_masks: set[torch.fx.Node] = attrs.field(factory=set)

    def comm(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        return self.gm.graph.call_module(COMM, args, kwargs)

    def run(self) -> None:
        nodes = list(self.gm.graph.nodes)
        for n in nodes:
            if _random(self.gm, n):
                raise _refuse(self.sh, "a random draw (dropout) in a context-parallel region; no rank can draw "
                              "one device's mask for its chunk of the sequence (use p=0, or leave the region "
                              "whole)", n)
        for n in nodes:
            if _name(n) == _SDPA:
                self.sdpa(n)
            elif "attention" in _name(n):  # an attention kernel called directly (flash, flex, ...)
                raise _refuse(self.sh, "an attention operation context parallelism does not know how to cut "
                              "along the sequence (it knows F.scaled_dot_product_attention and softmax(q @ k^T) @ v)", n)
            elif _name(n) in ("softmax", "_softmax"):
                self.written_out(n)
        for n in nodes:
            cut = _narrowing(n)
            if cut is not None:
                self.position(n, *cut)
            elif _name(n) == "arange":
                self.arange(n)
        self.gm.graph.lint()
        self.gm.recompile()

    def sdpa(self, n: torch.fx.Node) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = {**dict(zip(names, n.args, strict=False)), **n.kwargs}
        if bound.get("attn_mask") is not None:
            raise _refuse(self.sh, "an attention with an explicit mask (attn_mask) cannot be cut along the "
                          "sequence; use is_causal=True, or leave the region whole", n)
        if bound.get("dropout_p", 0.0):
            raise _refuse(self.sh, "attention dropout (dropout_p) in a context-parallel region", n)
        extra = {k: bound[k] for k in ("scale", "enable_gqa") if bound.get(k) is not None}
        with self.gm.graph.inserting_before(n):
            new = self.comm(bound["query"], bound["key"], bound["value"], op=_SDPA,
                            is_causal=bool(bound.get("is_causal", False)), **extra)
        n.replace_all_uses_with(new)
        self.gm.graph.erase_node(n)
        self.collectives += 2
        self.attentions += 1

    def written_out(self, softmax: torch.fx.Node) -> None:
        """``softmax(q @ k^T ...) @ v``: gather ``k^T`` along its last dimension and ``v``
        along its second-to-last; the masks on the way must be buffers narrowed to the
        sequence (their key axis is widened in ``position``)."""
        scores, masks = softmax.args[0], []
        while isinstance(scores, torch.fx.Node) and _name(scores) not in _SCORES:
            name = _name(scores)
            if name in _MASKING or (name in ("add", "sub") and isinstance(scores.args[1], torch.fx.Node)):
                masks.append(scores)
            elif name not in _PASS_THROUGH:
                return  # a softmax that is not attention's (a router, a loss)
            scores = scores.args[1] if name == "where" else scores.args[0]
        if not isinstance(scores, torch.fx.Node) or _name(scores) in ("linear", "mm", "addmm") or _weight(scores):
            return  # a softmax over a projection (a router), not over products of two activations
        out = softmax
        while len(out.users) == 1 and _name(next(iter(out.users))) in _PASS_THROUGH:
            out = next(iter(out.users))
        users = list(out.users)
        if _name(scores) != "matmul" or len(users) != 1 or _name(users[0]) != "matmul" or users[0].args[0] is not out:
            raise _refuse(self.sh, "a softmax over products of activations (attention?) that is not "
                          "softmax(q @ k.transpose(-2, -1) ...) @ v or F.scaled_dot_product_attention, which are the "
                          "attentions context parallelism can cut along the sequence", softmax)
        out = users[0]
        for m in masks:
            mask = m.args[0] if _name(m) == "where" else m.args[1]
            if not self.key_mask(mask):
                raise _refuse(self.sh, "an attention with an explicit mask that is not a buffer narrowed to the "
                              "sequence length (mask.narrow(0, 0, t).narrow(1, 0, t)) cannot be cut along the "
                              "sequence", m)
        with self.gm.graph.inserting_before(scores):
            keys = self.comm(scores.args[1], -1, op="gather")
        scores.update_arg(1, keys)
        with self.gm.graph.inserting_before(out):
            values = self.comm(out.args[1], -2, op="gather")
        out.update_arg(1, values)
        self.collectives += 2
        self.attentions += 1

    def key_mask(self, mask: object) -> bool:
        """Whether ``mask`` is ``buffer.narrow(0, 0, t).narrow(1, 0, t)`` (also as slices,
        possibly negated or unsqueezed); records its key-axis narrow."""
        while isinstance(mask, torch.fx.Node) and _name(mask) in ("unsqueeze", "logical_not", "bitwise_not", "invert",
                                                                   "eq", "ne", "to", "bool"):
            mask = mask.args[0]
        cols = _narrowing(mask) if isinstance(mask, torch.fx.Node) else None
        if cols is None or cols[1] not in (1, -1) or cols[2] not in (0, None) or not _is_seq_size(cols[3]):
            return False
        rows = _narrowing(cols[0]) if isinstance(cols[0], torch.fx.Node) else None
        if rows is None or rows[1] != 0 or not isinstance(rows[0], torch.fx.Node) or rows[0].op != "get_attr":
            return False
        self.key_masks.add(mask)
        return True

    def position(self, n: torch.fx.Node, source: object, dim: object, start: object, end: object) -> None:
        if n in self.key_masks:  # a mask's key axis spans the whole sequence
            with self.gm.graph.inserting_before(n):
                whole = self.gm.graph.call_function(operator.mul, (end, self.sh.degree))
            n.update_arg(3, whole)
            return
        if not (isinstance(source, torch.fx.Node) and source.op == "get_attr" and dim == 0 and start in (0, None)
                and _is_seq_size(end)):
            return
        with self.gm.graph.inserting_before(n):
            first = self.comm(end, op="offset")
            if _name(n) == "slice":
                n.update_arg(3, self.gm.graph.call_function(operator.add, (first, end)))
        n.update_arg(2, first)

    def arange(self, n: torch.fx.Node) -> None:
        bound = n.args
        if len(bound) == 1 and _is_seq_size(bound[0]) or len(bound) >= 2 and bound[0] == 0 and _is_seq_size(bound[1]):
            length = bound[0] if len(bound) == 1 else bound[1]
            with self.gm.graph.inserting_after(n):
                first = self.comm(length, op="offset")
            with self.gm.graph.inserting_after(first):
                shifted = self.gm.graph.call_function(operator.add, (n, first))
            n.replace_all_uses_with(shifted, delete_user_cb=lambda user: user is not shifted)


def context_degree(graph: Graph | Program) -> int:
    """The degree of the context-parallel groups (1: none)."""
    return next((sh.degree for sh in graph.sharding if sh.kind is ShardKind.CP), 1)


def context_modules(graph: Graph, modules: Mapping[str, nn.Module]) -> tuple[Graph, dict[str, nn.Module]]:
    """``graph`` with each rank's value shapes and each ``cp`` ``Sharding``'s collectives, and
    the segment modules rewritten (module doc); the given modules are not changed."""
    out = dict(modules)
    records = {sh.segment: sh for sh in graph.sharding if sh.kind is ShardKind.CP}
    if not records:
        return graph, out
    first = next(iter(records.values()))
    degree = first.degree
    values = {v.name: v.meta for v in graph.values}
    length = _sequence_length(graph, first, values)
    for name in graph.inputs:
        values[name] = _chunk(values[name], degree)
    counts: dict[str, int] = {}
    attentions = 0
    for seg in graph.segments:
        sh = records.get(seg.id)
        if sh is None:
            continue
        module = modules[seg.id]
        if seg.role is SegmentRole.LOSS:
            n_outputs = getattr(module, "n_outputs", None)
            if not isinstance(n_outputs, int):
                raise _refuse(sh, f"the loss segment's module {type(module).__name__} is not the captured loss")
            out[seg.id] = ContextLoss(module, n_outputs, degree)
            counts[seg.id] = 1  # none issued: bound for this rank's position
            continue
        if not isinstance(module, torch.fx.GraphModule):
            raise _refuse(sh, f"region {seg.id} ({seg.tags}) was not captured as a torch.fx graph")
        rewrite = _Rewrite(like(module, copy.deepcopy(module.graph)), sh)
        rewrite.gm.add_submodule(COMM, ContextParallelComm(degree))
        rewrite.run()
        if rewrite.collectives and seg.recompute:
            raise _refuse(sh, f"region {seg.id} ({seg.tags}) is recomputed and issues context-parallel gathers "
                          "inside its forward; recomputing a context-parallel region is not supported")
        attentions += rewrite.attentions
        counts[seg.id] = max(rewrite.collectives, 1)
        out[seg.id] = rewrite.gm
        try:
            shapes = _shapes(rewrite.gm, seg.inputs, values)
        except Exception as err:  # the model's own error on a chunk
            text = (str(err).strip().splitlines() or [""])[0]
            raise _refuse(sh, f"region {seg.id} ({seg.tags}) does not run on a chunk of {length // degree} of the "
                          f"sequence's {length} tokens: {type(err).__name__}: {text} (a sequence length written "
                          "into the code, or a position computation this rewrite does not offset?)") from err
        for name, shape in zip(seg.outputs, shapes, strict=True):
            values[name] = attrs.evolve(values[name], shape=shape)
    if not attentions:
        raise _refuse(first, "no region it matches holds an attention it can cut along the sequence "
                      "(F.scaled_dot_product_attention, or softmax(q @ k.transpose(-2, -1) ...) @ v), so the chunks "
                      f"of a sequence would never meet; {length} tokens per sequence")
    for name in list(values):
        if is_grad(name) and grad_of(name) in values:
            values[name] = attrs.evolve(values[name], shape=values[grad_of(name)].shape)
    sharding = tuple(attrs.evolve(sh, collectives=counts.get(sh.segment, 0)) if sh.kind is ShardKind.CP else sh
                     for sh in graph.sharding)
    return attrs.evolve(graph, values=tuple(Value(v.name, values[v.name]) for v in graph.values),
                        sharding=sharding), out


def _sequence_length(graph: Graph, sh: Sharding, values: Mapping[str, TensorMeta]) -> int:
    """The sequence length T of the batch (dimension 1 of every input and target), checked to
    be divisible by the degree."""
    lengths = {}
    for name in (*graph.inputs, *graph.targets):
        meta = values[name]
        if meta.batch_dim != 0 or len(meta.shape) < 2:
            raise _refuse(sh, f"batch value {name} of shape {tuple(meta.shape)} has no sequence dimension 1 "
                          "(context parallelism cuts dimension 1 of every input and target)")
        lengths[name] = meta.shape[1]
    if len(set(lengths.values())) > 1:
        raise _refuse(sh, f"the inputs and targets disagree on the sequence length (dimension 1): {lengths}")
    length = next(iter(lengths.values()))
    if length % sh.degree:
        raise _refuse(sh, f"sequences of {length} tokens ({', '.join(lengths)}: dimension 1) are not divisible "
                      f"among {sh.degree} context-parallel ranks")
    return length


def _chunk(meta: TensorMeta, degree: int) -> TensorMeta:
    shape = list(meta.shape)
    shape[1] //= degree
    return attrs.evolve(meta, shape=tuple(shape))


def _shapes(gm: torch.fx.GraphModule, inputs: Sequence[str], values: Mapping[str, TensorMeta]
            ) -> list[tuple[int, ...]]:
    """The shapes of ``gm``'s outputs on one rank's inputs (a run of a copy, collectives unbound)."""
    args = []
    for name in inputs:
        meta = values[name]
        dtype = getattr(torch, meta.dtype)
        args.append(torch.randn(meta.shape, dtype=dtype) if dtype.is_floating_point
                    else torch.zeros(meta.shape, dtype=dtype))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        outs = copy.deepcopy(gm)(*args)
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    return [tuple(o.shape) for o in outs]


@attrs.frozen
class ContextLayout:
    """How the driver lays a batch out for context parallelism: each of the ``microbatches``
    chunks (each cut into ``replicas`` data-parallel shards) becomes ``replicas * degree``
    pieces, piece ``j * degree + c`` holding chunk ``c`` of the sequences of shard ``j``
    (inputs, ``T / degree`` tokens) or those sequences whole (targets: the loss reads its
    chunk, counting the whole sequences' targets). The runtime then cuts it as it cuts any
    data-parallel batch."""

    microbatches: int
    replicas: int
    degree: int
    length: int
    sequences: int | None = None  # the batch's sequences (None: any that divides into the pieces)

    @classmethod
    def of(cls, program: Program) -> ContextLayout | None:
        degree = context_degree(program)
        if degree == 1:
            return None
        meta = program.value_by_name[program.targets[0]].meta
        replicas = program.replicas // degree
        return cls(program.microbatches, replicas, degree, meta.shape[1], meta.shape[0] * program.microbatches * replicas)

    def arrange(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
                ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(inputs, targets)`` in the layout (class doc); ``ValueError`` for a batch of
        another sequence length or one that does not divide into the pieces."""
        return (tuple(self._cut(t, chunk=True) for t in inputs), tuple(self._cut(t, chunk=False) for t in targets))

    def _cut(self, t: torch.Tensor, *, chunk: bool) -> torch.Tensor:
        m, r, n = self.microbatches, self.replicas, self.degree
        if t.dim() < 2 or t.shape[1] != self.length or self.sequences not in (None, t.shape[0]):
            count = f"{self.sequences} " if self.sequences is not None else ""
            raise ValueError(f"a batch value of shape {tuple(t.shape)}: context parallelism runs batches of the "
                             f"example's shape only ({count}sequences of {self.length} tokens)")
        if t.shape[0] % (m * r):
            raise ValueError(f"a batch of {t.shape[0]} sequences is not divisible into {m} microbatches x {r} "
                             "data-parallel replicas (context parallelism takes equal pieces only)")
        b, rest = t.shape[0] // (m * r), tuple(t.shape[2:])
        if chunk:
            pieces = t.reshape(m, r, b, n, self.length // n, *rest).transpose(2, 3)
        else:
            pieces = t.reshape(m, r, 1, b, self.length, *rest).expand(m, r, n, b, self.length, *rest)
        return pieces.reshape(m * r * n * b, *pieces.shape[4:]).contiguous()
