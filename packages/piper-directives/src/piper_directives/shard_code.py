"""Megatron-style tensor parallelism as a rewrite of the captured segments' code (torch side).

``shard_modules(graph, modules)`` takes a graph after ``Strategy.apply`` (its
``Graph.sharding`` names the tensor-parallel segments, ``piper_directives.shard``) and the
captured segment modules, and returns both rewritten:

- In each sharded segment's ``torch.fx`` graph, every ``nn.Linear`` whose output reaches
  exactly one other ``nn.Linear`` through non-Linear operations only (and nowhere else: not
  the segment's outputs), where those operations mix in no other activation, forms a
  *column-parallel* / *row-parallel* pair: attention's qkv and output projections, an MLP's
  two Linears. The column Linear's weight (and bias) is cut on its output features, the row
  Linear's weight on its input features; every rank of the group computes its heads / hidden
  units, and the row Linear's partial products are summed by an all-reduce before its bias
  is added (Megatron's ``g``). The column Linear's input passes through Megatron's ``f``
  (identity forward, all-reduce of the gradient in backward).
- The column Linear's output may be reshaped only by ``unflatten(-1, (..., -1, d_head))``:
  the ``-1`` marks the axis cut across ranks (the heads) and the factors before it are
  groups (``(3, -1, d_head)``: q, k and v, cut separately). This is the convention a user's
  attention block follows to be tensor-sharded; it also keeps the code free of a hard-coded
  head count, so the same code runs on a shard.
- Linears that meet before one Linear (q/k/v -> attention -> o, ``silu(w1 x) * w3 x -> w2``),
  also at aten level as torch.export captures them (``aten.linear(x, weight, bias)``, head
  counts baked into views), form a *column group* (``piper_directives.shard_groups``): the cut
  follows each column's output through the code by its shapes (``shard_heads``), reshapes
  get the shard's head counts, key/value heads the degree does not divide (grouped-query
  attention) stay whole and each rank narrows them to its query heads' ones.
- the token embedding, the output head and the loss are cut by vocabulary
  (``piper_directives.shard_vocab``: the head's logits stay sliced, the loss segment's module
  becomes a ``VocabParallelLoss`` computing a parallel cross-entropy), where it is safe or a
  plan names them (``embedding_vocab``, ``colwise_vocab``);
- ``Graph.sharding`` gets each segment's ``params`` (``ParamShard``: name, dim, groups) and
  its forward collective count (one all-reduce per row Linear; one per vocabulary-cut
  embedding, head and loss).

Regions with nothing to cut stay whole on every rank of the group (the same data, no
communication: replicated over it). Dropout on the cut activations between a column and a row
Linear draws the whole activation's mask on every rank and keeps the rank's piece
(``shard_dropout``); any other random draw there is refused. Dropout on whole activations
draws one device's masks (every rank of a group draws the same, for its data-parallel shard:
``piper_semantics.randomness``).

Errors (``DirectiveError`` naming the ``Shard``): a TP degree that does not divide the heads or
the hidden size, a column output reshaped another way, a random draw inside a pair other than
dropout, a recomputed
region holding a pair, an operation in a column group not known to act per head (named with
its module, line and rule), and a strategy whose ``Shard``s find no Linear pair or column group
in any region. The rewritten code is run once on one rank's shard of the weights (collectives
unbound, i.e. identity) to check it accepts the shard's shapes.

The collectives call a ``TensorParallelComm`` submodule (``piper_tp``) that the runtime binds
to the segment's ``tp`` communicators (``bind_communicator``: any object with an in-place
``all_reduce(tensor)``, ``AllReduce``; this package never calls ``torch.distributed``);
weights are cut by the runtime from ``Sharding.params``, so the modules here hold full
weights.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Mapping
from typing import Protocol

import attrs
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from piper_directives import shard_dropout, shard_groups, shard_sequence, shard_vocab
from piper_directives.collective_code import GroupCollectives
from piper_directives.diagnose import describe
from piper_directives.segment_module import like
from piper_directives.shard_buckets import sharded_buckets
from piper_ir import DirectiveError, Graph, ParamShard, Segment, SegmentRole, Sharding, ShardKind

COMM = "piper_tp"
_RESHAPES = {"view", "reshape", "unflatten", "flatten", "split", "chunk", "unbind"}


class AllReduce(Protocol):
    """What ``TensorParallelComm`` needs of a communicator (the runtime's provide it)."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        ...


class TensorParallelComm(GroupCollectives[AllReduce]):
    """The communicators a tensor-parallel segment's collectives run on (the ``tp`` group's);
    unbound (the default) it is the identity, as for one rank holding everything."""

    def all_reduce(self, t: torch.Tensor, backward: bool = False) -> torch.Tensor:
        if self.comm is None:
            return t
        t = t.contiguous().clone()
        self.timed((self.backward_comm if backward else self.comm).all_reduce, t)
        return t

    position: int = 0  # this rank's place in its group (0 unbound: rank 0's shard)

    def bind_communicator(self, comm: AllReduce, backward_comm: AllReduce | None = None, position: int = 0) -> None:
        """The runtime's binding (``GroupCollectives``), with this rank's ``position`` in its
        group, which picks its block where a whole tensor meets cut ones (``"local"``)."""
        super().bind_communicator(comm, backward_comm)
        self.position = position

    def forward(self, x: torch.Tensor, op: str, dim: int = 0) -> torch.Tensor:
        """``"f"``, ``"g"`` (Megatron's), or ``"local"``: ``f``, then this rank's block of
        axis ``dim`` of a whole tensor (of ``s`` entries: block ``position`` of ``degree`` when
        the degree divides ``s``, else entry ``position * s // degree``: the key/value head of
        this rank's query heads)."""
        if op in shard_sequence.SP_OPS:
            return shard_sequence.collective(self, x, op, dim)
        if op == "local":
            s = x.shape[dim]
            start = self.position * s // self.degree
            return _CopyToGroup.apply(x, self).narrow(dim, start, max(s // self.degree, 1))
        return (_CopyToGroup if op == "f" else _ReduceFromGroup).apply(x, self)


class _CopyToGroup(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: TensorParallelComm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.all_reduce(grad, backward=True), None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward (summing the row-parallel partial products),
    identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: TensorParallelComm) -> torch.Tensor:
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@attrs.frozen
class _Pair:
    col: torch.fx.Node
    row: torch.fx.Node
    groups: int
    # an unflatten(-1, (..., heads, -1)) whose -1 is the head size: its head count, on a shard
    resize: tuple[torch.fx.Node, tuple[int, ...]] | None = None
    # the dropouts between them, drawn on cut activations (``shard_dropout``)
    draws: tuple[torch.fx.Node, ...] = ()


def shard_modules(graph: Graph, modules: Mapping[str, nn.Module]) -> tuple[Graph, dict[str, nn.Module]]:
    """``graph`` with each ``Sharding``'s ``params`` and ``collectives`` filled in, and the
    segment modules with tensor-parallel code (module doc); expert-parallel shardings go
    to ``piper_directives.expert_code.shard_experts``. Unsharded segments keep their
    modules; the given modules are not changed."""
    out = dict(modules)
    if not graph.sharding:
        return graph, out
    if any(sh.kind is ShardKind.EP for sh in graph.sharding):
        from piper_directives.expert_code import shard_experts

        return shard_experts(graph, modules)
    records: list[Sharding] = []
    cuts = shard_vocab.decide(graph, modules, _shapes, _example_args)
    named: set[str] = set()  # the plan patterns that name a Linear somewhere
    existing: set[str] = set()  # every Linear's path, for the message of a pattern that names none
    for sh in graph.sharding:
        seg = graph.segment_by_id[sh.segment]
        module = modules[sh.segment]
        if seg.role is SegmentRole.LOSS and sh.segment in cuts.loss:  # the logits come cut by vocabulary
            out[sh.segment] = shard_vocab.VocabParallelLoss(module, TensorParallelComm(sh.degree), cuts.loss[sh.segment])
            records.append(attrs.evolve(sh, collectives=1))
            continue
        if seg.role is SegmentRole.LOSS or not isinstance(module, torch.fx.GraphModule):
            records.append(sh)
            continue
        paths = [shard_groups.path_of(lin) for lin in shard_groups.linears(module)]
        paths += [e.path for e in shard_vocab.embeddings(module)]
        paths += [str(n.target) for n in _experts_code().expert_calls(module)]
        existing.update(paths)
        named |= {p for p, _ in sh.plan if any(shard_groups.matches(p, path) for path in paths)}
        with torch.random.fork_rng(devices=[]):
            args = _example_args(graph, sh)
        vocab = (cuts.embeddings.get(sh.segment, ()), cuts.heads.get(sh.segment, ()))
        gm, params, count = _rewrite(module, sh, args, vocab)
        if count and sh.sequence_parallel:
            _sequence_parallel(graph, sh, gm, params)
        if count:
            refuse_recompute(seg, sh, "tensor-parallel all-reduces")
            _check_shapes(graph, sh, gm, params, cuts.outputs.get(sh.segment, frozenset()))
            out[sh.segment] = gm
        records.append(attrs.evolve(sh, params=params, collectives=count))
    planned = {p: sh.origin for sh in graph.sharding for p, _ in sh.plan}
    for pattern, origin in planned.items():
        if pattern not in named:
            raise DirectiveError(
                f"the plan's pattern {pattern!r} names no Linear of the regions it shards ('*' matches one "
                "path component; a Linear's path is its module's, as in model.named_modules()); the Linears "
                f"there: {', '.join(_paths_listed(existing)) or 'none'}",
                directive=origin,
            )
    expert_parallel = [r for r in records if r.expert_degree > 1]
    if expert_parallel and not any(p.experts for r in expert_parallel for p in r.params):
        raise DirectiveError(
            "no region it matches calls an expert module (an nn.Module with piper_experts = True, called as "
            "experts(tokens, expert_ids)), so there is nothing to shard across experts (expert_degree)",
            directive=expert_parallel[0].origin,
        )
    if not any(r.collectives for r in records):
        raise DirectiveError(
            "no region it matches holds a column-/row-parallel Linear pair (a Linear whose output "
            "reaches exactly one other Linear) or column group (Linears whose outputs meet before one "
            "Linear, such as q/k/v -> attention -> o), so there is nothing to shard",
            directive=graph.sharding[0].origin,
        )
    graph = attrs.evolve(graph, sharding=tuple(records))
    return attrs.evolve(graph, buckets=sharded_buckets(graph)), out


def _paths_listed(paths: set[str]) -> list[str]:
    """``paths`` for a message: numbered components (``layers.3``) written ``*``, each once."""
    return sorted({".".join("*" if part.isdigit() else part for part in path.split(".")) for path in paths})


def refuse_recompute(seg: Segment, sh: Sharding, what: str) -> None:
    """A recomputed segment may not issue collectives: recomputing it inside its backward
    would issue its forward's collectives again, on the thread (and communicator) of the
    backward, in an order no plan describes."""
    if seg.recompute:
        raise DirectiveError(
            f"region {seg.id} ({seg.tags}) is recomputed (Recompute or torch.utils.checkpoint) and issues "
            f"{what} inside its forward; recomputing a sharded region is not supported: recompute other "
            "regions, or do not shard this one",
            directive=sh.origin,
        )


def _rewrite(
    module: torch.fx.GraphModule, sh: Sharding, args: list[torch.Tensor],
    vocab: tuple[tuple[str, ...], tuple[str, ...]] = ((), ()),
) -> tuple[torch.fx.GraphModule, tuple[ParamShard, ...], int]:
    """``module`` rewritten for ``sh`` (module doc), with the embeddings and heads whose
    weights ``vocab`` names cut by vocabulary (``shard_vocab``); the parameters cut and the
    number of collectives of one forward."""
    gm = like(module, copy.deepcopy(module.graph))  # a SegmentModule stays one: it must pickle its graph
    pairs = [] if sh.plan else _find_pairs(gm, sh)  # a plan names every Linear cut: groups only
    taken = {n for p in pairs for n in (p.col, p.row)}
    taken |= {lin.node for lin in shard_groups.linears(gm) if lin.weight in vocab[1]}  # vocabulary heads
    if not sh.plan:  # a router: its output picks experts, it is no column of the Linear its tokens reach
        taken |= _routers(gm)
    groups = []
    if len(shard_groups.linears(gm)) > len(taken):
        _shapes(gm, args)
        try:
            groups = shard_groups.find_groups(gm, sh, taken)
        finally:
            for n in gm.graph.nodes:  # shape metadata does not pickle; the runtime gets the module
                n.meta.pop("tensor_meta", None)
    embedded, heads = vocab
    experts = _tp_experts(gm, sh)
    if not pairs and not groups and not embedded and not heads and not experts:
        return module, (), 0
    gm.add_submodule(COMM, TensorParallelComm(sh.degree))
    params: list[ParamShard] = []
    # The draws on cut activations, with their column and row Linears (``shard_dropout``).
    ends = {n: (p.col, p.row) for p in pairs for n in p.draws}
    for group in groups:
        col, row = group.columns[0].node, group.row.node
        ends.update(dict.fromkeys(shard_dropout.cut_draws(gm, col, set(group.plan.origin.keys()), row, sh), (col, row)))
        params.extend(shard_groups.rewrite(gm, group, COMM))
    g = gm.graph
    for pair in pairs:
        col_mod: nn.Linear = gm.get_submodule(pair.col.target)
        row_mod: nn.Linear = gm.get_submodule(pair.row.target)
        params.append(ParamShard(f"{pair.col.target}.weight", 0, pair.groups))
        if col_mod.bias is not None:
            params.append(ParamShard(f"{pair.col.target}.bias", 0, pair.groups))
        params.append(ParamShard(f"{pair.row.target}.weight", 1, 1))
        if pair.resize is not None:
            node, sizes = pair.resize
            node.args = (*node.args[:2], sizes, *node.args[3:])
        with g.inserting_before(pair.col):
            f = g.call_module(COMM, (pair.col.args[0], "f"))
        pair.col.args = (f, *pair.col.args[1:])
        with g.inserting_before(pair.row):
            weight = g.get_attr(f"{pair.row.target}.weight")
            partial = g.call_function(F.linear, (pair.row.args[0], weight))
            partial.meta.update({k: v for k, v in pair.row.meta.items() if k in ("stack_trace", "nn_module_stack")})
            result = g.call_module(COMM, (partial, "g"))
            if row_mod.bias is not None:
                bias = g.get_attr(f"{pair.row.target}.bias")
                result = g.call_function(operator.add, (result, bias))
        pair.row.replace_all_uses_with(result)
        g.erase_node(pair.row)
    # After the pairs and groups (whose Linears hold their input nodes): the vocabulary cut, experts.
    for e in shard_vocab.embeddings(gm):
        if e.weight in embedded:
            params.append(ParamShard(e.weight, 0, 1))
            shard_vocab.rewrite_embedding(gm, e, COMM)
    for lin in shard_groups.linears(gm):
        if lin.weight in heads:  # the vocabulary-parallel head: each rank computes its slice of the logits
            params += [ParamShard(lin.weight, 0, 1)] + ([ParamShard(lin.bias, 0, 1)] if lin.bias else [])
            with gm.graph.inserting_before(lin.node):
                f = gm.graph.call_module(COMM, (lin.input, "f"))
            lin.node.replace_input_with(lin.input, f)
    params += _experts_code().shard_experts_tp(gm, experts, sh, COMM)
    params = _canonical(gm, params)
    g.lint()
    if not sh.sequence_parallel:  # else sequence parallelism rewrites the code again, then compiles it
        gm.recompile()
    if ends:
        _whole_masks(module, gm, ends, sh, args, params)
    return gm, tuple(params), len(pairs) + len(groups) + len(embedded) + len(heads) + len(experts)


def _canonical(gm: torch.fx.GraphModule, params: list[ParamShard]) -> list[ParamShard]:
    """``params`` once per tensor, under the name the segment lists it by (the first in
    ``named_parameters()``): a tied embedding and head in one region are one tensor."""
    first = {id(p): name for name, p in gm.named_parameters()}
    out: dict[str, ParamShard] = {}
    for spec in params:
        name = first.get(id(gm.get_parameter(spec.name)), spec.name)
        out.setdefault(name, attrs.evolve(spec, name=name))
    return list(out.values())


def _routers(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The Linears whose output picks the experts of an expert module call (reaches its
    expert ids before any other Linear)."""
    ids = {c.args[1] for c in _experts_code().expert_calls(gm) if len(c.args) > 1}
    if not ids:
        return set()
    found = shard_groups.linears(gm)
    stops = {lin.node for lin in found}
    return {lin.node for lin in found if (shard_groups.region_after(lin.node, stops)[0] | {lin.node}) & ids}


def _experts_code():  # the module: expert_code imports this one
    from piper_directives import expert_code

    return expert_code


def _tp_experts(gm: torch.fx.GraphModule, sh: Sharding) -> list[torch.fx.Node]:
    """The expert module calls to split over the tensor-parallel group (``expert_code``'s
    ``shard_experts_tp``): without a plan those whose experts the degree divides, with one
    those it names ``experts`` (refused where the degree does not divide them)."""
    code = _experts_code()
    calls = code.expert_calls(gm)
    if sh.plan:
        named = [c for c in calls if shard_groups.style_for(str(c.target), sh.plan) == "experts"]
    elif sh.expert_degree > 1:  # an expert-parallel group asked for: every call must split over it
        named = calls
    else:
        return [c for c in calls if code.divides_experts(gm, c, sh)]
    group = "expert-parallel" if sh.expert_degree > 1 else "tensor-parallel"
    for c in named:
        if not code.divides_experts(gm, c, sh):
            raise DirectiveError(
                f"the {group} group of {code.experts_degree(sh)} ranks does not divide the experts of {c.target}"
                f"{' (the plan names it experts)' if sh.plan else ''} ({describe(c)})",
                directive=sh.origin,
            )
    return named


def _find_pairs(gm: torch.fx.GraphModule, sh: Sharding) -> list[_Pair]:
    linears = [
        n for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear)
    ]
    linear_set = set(linears)
    rows: set[torch.fx.Node] = set()
    pairs: list[_Pair] = []
    free: dict[torch.fx.Node, bool] = {}
    for col in linears:
        if col in rows:
            continue
        region, reached, escapes = shard_groups.region_after(col, linear_set)
        if escapes or len(reached) != 1:
            continue
        row = reached.pop()
        if row in rows or not _closed(col, region, row, free):
            continue
        draws = tuple(shard_dropout.cut_draws(gm, col, region, row, sh))
        groups, resize = _groups(gm, col, sh)
        col_mod, row_mod = gm.get_submodule(col.target), gm.get_submodule(row.target)
        if groups == 1 and col_mod.out_features % sh.degree:
            raise DirectiveError(
                f"tensor-parallel degree {sh.degree} does not divide the hidden size {col_mod.out_features} "
                f"of {col.target} -> {row.target}",
                directive=sh.origin,
            )
        if row_mod.in_features % sh.degree:
            raise DirectiveError(
                f"tensor-parallel degree {sh.degree} does not divide the input features ({row_mod.in_features}) "
                f"of row-parallel {row.target}",
                directive=sh.origin,
            )
        rows.add(row)
        pairs.append(_Pair(col, row, groups, resize, draws))
    return pairs


def _closed(col: torch.fx.Node, region: set[torch.fx.Node], row: torch.fx.Node, free: dict) -> bool:
    """Whether the region between ``col`` and ``row`` mixes in no other activation: every
    input of its nodes is in the region, ``col``, or computed from attributes and sizes only."""
    inside = region | {col}
    for n in [*region, row]:
        for a in n.all_input_nodes:
            if a not in inside and not _data_free(a, free):
                return False
    return row.args[0] in inside and len(row.all_input_nodes) == 1


def _data_free(n: torch.fx.Node, memo: dict) -> bool:
    """Whether ``n`` depends on no activation (only on attributes, constants and sizes)."""
    if n not in memo:
        if n.op == "get_attr":
            memo[n] = True
        elif n.op == "placeholder":
            memo[n] = False
        elif n.op == "call_method" and n.target == "size":
            memo[n] = True
        else:
            memo[n] = all(_data_free(a, memo) for a in n.all_input_nodes)
    return memo[n]


def _groups(gm: torch.fx.GraphModule, col: torch.fx.Node, sh: Sharding
            ) -> tuple[int, tuple[torch.fx.Node, tuple[int, ...]] | None]:
    """How many blocks the column Linear's output features form (1, or e.g. 3 for fused
    q/k/v), from the ``unflatten(-1, (..., -1, d_head))`` that may follow it; and, for
    ``unflatten(-1, (..., heads, -1))`` (the ``-1`` the head size, as nanoGPT-style code
    writes it), that node with the shard's head count (None otherwise)."""
    out = gm.get_submodule(col.target).out_features
    for user in col.users:
        if not (user.op in ("call_method", "call_function") and _name(user.target) in _RESHAPES):
            continue
        sizes = user.args[2] if len(user.args) > 2 else user.kwargs.get("sizes")
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
        if _name(user.target) != "unflatten" or dim != -1 or not isinstance(sizes, tuple | list) or sizes.count(-1) != 1:
            raise DirectiveError(
                f"the output of column-parallel {col.target} is reshaped by {user.format_node()}; reshape it "
                "only with unflatten(-1, (..., -1, d_head)), the -1 marking the head axis that ranks split",
                directive=sh.origin,
            )
        k = list(sizes).index(-1)
        resize = None
        if k == len(sizes) - 1 and k >= 1 and isinstance(sizes[k - 1], int):  # (..., heads, -1): -1 is d_head
            heads = sizes[k - 1]
            if heads % sh.degree:
                raise DirectiveError(
                    f"tensor-parallel degree {sh.degree} does not divide the {heads} heads of {col.target} "
                    f"(unflattened to {tuple(sizes)})",
                    directive=sh.origin,
                )
            local = (*sizes[: k - 1], heads // sh.degree, -1)
            resize = (user, type(sizes)(local))
            groups = math.prod(sizes[: k - 1])
            if not all(isinstance(s, int) for s in sizes) or out % (groups * heads):
                raise DirectiveError(
                    f"{out} output features of {col.target} do not unflatten to {tuple(sizes)}", directive=sh.origin
                )
            return groups, resize
        if not all(isinstance(s, int) for s in sizes):
            raise DirectiveError(
                f"the output of column-parallel {col.target} is unflattened to {sizes}: sizes must be constants",
                directive=sh.origin,
            )
        groups, inner = math.prod(sizes[:k]), math.prod(sizes[k + 1 :])
        heads, rest = divmod(out, groups * inner)
        if rest:
            raise DirectiveError(
                f"{out} output features of {col.target} do not unflatten to {tuple(sizes)}", directive=sh.origin
            )
        if heads % sh.degree:
            raise DirectiveError(
                f"tensor-parallel degree {sh.degree} does not divide the {heads} heads of {col.target} "
                f"({out} features as {tuple(sizes)})",
                directive=sh.origin,
            )
        return groups, None
    return 1, None


def _name(target: object) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def shard_tensor(t: torch.Tensor, spec: ParamShard, degree: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor ``t`` (a copy)."""
    return torch.cat([t.narrow(spec.dim, a, n) for a, n in spec.pieces(t.shape[spec.dim], degree, rank)], spec.dim)


def _sequence_parallel(graph: Graph, sh: Sharding, gm: torch.fx.GraphModule, params: tuple[ParamShard, ...]) -> None:
    """Rewrite ``gm`` (tensor-parallel already) for sequence parallelism
    (``shard_sequence``), on the full shapes of the code between its tensor-parallel regions
    (recorded from a run on rank 0's shard of the weights, collectives unbound)."""
    if _experts_code().expert_calls(gm):
        raise DirectiveError(
            "sequence parallelism with experts split over the tensor-parallel group is not supported: run "
            "the experts' regions without it",
            directive=sh.origin,
        )
    with torch.random.fork_rng(devices=[]):
        metas = _propagated(gm, _example_args(graph, sh), _shards(gm, sh, params))
    for n in gm.graph.nodes:
        if metas.get(n.name) is not None:
            n.meta["tensor_meta"] = metas[n.name]
    try:
        shard_sequence.rewrite(gm, sh, COMM)
    finally:
        for n in gm.graph.nodes:
            n.meta.pop("tensor_meta", None)
    gm.graph.lint()
    gm.recompile()


def _shards(gm: torch.fx.GraphModule, sh: Sharding, params: tuple[ParamShard, ...]
            ) -> dict[int, torch.Tensor]:
    """Rank 0's shard of each parameter ``params`` cuts, by the id of ``gm``'s full tensor (a
    tensor shared under two names, a tied embedding and head, is cut once)."""
    cut: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for spec in params:
            p = gm.get_parameter(spec.name)
            if id(p) not in cut:
                cut[id(p)] = shard_tensor(p.data, spec, sh.degree_of(spec), 0)
    return cut


def _probe(gm: torch.fx.GraphModule, shards: Mapping[int, torch.Tensor] | None = None) -> torch.fx.GraphModule:
    """A copy of ``gm``'s state (submodules, parameters, buffers, attributes) that runs
    ``gm``'s graph and compiled code, so a check's run changes nothing of ``gm``'s: a
    ``deepcopy`` less the graph's copy and recompilation, which cost more than the run;
    ``shards`` (``_shards``) stand in for the full parameters of those ids."""
    memo: dict[int, object] = {id(gm.graph): gm.graph}
    for p in gm.parameters():
        if shards is not None and id(p) in shards:
            memo[id(p)] = nn.Parameter(shards[id(p)], requires_grad=p.requires_grad)
    probe = object.__new__(type(gm))  # gm's own class: its forward is gm's compiled code
    probe.__dict__.update(copy.deepcopy(gm.__dict__, memo))
    return probe


def _propagated(gm: torch.fx.GraphModule, args: list[torch.Tensor],
                shards: Mapping[int, torch.Tensor] | None = None) -> dict[str, object]:
    """The ``tensor_meta`` of each of ``gm``'s nodes (by name, None where there is none) after
    shape propagation on ``args`` through a ``_probe`` (holding ``shards``), ``gm``'s nodes'
    metadata left as they were."""
    keys = ("tensor_meta", "type")  # what ShapeProp writes
    missing = object()
    before = {n: tuple(n.meta.get(k, missing) for k in keys) for n in gm.graph.nodes}
    try:
        with torch.no_grad():
            ShapeProp(_probe(gm, shards)).propagate(*args)
        return {n.name: n.meta.get("tensor_meta") for n in gm.graph.nodes}
    finally:
        for n, values in before.items():
            for k, v in zip(keys, values, strict=True):
                if v is missing:
                    n.meta.pop(k, None)
                else:
                    n.meta[k] = v


def _check_shapes(graph: Graph, sh: Sharding, gm: torch.fx.GraphModule, params: tuple[ParamShard, ...],
                  sliced: frozenset[str] = frozenset()) -> None:
    """Run the rewritten code on rank 0's shard of the weights (collectives unbound); the
    outputs ``sliced`` (vocabulary-cut logits) are one rank's slice of their last axis."""
    seg = graph.segment_by_id[sh.segment]
    probe = _probe(gm, _shards(gm, sh, params))
    with torch.no_grad():
        args = _example_args(graph, sh)
        try:
            outs = probe(*args)
        except Exception as err:
            raise DirectiveError(
                f"segment {seg.id}'s code does not run on a tensor-parallel shard of its weights: {err} "
                "(a hard-coded head count or hidden size?)",
                directive=sh.origin,
            ) from err
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    for name, o in zip(seg.outputs, outs, strict=True):
        want = graph.value_by_name[name].meta.shape
        if name in sliced:
            want = shard_vocab.sliced_shape(want, sh.degree)
        if tuple(o.shape) != tuple(want):
            raise DirectiveError(
                f"segment {seg.id}'s output {name} has shape {tuple(o.shape)} on a tensor-parallel shard, "
                f"not {tuple(want)}",
                directive=sh.origin,
            )


def _whole_masks(module: torch.fx.GraphModule, gm: torch.fx.GraphModule,
                 ends: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]], sh: Sharding,
                 args: list[torch.Tensor], params: list[ParamShard]) -> None:
    """The draws on cut activations rewritten to one device's masks (``shard_dropout``), from
    their inputs' shapes on one device (``module``) and on rank 0's shard (``gm``)."""
    names = {n.name for n in ends}
    full = {n: tuple(s) for n, s in _input_shapes(module, args, names).items()}
    local = {n: tuple(s) for n, s in _input_shapes(gm, args, names, _shards(gm, sh, tuple(params))).items()}
    shard_dropout.draw_whole_masks(gm, list(ends), COMM, sh, full, local, ends)
    gm.graph.lint()
    if not sh.sequence_parallel:  # as in ``_rewrite``
        gm.recompile()


def _input_shapes(gm: torch.fx.GraphModule, args: list[torch.Tensor], names: set[str],
                  shards: Mapping[int, torch.Tensor] | None = None) -> dict[str, torch.Size]:
    """The shape of the first input of each node named in ``names``, from a run of a
    ``_probe`` (holding ``shards``)."""
    with torch.random.fork_rng(devices=[]):
        metas = _propagated(gm, args, shards)
    out = {}
    for n in gm.graph.nodes:
        first = n.args[0] if n.args else None
        if n.name in names and isinstance(first, torch.fx.Node) and metas.get(first.name) is not None:
            out[n.name] = metas[first.name].shape
    return out


def _shapes(gm: torch.fx.GraphModule, args: list[torch.Tensor]) -> None:
    """Record the full shape of every value of ``gm`` (``meta["tensor_meta"]``), which the
    column groups' cut follows, from a run of a ``_probe`` (buffers such as running
    statistics and the random generators are left as they were)."""
    with torch.random.fork_rng(devices=[]):
        metas = _propagated(gm, args)
    for n in gm.graph.nodes:
        if metas.get(n.name) is not None:
            n.meta["tensor_meta"] = metas[n.name]


def _example_args(graph: Graph, sh: Sharding) -> list[torch.Tensor]:
    """Inputs of the segment's shapes and dtypes (random floats, zero integers)."""
    args = []
    for name in graph.segment_by_id[sh.segment].inputs:
        meta = graph.value_by_name[name].meta
        dtype = getattr(torch, meta.dtype)
        args.append(torch.randn(meta.shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(meta.shape, dtype=dtype))
    return args
