"""Dropout inside tensor-parallel regions, with single-device training's masks (torch side).

Between a column- and a row-parallel Linear each rank of a tensor-parallel group holds a block
of the activations: its attention heads, its hidden units. A dropout there, drawn on the block,
would draw a mask of its own and the run would leave single-device training. But every rank of
a group runs a region from the same generator state (``piper_directives.randomness``: seeded by
region, microbatch and step, not by rank), so each rank can draw the mask of the *whole*
activation, as one device does, and keep its block: the same masks, the same random stream
after them. ``shard_code`` finds the draws in its cut regions (``cut_draws``) and rewrites them
once the cut is known (``draw_whole_masks``):

- ``nn.Dropout`` and ``F.dropout`` become ``shard_sequence.sequence_dropout`` on the axis the
  cut runs along (found by comparing the activation's whole shape with one rank's);
- ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` becomes ``attention``: the
  attention computed as torch's math kernel does, the whole ``(batch, heads, L, S)`` mask drawn
  and the rank's heads kept (on CPU torch draws that mask the same way, measured bit for bit;
  CUDA's fused kernels draw theirs otherwise: unverified there, as everything CUDA).

Anything else that draws random numbers in a cut region (a sampling function, alpha dropout,
a dropout whose activation is cut along more than one axis) is refused, naming it.
"""

from __future__ import annotations

import math

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from piper_directives.diagnose import describe
from piper_directives.shard_heads import op_name
from piper_directives.shard_sequence import sequence_dropout
from piper_ir import DirectiveError, Sharding

RANDOM_FUNCTIONS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "bernoulli", "multinomial",
    "normal", "randperm", "bernoulli_", "uniform_", "normal_",
})


def draws(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    """Whether ``n`` draws random numbers in training: dropout (module or function),
    attention with ``dropout_p > 0``, or a sampling function."""
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        return isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
    if n.op not in ("call_function", "call_method"):
        return False
    name = op_name(n.target).removeprefix("native_")
    if name == "scaled_dot_product_attention":
        p = _dropout_p(n)
        return not isinstance(p, int | float) or p > 0
    if name in ("dropout", "alpha_dropout", "feature_alpha_dropout") or name.startswith("dropout"):
        p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
        training = n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True)
        return training is not False and (not isinstance(p, int | float) or p > 0)
    return name in RANDOM_FUNCTIONS


def cut_draws(gm: torch.fx.GraphModule, col: torch.fx.Node, region: set, row: torch.fx.Node,
              sh: Sharding) -> list[torch.fx.Node]:
    """The draws between column-parallel ``col`` and row-parallel ``row`` (``region``) that
    ``draw_whole_masks`` can give single-device masks; any other draw there is refused by name."""
    out = []
    for n in gm.graph.nodes:
        if n in region and draws(gm, n):
            if _kind(gm, n) is None:
                raise _refusal(n, col, row, sh, "no rank could draw the numbers one device draws")
            out.append(n)
    return out


def draw_whole_masks(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], comm: str, sh: Sharding,
                     full: dict[str, tuple[int, ...]], local: dict[str, tuple[int, ...]],
                     ends: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]]) -> None:
    """Rewrite ``nodes`` (``cut_draws``' finds, in rewritten ``gm`` whose ``comm`` submodule is
    the group's ``TensorParallelComm``) to draw the whole activation's mask and keep this rank's
    block (module doc). ``full``/``local``: each draw's input shape on one device and on rank 0
    (by node name); ``ends``: each draw's column and row Linear, for messages."""
    g = gm.graph
    for n in nodes:
        kind = _kind(gm, n)
        whole, mine = full.get(n.name), local.get(n.name)
        if whole is None or mine is None or len(whole) != len(mine):
            raise _refusal(n, *ends[n], sh, "its activation's shape could not be followed")
        cut = [d for d, (a, b) in enumerate(zip(whole, mine, strict=True)) if a != b]
        if not cut:  # a whole activation inside the region: every rank draws one device's mask
            continue
        if len(cut) > 1 or whole[cut[0]] != mine[cut[0]] * sh.degree:
            raise _refusal(n, *ends[n], sh, f"its activation {tuple(whole)} is cut to {tuple(mine)}, not along one axis")
        axis = cut[0] - len(whole)  # from the end: batch axes may differ in count between runs
        if kind == "attention" and axis != -3:
            raise _refusal(n, *ends[n], sh, f"its query is cut along axis {axis}, not by heads (-3)")
        with g.inserting_before(n):
            state = g.get_attr(comm)
            if kind == "attention":
                new = g.call_function(attention, (state, *n.args), dict(n.kwargs))
            else:
                p = gm.get_submodule(n.target).p if n.op == "call_module" else n.kwargs.get(
                    "p", n.args[1] if len(n.args) > 1 else 0.5)
                new = g.call_function(sequence_dropout, (state, n.args[0], p, axis))
        new.meta.update({k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack")})
        n.replace_all_uses_with(new)
        g.erase_node(n)


def attention(comm: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on this rank's heads (axis -3) with one device's
    dropout mask: the whole ``(..., heads, L, S)`` mask drawn, the rank's heads kept. Unbound,
    or without dropout, torch's own function."""
    if not comm.bound or not dropout_p:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    length, source = q.shape[-2], k.shape[-2]
    if is_causal:
        scores = scores.masked_fill(~torch.ones(length, source, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = torch.softmax(scores, -1)
    return sequence_dropout(comm, probs, dropout_p, -3) @ v


def _dropout_p(n: torch.fx.Node) -> object:
    return n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0)


def _kind(gm: torch.fx.GraphModule, n: torch.fx.Node) -> str | None:
    """``"attention"``, ``"dropout"``, or None for a draw ``draw_whole_masks`` cannot rewrite."""
    if n.op == "call_module":
        return "dropout" if type(gm.get_submodule(n.target)) is nn.Dropout else None
    name = op_name(n.target)
    if n.op == "call_function" and n.target is F.scaled_dot_product_attention and isinstance(_dropout_p(n), float):
        return "attention"
    if n.op == "call_function" and n.target is F.dropout and name == "dropout":
        p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
        return "dropout" if isinstance(p, int | float) else None
    return None


def _refusal(n: torch.fx.Node, col: torch.fx.Node, row: torch.fx.Node, sh: Sharding, why: str) -> DirectiveError:
    cname, rname = label(col), label(row)
    return DirectiveError(
        f"{describe(n)} draws random numbers between column-parallel {cname} and row-parallel {rname}, on "
        f"activations tensor parallelism cuts across ranks, and {why}. Dropout (nn.Dropout, F.dropout) and "
        "scaled_dot_product_attention's dropout_p draw one device's masks there; set this one to 0, or move it "
        f"after {rname}",
        directive=sh.origin,
    )


def label(n: torch.fx.Node) -> str:
    """A Linear's module path: ``n.target``, or its weight's without ``.weight``."""
    if n.op == "call_module":
        return str(n.target)
    w = n.args[1] if len(n.args) > 1 else None
    return w.target.removesuffix(".weight") if isinstance(w, torch.fx.Node) else n.name
