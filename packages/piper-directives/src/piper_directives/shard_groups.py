"""Column groups: several column-parallel Linears meeting before one row-parallel Linear (torch side).

``shard_code`` rewrites a pair (one Linear into one Linear, through code that mixes in no
other activation) by the ``unflatten(-1, (..., -1, d_head))`` convention. A LLaMA-family
block has no such pair: q, k and v meet in attention before ``wo``, ``w1`` and ``w3`` meet in
``silu(w1 x) * w3 x`` before ``w2``, and code captured by torch.export reads its Linears as
``aten.linear(x, weight, bias)`` with head counts baked into its views. Here:

- a *Linear* is an ``nn.Linear`` call, or ``linear`` (``F.linear``, ``aten.linear``) whose
  weight is a 2-D parameter read by ``get_attr`` (its bias one too);
- a *column group* is the Linears whose outputs reach, through non-Linear code, exactly one
  Linear (the row) and never the segment's outputs;
- the cut follows each column's output through that code (``shard_heads``): heads split over
  the group, size constants of reshapes rewritten to the shard's; a column whose heads the
  degree does not divide but is a multiple of (grouped-query key/value heads: 2 kv heads on 4
  ranks, or 1 on 2) stays whole on every rank and each rank narrows its result to the key /
  value heads of its own query heads where it meets them (whose backward sums the gradient
  over the group, so the replicated weight stays equal);
- cut columns read their input through Megatron's ``f`` (one per input), the row's partial
  products are summed by ``g`` before its bias.

A ``Shard(plan=...)`` names the Linears instead (``colwise``/``rowwise`` by module path): only
those are cut, and a named Linear that cannot be cut as named is refused.

Refusals (``DirectiveError``) name the operation, its module and line, and the rule.
"""

from __future__ import annotations

import fnmatch

import attrs
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from piper_directives.shard_heads import HeadPlan, Refusal, Undivided, follow, op_name, shape
from piper_ir import DirectiveError, ParamShard, Sharding


@attrs.frozen
class Linear:
    """A Linear call: its node, activation input and parameter names."""

    node: torch.fx.Node
    input: torch.fx.Node
    weight: str
    bias: str | None
    out_features: int
    in_features: int


@attrs.frozen
class Group:
    columns: tuple[Linear, ...]  # cut ones
    whole: tuple[Linear, ...]  # replicated ones (heads the degree does not divide)
    row: Linear
    plan: HeadPlan


def linears(gm: torch.fx.GraphModule) -> list[Linear]:
    """Every Linear call of ``gm`` (module doc), in graph order."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            m = gm.get_submodule(n.target)
            if isinstance(m, nn.Linear) and isinstance(n.args[0], torch.fx.Node):
                out.append(Linear(n, n.args[0], f"{n.target}.weight", f"{n.target}.bias" if m.bias is not None else None,
                                  m.out_features, m.in_features))
        elif n.op == "call_function" and op_name(n.target) == "linear" and len(n.args) >= 2:
            w = n.args[1]
            b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
            p = _parameter(gm, w)
            if p is None or p.dim() != 2 or (b is not None and (_parameter(gm, b) is None)):
                continue
            out.append(Linear(n, n.args[0], w.target, b.target if b is not None else None, p.shape[0], p.shape[1]))
    return out


def _parameter(gm: torch.fx.GraphModule, n: object) -> torch.Tensor | None:
    if not isinstance(n, torch.fx.Node) or n.op != "get_attr":
        return None
    try:
        return gm.get_parameter(n.target)
    except AttributeError:
        return None


def region_after(col: torch.fx.Node, stops: set[torch.fx.Node]) -> tuple[set, set, bool]:
    """The nodes reachable from ``col`` without passing one of ``stops`` (the Linears), the
    stops reached, and whether the region reaches the segment's outputs."""
    region, reached, escapes, todo = set(), set(), False, list(col.users)
    while todo:
        n = todo.pop()
        if n in region or n in reached:
            continue
        if n.op == "output":
            escapes = True
        elif n in stops:
            reached.add(n)
        else:
            region.add(n)
            todo.extend(n.users)
    return region, reached, escapes


def path_of(lin: Linear) -> str:
    """The module path of a Linear (its weight's name without ``.weight``)."""
    return lin.weight.removesuffix(".weight")


def matches(pattern: str, path: str) -> bool:
    """``*`` matches one path component (as in ``regions=``)."""
    parts, names = pattern.split("."), path.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names, strict=True))


def style_of(lin: Linear, plan: tuple[tuple[str, str], ...]) -> str | None:
    """The plan's style for ``lin`` (the first pattern that matches), or None."""
    return style_for(path_of(lin), plan)


def style_for(path: str, plan: tuple[tuple[str, str], ...]) -> str | None:
    """The plan's style for the module at ``path`` (the first pattern that matches), or None."""
    return next((style for pattern, style in plan if matches(pattern, path)), None)


def find_groups(gm: torch.fx.GraphModule, sh: Sharding, taken: set[torch.fx.Node]) -> list[Group]:
    """The column groups of ``gm`` among Linears not in ``taken`` (the pairs already found);
    ``gm``'s nodes carry shapes (``meta["tensor_meta"]``). With ``sh.plan`` only the Linears
    it names ``colwise`` are columns, and each must reach exactly one Linear it names
    ``rowwise``."""
    found = linears(gm)
    by_node = {lin.node: lin for lin in found}
    stops = set(by_node)
    style = {lin.node: style_of(lin, sh.plan) for lin in found} if sh.plan else {}
    candidates: dict[torch.fx.Node, list[tuple[Linear, set]]] = {}
    for lin in found:
        if lin.node in taken or (sh.plan and style[lin.node] != "colwise"):
            continue
        region, reached, escapes = region_after(lin.node, stops)
        if escapes or len(reached) != 1:
            if sh.plan:
                where = ("reaches the region's outputs" if escapes else
                         f"reaches {len(reached)} Linears ({', '.join(sorted(path_of(by_node[r]) for r in reached))})")
                raise DirectiveError(
                    f"the plan names {path_of(lin)} colwise, but its output {where}: a column-parallel Linear's "
                    "output must reach exactly one row-parallel Linear (through code without Linears)",
                    directive=sh.origin,
                )
            continue
        row = next(iter(reached))
        if row in taken:
            continue
        if sh.plan and style[row] != "rowwise":
            raise DirectiveError(
                f"the plan names {path_of(lin)} colwise, but the Linear its output reaches, {path_of(by_node[row])}, "
                "is not named rowwise",
                directive=sh.origin,
            )
        candidates.setdefault(row, []).append((lin, region))
    for lin in found:
        if sh.plan and style[lin.node] == "rowwise" and lin.node not in candidates:
            raise DirectiveError(
                f"the plan names {path_of(lin)} rowwise, but no Linear it names colwise reaches it",
                directive=sh.origin,
            )
    rows = set(candidates)
    order = list(gm.graph.nodes)
    groups = []
    for row, members in candidates.items():
        members = [(lin, region) for lin, region in members if lin.node not in rows]
        if not members:
            continue
        groups.append(_group(by_node[row], members, order, sh))
    return groups


def _group(row: Linear, members: list[tuple[Linear, set]], order: list, sh: Sharding) -> Group:
    region = set().union(*(r for _, r in members))
    whole: set[torch.fx.Node] = set()
    cols = {lin.node: lin for lin, _ in members}
    while True:
        cut = [c for c in cols if c not in whole]
        if not cut:
            raise DirectiveError(
                f"no column-parallel Linear before row-parallel {row.weight}: the degree {sh.degree} divides "
                f"the heads of none of {sorted(lin.weight for lin in cols.values())}",
                directive=sh.origin,
            )
        try:
            for c in cut:
                if cols[c].out_features % sh.degree:
                    raise Undivided(c, f"the tensor-parallel degree {sh.degree} does not divide its "
                                       f"{cols[c].out_features} output features", cols[c].out_features)
            plan = follow(cut, region, order, sh.degree)
        except Undivided as err:
            src = plan_origin(err.node, cut, region)
            if len(src) == 1 and sh.degree % err.heads == 0 and src[0] in cols:
                whole.add(src[0])  # grouped-query key/value heads: replicated, narrowed per rank
                continue
            raise _refused(err, cols, row, sh) from None
        except Refusal as err:
            raise _refused(err, cols, row, sh) from None
        break
    if row.node.args[0] not in plan.cut or plan.cut[row.node.args[0]] != len(shape(row.node.args[0])) - 1:
        raise DirectiveError(
            f"the input of row-parallel {row.weight} is not cut on its last axis (the features the column "
            f"Linears {sorted(cols[c].weight for c in cut)} cut)",
            directive=sh.origin,
        )
    if row.in_features % sh.degree:
        raise DirectiveError(
            f"tensor-parallel degree {sh.degree} does not divide the input features ({row.in_features}) of "
            f"row-parallel {row.weight}",
            directive=sh.origin,
        )
    return Group(tuple(cols[c] for c in cut), tuple(cols[c] for c in whole), row, plan)


def plan_origin(node: torch.fx.Node, cut: list, region: set) -> list:
    """The columns whose outputs reach ``node`` (walking back through ``region``)."""
    seen, todo, out = set(), [node], []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in cut:
            out.append(n)
        elif n in region or n is node:
            todo.extend(n.all_input_nodes)
    return out


def _refused(err: Refusal, cols: dict, row: Linear, sh: Sharding) -> DirectiveError:
    names = ", ".join(sorted(lin.weight.removesuffix(".weight") for lin in cols.values()))
    return DirectiveError(
        f"cannot shard the column group {names} -> {row.weight.removesuffix('.weight')}: {err}",
        directive=sh.origin,
    )


def rewrite(gm: torch.fx.GraphModule, group: Group, comm: str) -> list[ParamShard]:
    """Rewrite ``gm``'s code for ``group`` (module doc); the parameters cut."""
    g = gm.graph
    params: list[ParamShard] = []
    fs: dict[torch.fx.Node, torch.fx.Node] = {}
    position = {n: i for i, n in enumerate(g.nodes)}
    for col in sorted(group.columns, key=lambda c: position[c.node]):
        blocks = group.plan.groups.get(col.node, 1)
        params.append(ParamShard(col.weight, 0, blocks))
        if col.bias is not None:
            params.append(ParamShard(col.bias, 0, blocks))
        if col.input not in fs:  # one f per input: its backward sums the columns' gradients at once
            with g.inserting_before(col.node):
                fs[col.input] = g.call_module(comm, (col.input, "f"))
        col.node.args = (fs[col.input], *col.node.args[1:])
    for node, arg, index, value in group.plan.sizes:
        args = list(node.args)
        if index is None:
            args[arg] = value
        else:
            sizes = list(args[arg])
            sizes[index] = value
            args[arg] = type(args[arg])(sizes)
        node.args = tuple(args)
    users: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node, a in group.plan.summed:
        users.setdefault(a, []).append(node)
    for a, nodes in users.items():  # one f per whole input: one all-reduce of its summed gradient
        with g.inserting_before(min(nodes, key=lambda m: position[m])):
            f = g.call_module(comm, (a, "f"))
        for node in nodes:
            node.replace_input_with(a, f)
    for node, a, dim in group.plan.narrows:
        with g.inserting_before(node):
            local = g.call_module(comm, (a, "local", dim))
        node.replace_input_with(a, local)
    params.append(ParamShard(group.row.weight, 1, 1))
    row = group.row.node
    with g.inserting_before(row):
        weight = g.get_attr(group.row.weight)
        partial = g.call_function(row.target if row.op == "call_function" else F.linear, (row.args[0], weight))
        partial.meta.update({k: v for k, v in row.meta.items() if k in ("stack_trace", "nn_module_stack")})
        result = g.call_module(comm, (partial, "g"))
        if group.row.bias is not None:
            result = g.call_function(torch.add, (result, g.get_attr(group.row.bias)))
    row.replace_all_uses_with(result)
    g.erase_node(row)
    return params
