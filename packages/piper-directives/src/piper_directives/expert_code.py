"""Expert parallelism as a rewrite of the captured segments' code (torch side).

``shard_experts(graph, modules)`` takes a graph after ``Strategy.apply`` whose
``Graph.sharding`` holds ``kind="ep"`` records (``piper_directives.shard``) and the captured
segment modules, and returns both rewritten (docs/ir-conventions.md, section 9):

- In each expert-parallel segment's ``torch.fx`` graph, every call of an *expert module*
  (``piper_experts = True``, kept as one call by capture: ``experts(tokens, expert_ids)``,
  every parameter with the experts on dimension 0) becomes

      d = piper_ep_<k>("dispatch", tokens, expert_ids)  # all-to-all of counts, then tokens
      y = experts(d[0], d[1])                         # this rank's experts, local ids
      out = piper_ep_<k>("combine", y, *d[2:])        # the reverse all-to-all, caller's order

  ``dispatch`` sorts the tokens by expert, counts them per expert (``bincount``), exchanges the per-expert counts
  with one all-to-all, then sends each rank the tokens of its experts with an uneven
  ``all_to_all_single`` (rank ``r`` of ``N`` holds experts ``r*E/N .. (r+1)*E/N - 1``);
  the received tokens' ids follow from the counts, made local. ``combine`` returns the
  results to their senders and restores the caller's token order. Both are autograd functions whose backward is
  the reverse all-to-all.
- ``Sharding.params`` gets ``ParamShard(name, 0)`` for every expert parameter (rank ``r``
  keeps its block of experts) and ``collectives`` the number of expert calls.
- The segment's data-parallel buckets (``Graph.buckets``) are rebuilt: the replicated
  weights are reduced over the whole group. Within one expert-parallel group each expert
  lives on one rank, and its gradient already sums the group's tokens through the
  all-to-all; when the group is one of several data-parallel replicas (``Sharding.degree <
  len(devices)``), each expert's gradient is further reduced over the ranks holding it.

Under tensor parallelism (``shard_code``, one group seeing the same tokens) expert calls are
rewritten by ``shard_experts_tp`` instead: each rank runs its block of experts on the tokens
routed to them, with no all-to-all (TP with EP in one group). With an expert-parallel group
beside the tensor-parallel one (``Sharding.expert_degree``: several tensor-parallel groups
that are data-parallel replicas), each rank of a tensor-parallel group takes its share of
the group's tokens and the all-to-alls above route them over the expert-parallel group,
whose every rank holds its own block of experts (``ParamShard.experts``).

Regions that call no expert module stay data-parallel over the group (their Sharding cuts
nothing), so an embedding or a head in a region of its own runs beside expert regions.

Errors (``DirectiveError`` naming the ``Shard``): an expert count the group size does not
divide; a strategy whose ``Shard(kind="ep")``s find no expert module in any region; an expert
parameter without the experts on dimension 0; an expert module that draws random numbers
(dropout: each rank sees its routed tokens, so no mask can match one device); a recomputed
region that calls experts.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs
import torch
import torch.fx
from torch import nn

from piper_directives.collective_code import GroupCollectives
from piper_directives.segment_module import like
from piper_directives.shard_buckets import sharded_buckets
from piper_directives.shard_code import refuse_recompute
from piper_ir import DirectiveError, Graph, ParamShard, SegmentRole, Sharding, ShardKind

COMM = "piper_ep"


class AllToAll(Protocol):
    """What ``ExpertParallelComm`` needs of a communicator (the runtime's provide it)."""

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> None:
        """Member ``i`` sends ``input_splits[j]`` rows of ``input`` (in order) to member ``j``
        and receives ``output_splits[j]`` rows from it into ``output``; ``None``: even."""
        ...


class ExpertParallelComm(GroupCollectives[AllToAll]):
    """The all-to-alls of one expert-parallel group (the ``ep`` group's communicators).
    Unbound (the default) it is one rank holding every expert: dispatch and combine are
    identities."""

    traffic = "ep"  # the communicator the runtime binds (``piper_runtime.rank.sharding``)

    def __init__(self, degree: int, num_experts: int) -> None:
        super().__init__(degree)
        self.num_experts = num_experts

    def forward(self, op: str, *args: torch.Tensor) -> tuple[torch.Tensor, ...] | torch.Tensor:
        if op == "dispatch":
            return self.dispatch(*args)
        return self.combine(*args)

    def dispatch(self, tokens: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(received tokens, their local expert ids, send splits, receive splits, the
        permutation that restores the caller's token order)``."""
        if not self.bound:
            counts = torch.bincount(ids, minlength=self.num_experts)
            return tokens, ids, counts, counts, torch.arange(len(ids))
        n, local = self.degree, self.num_experts // self.degree
        order = torch.argsort(ids, stable=True)  # the tokens for rank r: one contiguous run
        counts = torch.bincount(ids, minlength=self.num_experts)
        # Exchange per-expert counts first: rank r learns how many tokens each rank sends
        # to each of its experts, hence its receive splits and the ids of what arrives.
        received = torch.empty_like(counts)
        self.timed(self.comm.all_to_all, received, counts.contiguous())
        send = counts.view(n, local).sum(1)
        per_source = received.view(n, local)  # [source rank, local expert]
        recv = per_source.sum(1)
        out = _AllToAll.apply(tokens[order], send.tolist(), recv.tolist(), self)
        local_ids = torch.arange(local).repeat(n).repeat_interleave(per_source.flatten())
        return out, local_ids, send, recv, torch.argsort(order)

    def combine(self, y: torch.Tensor, send: torch.Tensor, recv: torch.Tensor, restore: torch.Tensor) -> torch.Tensor:
        """The expert outputs back on the ranks that sent the tokens, in their order."""
        if not self.bound:
            return y
        return _AllToAll.apply(y, recv.tolist(), send.tolist(), self)[restore]


class _AllToAll(torch.autograd.Function):
    """An all-to-all with uneven splits; backward is the reverse all-to-all, on
    ``backward_comm`` (a forward and a backward may run at once on two threads)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, send: list[int], recv: list[int], comm: ExpertParallelComm
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.comm = send, recv, comm
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.timed(comm.comm.all_to_all, out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        ctx.comm.timed(ctx.comm.backward_comm.all_to_all, out, grad.contiguous(), ctx.send, ctx.recv)
        return out, None, None, None


def shard_experts(graph: Graph, modules: Mapping[str, nn.Module]) -> tuple[Graph, dict[str, nn.Module]]:
    """``graph`` with each ep ``Sharding``'s ``params`` and ``collectives`` filled in and the
    expert parameters out of the buckets, and the segment modules rewritten (module doc)."""
    out = dict(modules)
    records: list[Sharding] = []
    for sh in graph.sharding:
        if sh.kind is not ShardKind.EP:
            records.append(sh)
            continue
        module = modules[sh.segment]
        seg = graph.segment_by_id[sh.segment]
        if seg.role is SegmentRole.LOSS or not isinstance(module, torch.fx.GraphModule):
            records.append(sh)
            continue
        gm, params, count = _rewrite(module, sh)
        if count:
            refuse_recompute(seg, sh, "expert-parallel all-to-alls")
            out[sh.segment] = gm
        records.append(attrs.evolve(sh, params=params, collectives=count))
    if not any(r.collectives for r in records if r.kind is ShardKind.EP):
        raise DirectiveError(
            "no region it matches calls an expert module (an nn.Module with piper_experts = True, "
            "called as experts(tokens, expert_ids)), so there is nothing to shard across experts",
            directive=next(sh.origin for sh in graph.sharding if sh.kind is ShardKind.EP),
        )
    graph = attrs.evolve(graph, sharding=tuple(records))
    return attrs.evolve(graph, buckets=sharded_buckets(graph)), out


def _rewrite(module: torch.fx.GraphModule, sh: Sharding) -> tuple[torch.fx.GraphModule, tuple[ParamShard, ...], int]:
    gm = like(module, copy.deepcopy(module.graph))  # a SegmentModule stays one: it must pickle its graph
    calls = [
        n for n in gm.graph.nodes
        if n.op == "call_module" and getattr(gm.get_submodule(n.target), "piper_experts", False)
    ]
    if not calls:
        return module, (), 0
    g = gm.graph
    params: list[ParamShard] = []
    for k, call in enumerate(calls):
        experts, num = _expert_module(gm, call, sh)
        if num % sh.degree:
            raise DirectiveError(
                f"the expert-parallel group of {sh.degree} ranks does not divide the {num} experts of {call.target}",
                directive=sh.origin,
            )
        comm = f"{COMM}_{k}"
        gm.add_submodule(comm, ExpertParallelComm(sh.degree, num))
        params.extend(ParamShard(f"{call.target}.{name}", 0) for name, _ in experts.named_parameters())
        combined = _route(g, call, comm, call.args[0], call.args[1])
        call.replace_all_uses_with(combined, delete_user_cb=lambda user, keep=combined: user is not keep)
    g.lint()
    gm.recompile()
    return gm, tuple(params), len(calls)


def _route(g: torch.fx.Graph, call: torch.fx.Node, comm: str, tokens: torch.fx.Node, ids: torch.fx.Node) -> torch.fx.Node:
    """Route ``tokens`` (with expert ``ids``) through ``comm``'s dispatch to the ranks holding
    their experts before expert call ``call``, which then runs on what arrives, and back
    through its combine after it; the combine's node (the caller points ``call``'s users at it)."""
    with g.inserting_before(call):
        dispatch = g.call_module(comm, ("dispatch", tokens, ids))
        parts = [g.call_function(operator.getitem, (dispatch, i)) for i in range(5)]
    call.args = (parts[0], parts[1], *call.args[2:])
    with g.inserting_after(call):
        return g.call_module(comm, ("combine", call, *parts[2:]))


def _expert_module(gm: torch.fx.GraphModule, call: torch.fx.Node, sh: Sharding) -> tuple[nn.Module, int]:
    """The expert module ``call`` calls and its expert count, checked: every parameter holds
    the experts on dimension 0, and the module draws no random numbers."""
    experts = gm.get_submodule(call.target)
    num = _num_experts(experts, call.target, sh)
    _refuse_random(experts, call, sh)
    return experts, num


def _refuse_random(experts: nn.Module, call: torch.fx.Node, sh: Sharding) -> None:
    """An expert module that draws random numbers (dropout) cannot match one device: each rank
    runs its experts on the tokens routed to it, in an order of its own. It is probed: run once
    on two tokens per expert, does it move the random generator?"""
    num = _num_experts(experts, call.target, sh)
    d = next((p.shape[-1] for p in experts.parameters() if p.dim() >= 2), None)
    if d is None:
        return
    dtype = next(experts.parameters()).dtype
    tokens = torch.zeros(2 * num, d, dtype=dtype)
    ids = torch.arange(num).repeat(2)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        before = torch.random.get_rng_state()
        try:
            experts(tokens, ids)
        except Exception:
            return  # not callable on such a probe: nothing can be said
        drew = not torch.equal(before, torch.random.get_rng_state())
    if drew:
        raise DirectiveError(
            f"expert module {call.target} ({type(experts).__name__}) draws random numbers (dropout): under expert "
            "parallelism each rank runs its experts on the tokens routed to it, so no rank could draw the masks "
            "one device draws. Remove the dropout from the expert module (dropout before or after the expert "
            "call, on the region's own tokens, is fine)",
            directive=sh.origin,
        )


def _num_experts(experts: nn.Module, name: str, sh: Sharding) -> int:
    sizes = {p.shape[0] if p.dim() else 0 for p in experts.parameters()}
    declared = getattr(experts, "num_experts", None)
    if len(sizes) != 1 or (declared is not None and sizes != {declared}):
        raise DirectiveError(
            f"expert module {name}: every parameter must hold the experts on dimension 0 "
            f"(num_experts={declared}, leading sizes {sorted(sizes)})",
            directive=sh.origin,
        )
    return sizes.pop()




# ---------------------------------------------------------------------------------------------
# Experts split over a tensor-parallel group (``shard_code``): TP with EP in one group.


def expert_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Every call of an expert module (``piper_experts = True``) in ``gm``, in graph order."""
    return [n for n in gm.graph.nodes
            if n.op == "call_module" and getattr(gm.get_submodule(n.target), "piper_experts", False)]


def tp_route(comm: nn.Module, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of the tokens routed to this rank's experts (block ``position`` of
    ``degree``; unbound: block 0) and their local expert ids."""
    per = num_experts // comm.degree
    start = comm.position * per if comm.bound else 0
    idx = ((ids >= start) & (ids < start + per)).nonzero().squeeze(1)
    return idx, ids.index_select(0, idx) - start


def tp_place(y: torch.Tensor, idx: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's expert results at their tokens' positions, zeros elsewhere."""
    return y.new_zeros((tokens.shape[0], *y.shape[1:])).index_copy(0, idx, y)


def shard_experts_tp(gm: torch.fx.GraphModule, calls: Sequence[torch.fx.Node], sh: Sharding,
                     comm: str) -> list[ParamShard]:
    """Rewrite ``calls`` (expert module calls of ``gm``, a tensor-parallel segment whose
    ``comm`` submodule is a ``TensorParallelComm``) to split the experts over the group.

    Every rank of a tensor-parallel group sees the same tokens, so no all-to-all is needed:
    rank ``r`` of ``N`` holds experts ``r*E/N .. (r+1)*E/N - 1`` (``ParamShard(param, 0)``),
    runs them on the tokens routed to them (read through ``f``: each rank's gradient of the
    tokens is its experts' part, summed in backward), writes zeros for the others, and ``g``
    sums the group's results: exactly one device's output, each expert's gradient from every
    token routed to it. With an expert-parallel group (``Sharding.expert_degree``):
    ``_shard_experts_tp_ep``."""
    if sh.expert_degree > 1:
        return _shard_experts_tp_ep(gm, calls, sh, comm)
    g = gm.graph
    params: list[ParamShard] = []
    for call in calls:
        experts, num = _expert_module(gm, call, sh)
        params.extend(ParamShard(f"{call.target}.{name}", 0) for name, _ in experts.named_parameters())
        tokens, ids = call.args[0], call.args[1]
        with g.inserting_before(call):
            whole = g.call_module(comm, (tokens, "f"))
            route = g.call_function(tp_route, (g.get_attr(comm), ids, num))
            idx = g.call_function(operator.getitem, (route, 0))
            local = g.call_function(operator.getitem, (route, 1))
            mine = g.call_function(torch.index_select, (whole, 0, idx))
        call.args = (mine, local, *call.args[2:])
        with g.inserting_after(call):
            placed = g.call_function(tp_place, (call, idx, whole))
        with g.inserting_after(placed):
            summed = g.call_module(comm, (placed, "g"))
        call.replace_all_uses_with(summed, delete_user_cb=lambda user, keep=placed: user is not keep)
    return params


def divides_experts(gm: torch.fx.GraphModule, call: torch.fx.Node, sh: Sharding) -> bool:
    """Whether the group the experts are split over (the expert-parallel one when the
    segment has one, else the tensor-parallel one) divides the experts of ``call``'s module."""
    return _num_experts(gm.get_submodule(call.target), call.target, sh) % experts_degree(sh) == 0


def experts_degree(sh: Sharding) -> int:
    """How many ways a tensor-parallel segment's experts are split: over its expert-parallel
    group when it has one, else over its tensor-parallel group."""
    return sh.expert_degree if sh.expert_degree > 1 else sh.degree


def tp_share(comm: nn.Module, ep: ExpertParallelComm, ids: torch.Tensor) -> torch.Tensor:
    """The positions of the tokens this rank of a tensor-parallel group routes over the
    expert-parallel group: its contiguous share (block ``position`` of ``degree``, uneven
    when the degree does not divide the tokens). Unbound (no group: rank 0's experts alone),
    the tokens routed to the first block of experts, whose ids are then local already."""
    if not ep.bound:
        return (ids < ep.num_experts // ep.degree).nonzero().squeeze(1)
    n, position = ids.shape[0], comm.position
    return torch.arange(position * n // comm.degree, (position + 1) * n // comm.degree, device=ids.device)


def _shard_experts_tp_ep(gm: torch.fx.GraphModule, calls: Sequence[torch.fx.Node], sh: Sharding,
                         comm: str) -> list[ParamShard]:
    """``shard_experts_tp`` for a segment with an expert-parallel group (module doc): per
    call, ``f`` on the tokens (each rank's gradient is its share's, summed in backward), this
    rank's share, the dispatch/combine all-to-alls over the ``expert_degree`` group, the
    results placed at the share's positions and summed over the tensor-parallel group by
    ``g``: one device's output, each expert's gradient from every token routed to it."""
    g = gm.graph
    params: list[ParamShard] = []
    for k, call in enumerate(calls):
        experts, num = _expert_module(gm, call, sh)
        params.extend(ParamShard(f"{call.target}.{name}", 0, experts=True) for name, _ in experts.named_parameters())
        ep = f"{COMM}_{k}"
        gm.add_submodule(ep, ExpertParallelComm(sh.expert_degree, num))
        tokens, ids = call.args[0], call.args[1]
        with g.inserting_before(call):
            whole = g.call_module(comm, (tokens, "f"))
            idx = g.call_function(tp_share, (g.get_attr(comm), g.get_attr(ep), ids))
            mine = g.call_function(torch.index_select, (whole, 0, idx))
            mine_ids = g.call_function(torch.index_select, (ids, 0, idx))
        combined = _route(g, call, ep, mine, mine_ids)
        with g.inserting_after(combined):
            placed = g.call_function(tp_place, (combined, idx, whole))
        with g.inserting_after(placed):
            summed = g.call_module(comm, (placed, "g"))
        call.replace_all_uses_with(summed, delete_user_cb=lambda user, keep=combined: user is not keep)
    return params
