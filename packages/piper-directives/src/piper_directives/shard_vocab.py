"""Vocabulary parallelism: the embedding, the output head and the cross-entropy cut by vocabulary (torch side).

A language model's largest matrices are its token embedding and its output head (often one
tied tensor), and its largest activation the logits. Under tensor parallelism
(``shard_code``) they are cut over the group by vocabulary rows (Megatron's
``VocabParallelEmbedding``, ``ColumnParallelLinear`` with ``gather_output=False`` and
``vocab_parallel_cross_entropy``; torchtitan's ``RowwiseParallel`` embedding and
``ColwiseParallel`` output under ``loss_parallel``), so no rank holds the full logits:

- **embedding** (``nn.Embedding``, ``F.embedding``, ``aten.embedding``): rank ``r`` of ``N``
  holds rows ``r*V/N .. (r+1)*V/N - 1``; it looks up the ids in its range, writes zeros for
  the others, and an all-reduce (``g``) sums the pieces: every rank gets the whole
  activation, each row's gradient reaches the one rank holding it;
- **head**: a Linear whose output reaches the segment's outputs (through element-wise code:
  a soft cap) and from there only the loss; its weight (and bias) is cut on the vocabulary
  (dimension 0) and its input read through ``f``, so each rank computes its slice of the
  logits, which the loss receives as they are (``ParamShard(weight, 0)``);
- **loss**: the user's loss function runs unchanged under ``VocabMode``, a torch function
  mode that follows the logits slice through shape-keeping code (``flatten``, ``reshape``
  that keeps the last axis, dtype casts, scaling by a number) into ``F.cross_entropy``, which
  becomes ``VocabCrossEntropy``: each rank's log-sum-exp of its slice and the target logit
  picked by the rank whose range holds the target travel in one all-reduce (the per-rank
  log-sum-exps summed into per-rank slots: a gather over a sum), the loss is computed from
  them on every rank alike, and the backward (``softmax - onehot`` on the slice) needs no
  communication. Any other use of the slice (a softmax over it, an argmax, a reshape that
  moves its last axis) is refused (``VocabRefusal``), naming the operation.

A tied embedding and head (``Graph.ties``) are cut alike (rows by vocabulary), so the tie is
one parameter whose pieces the ranks at one position share (``piper_memory.ties``).

Found automatically (no plan) where it is safe: a head whose logits reach only a loss the
``VocabMode`` accepts, and an embedding; a tied pair only together. A ``Shard(plan=...)``
names them instead (``"embedding_vocab"``, ``"colwise_vocab"``) and what cannot be cut as
named is refused with the module and the model's line.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Sequence

import attrs
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from piper_directives.shard_heads import op_name

EMBEDDING = "embedding_vocab"
HEAD = "colwise_vocab"


class VocabRefusal(Exception):
    """A use of the vocabulary-cut logits (or an embedding) that cannot run on a slice."""


@attrs.frozen
class Embedding:
    """An embedding lookup: its node, the ids and the weight's parameter name."""

    node: torch.fx.Node
    ids: torch.fx.Node
    weight: str

    @property
    def path(self) -> str:
        return self.weight.removesuffix(".weight")


def embeddings(gm: torch.fx.GraphModule) -> list[Embedding]:
    """Every embedding lookup of ``gm`` by a 2-D parameter (module doc), in graph order."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            m = gm.get_submodule(n.target)
            if isinstance(m, nn.Embedding) and isinstance(n.args[0], torch.fx.Node):
                out.append(Embedding(n, n.args[0], f"{n.target}.weight"))
        elif n.op == "call_function" and op_name(n.target) == "embedding" and len(n.args) >= 2:
            aten = isinstance(n.target, torch._ops.OpOverload)
            w, ids = (n.args[0], n.args[1]) if aten else (n.args[1], n.args[0])
            if isinstance(w, torch.fx.Node) and w.op == "get_attr" and isinstance(ids, torch.fx.Node):
                try:
                    p = gm.get_parameter(w.target)
                except AttributeError:
                    continue
                if p.dim() == 2:
                    out.append(Embedding(n, ids, w.target))
    return out


def embedding_problem(gm: torch.fx.GraphModule, e: Embedding, degree: int) -> str | None:
    """Why ``e`` cannot be cut by vocabulary over ``degree`` ranks, or None."""
    n = e.node
    rows = gm.get_parameter(e.weight).shape[0]
    if rows % degree:
        return f"the tensor-parallel degree {degree} does not divide its {rows} rows (the vocabulary)"
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        extra = {"padding_idx": m.padding_idx, "max_norm": m.max_norm, "scale_grad_by_freq": m.scale_grad_by_freq,
                 "sparse": m.sparse}
    elif isinstance(n.target, torch._ops.OpOverload):  # aten.embedding(weight, ids, padding_idx, scale, sparse)
        names = ("padding_idx", "scale_grad_by_freq", "sparse")
        defaults = (-1, False, False)
        extra = {k: n.args[2 + i] if len(n.args) > 2 + i else n.kwargs.get(k, d)
                 for i, (k, d) in enumerate(zip(names, defaults, strict=True))}
        extra["padding_idx"] = None if extra["padding_idx"] in (-1, None) else extra["padding_idx"]
    else:  # F.embedding(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        names = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
        defaults = (None, None, 2.0, False, False)
        extra = {k: n.args[2 + i] if len(n.args) > 2 + i else n.kwargs.get(k, d)
                 for i, (k, d) in enumerate(zip(names, defaults, strict=True))}
        extra.pop("norm_type")
    used = [k for k, v in extra.items() if v is not None and v is not False]  # padding_idx 0 is used
    if used:
        return f"it uses {', '.join(used)}, which a vocabulary-cut lookup does not implement"
    return None


def vocab_embedding(comm: nn.Module, ids: torch.Tensor, weight: torch.Tensor, reduce: str = "g") -> torch.Tensor:
    """This rank's rows of the lookup (zeros for ids outside its range), summed over the
    group (``comm``: a ``TensorParallelComm``; unbound, rank 0's range): all-reduced
    (``reduce="g"``) or, under sequence parallelism, reduce-scattered along the sequence
    (``"sp_scatter"``, the second-to-last axis: ``shard_sequence``)."""
    rows = weight.shape[0]
    start = comm.position * rows if comm.bound else 0
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return comm(out, "g") if reduce == "g" else comm(out, reduce, out.dim() - 2)


def rewrite_embedding(gm: torch.fx.GraphModule, e: Embedding, comm: str) -> None:
    """Replace ``e``'s lookup by ``vocab_embedding`` (its weight cut on dimension 0)."""
    g = gm.graph
    with g.inserting_before(e.node):
        out = g.call_function(vocab_embedding, (g.get_attr(comm), e.ids, g.get_attr(e.weight)))
    e.node.replace_all_uses_with(out)
    g.erase_node(e.node)


class VocabCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits cut on their last axis (module doc)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, comm: nn.Module, ignore_index: int,
                reduction: str) -> torch.Tensor:
        n, vl = logits.shape
        ranks = comm.degree if comm.bound else 1
        position = comm.position if comm.bound else 0
        start = position * vl
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + vl)
        local_target = torch.where(mine, target - start, torch.zeros_like(target))
        picked = logits.gather(1, local_target.unsqueeze(1)).squeeze(1) * mine
        slots = logits.new_zeros(n, ranks + 1)
        slots[:, position] = torch.logsumexp(logits, dim=1)
        slots[:, ranks] = picked
        if comm.bound:
            slots = comm.all_reduce(slots)
        lse = torch.logsumexp(slots[:, :ranks], dim=1)
        losses = (lse - slots[:, ranks]) * valid
        ctx.save_for_backward(logits, lse, local_target, mine, valid)
        ctx.reduction = reduction
        ctx.count = valid.sum()
        if reduction == "none":
            return losses
        if reduction == "sum":
            return losses.sum()
        return losses.sum() / ctx.count

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        logits, lse, local_target, mine, valid = ctx.saved_tensors
        probs = torch.exp(logits - lse.unsqueeze(1))
        probs[torch.arange(len(mine), device=mine.device), local_target] -= mine.to(probs.dtype)
        if ctx.reduction == "none":
            scale = grad * valid
        elif ctx.reduction == "sum":
            scale = grad.expand(valid.shape) * valid
        else:
            scale = (grad / ctx.count).expand(valid.shape) * valid
        return probs * scale.unsqueeze(1).to(probs.dtype), None, None, None, None


_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_KEEP = frozenset({"float", "double", "half", "bfloat16", "to", "type", "type_as", "contiguous", "clone"})
_SCALE = frozenset({"__mul__", "__rmul__", "__truediv__", "mul", "div", "__neg__", "neg"})
_READ = frozenset({"size", "dim", "__len__", "is_floating_point", "get_device"})
_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout"})


class VocabMode(TorchFunctionMode):
    """Runs a loss function on vocabulary-cut logits (module doc): ``tracked`` holds the
    tensors that are a slice of the logits on their last axis (kept alive for the call)."""

    def __init__(self, comm: nn.Module, sliced: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.comm = comm
        self.tracked: dict[int, torch.Tensor] = {id(t): t for t in sliced}
        self.calls = 0

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        hit = [a for a in flat if isinstance(a, torch.Tensor) and id(a) in self.tracked]
        if not hit:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if func is F.cross_entropy:
            return self._cross_entropy(args, kwargs)
        if name == "__get__":
            attribute = getattr(getattr(func, "__self__", None), "__name__", "")
            if attribute in _ATTRIBUTES:
                return func(*args, **kwargs)
            raise VocabRefusal(f"reading .{attribute} of the vocabulary-cut logits")
        if name in _READ:
            return func(*args, **kwargs)
        x = args[0] if args else None
        if not (isinstance(x, torch.Tensor) and id(x) in self.tracked) or len(hit) > 1:
            raise VocabRefusal(f"{name} combines the vocabulary-cut logits with another tensor")
        if name in _KEEP or name in _SCALE and _scalar(args[1:]):
            return self._track(func(*args, **kwargs))
        out = func(*args, **kwargs) if name in ("flatten", "reshape", "view") else None
        if isinstance(out, torch.Tensor):
            end = _arg(args, kwargs, 2, "end_dim", -1) if name == "flatten" else None
            keeps = out.dim() >= 1 and out.shape[-1] == x.shape[-1] and (name != "flatten" or end not in (-1, x.dim() - 1))
            if keeps:
                return self._track(out)
            raise VocabRefusal(f"{name} to {tuple(out.shape)} moves the vocabulary axis of logits of shape "
                               f"{tuple(x.shape)} (each rank holds its slice of the last axis; keep it last, "
                               "sized as it comes: reshape(-1, logits.shape[-1]))")
        raise VocabRefusal(f"{name} on the vocabulary-cut logits (known: dtype casts, flatten/reshape keeping the "
                           "last axis, scaling by a number, F.cross_entropy)")

    def _track(self, out: object) -> object:
        if isinstance(out, torch.Tensor):
            self.tracked[id(out)] = out
        return out

    def _cross_entropy(self, args: tuple, kwargs: dict) -> torch.Tensor:
        bound = _CE_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        logits, target = a["input"], a["target"]
        if id(logits) not in self.tracked or id(target) in self.tracked:
            raise VocabRefusal("F.cross_entropy whose input is not the vocabulary-cut logits")
        if logits.dim() != 2 or target.dim() != 1 or target.is_floating_point():
            raise VocabRefusal(f"F.cross_entropy of logits {tuple(logits.shape)} against targets {tuple(target.shape)}: "
                               "a vocabulary-cut loss takes (tokens, vocabulary) logits and class indices")
        if a["weight"] is not None or a["label_smoothing"] or a["size_average"] is not None or a["reduce"] is not None:
            raise VocabRefusal("F.cross_entropy with weight, label_smoothing, size_average or reduce")
        if a["reduction"] not in ("mean", "sum", "none"):
            raise VocabRefusal(f"F.cross_entropy with reduction={a['reduction']!r}")
        self.calls += 1
        return VocabCrossEntropy.apply(logits, target, self.comm, a["ignore_index"], a["reduction"])


def _scalar(rest: tuple) -> bool:
    return len(rest) == 1 and (isinstance(rest[0], int | float) or isinstance(rest[0], torch.Tensor) and rest[0].dim() == 0)


def _arg(args: tuple, kwargs: dict, i: int, key: str, default: object) -> object:
    return args[i] if len(args) > i else kwargs.get(key, default)


class VocabParallelLoss(nn.Module):
    """The loss segment's module with its model outputs ``sliced`` (their positions) cut by
    vocabulary: runs ``inner`` under ``VocabMode`` (module doc)."""

    def __init__(self, inner: nn.Module, comm: nn.Module, sliced: Sequence[int]) -> None:
        super().__init__()
        self.inner = inner
        self.piper_tp = comm
        self.sliced = tuple(sliced)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        mode = VocabMode(self.piper_tp, [args[i] for i in self.sliced])
        with mode:
            loss = self.inner(*args)
        if not mode.calls:
            raise VocabRefusal("the loss never calls F.cross_entropy on the vocabulary-cut logits")
        return loss


def sliced_shape(shape: Sequence[int], degree: int) -> tuple[int, ...]:
    """The shape of one rank's slice of a value cut on its last axis."""
    return (*shape[:-1], shape[-1] // degree)


def divides(shape: Sequence[int], degree: int) -> bool:
    return len(shape) >= 1 and shape[-1] % degree == 0 and math.prod(shape) > 0


@attrs.frozen
class VocabCuts:
    """What ``decide`` cuts: per stage segment the embedding and head weights, and the
    outputs sliced on their last axis; per loss segment the positions of its sliced inputs."""

    embeddings: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    heads: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    outputs: dict[str, frozenset[str]] = attrs.field(factory=dict)
    loss: dict[str, tuple[int, ...]] = attrs.field(factory=dict)


def decide(graph, modules, shapes: Callable, example_args: Callable) -> VocabCuts:  # a Graph, its modules
    """The vocabulary cuts of a graph after ``shard_all`` (module doc). ``shapes(gm, args)``
    records shapes on ``gm``'s nodes, ``example_args(graph, sharding)`` makes a segment's
    inputs (``shard_code``'s). Plans are obeyed or refused (``DirectiveError``); without a
    plan what cannot be cut safely stays whole."""
    from piper_directives import shard_groups
    from piper_directives.diagnose import describe
    from piper_directives.shard_heads import Refusal, follow
    from piper_ir import DirectiveError, SegmentRole, ShardKind

    tp = {sh.segment: sh for sh in graph.sharding if sh.kind is ShardKind.TP}
    emb: dict[str, list[str]] = {}
    heads: dict[str, dict[str, frozenset[str]]] = {}  # segment -> head weight -> outputs it slices
    where: dict[tuple[str, str], str] = {}  # (segment, weight) -> the module and line, for messages

    def styled(sh, path: str) -> str | None:
        return next((s for p, s in sh.plan if shard_groups.matches(p, path)), None)

    def refuse(sh, what: str, why: str) -> None:
        raise DirectiveError(f"the plan names {what}, but {why}", directive=sh.origin)

    for seg_id, sh in tp.items():
        seg, gm = graph.segment_by_id[seg_id], modules.get(seg_id)
        if seg.role is not SegmentRole.STAGE or not isinstance(gm, torch.fx.GraphModule):
            continue
        for e in embeddings(gm):
            want = styled(sh, e.path) == EMBEDDING if sh.plan else True
            if not want:
                continue
            problem = embedding_problem(gm, e, sh.degree)
            where[(seg_id, e.weight)] = describe(e.node)
            if problem is None:
                emb.setdefault(seg_id, []).append(e.weight)
            elif sh.plan:
                refuse(sh, f"{e.path} {EMBEDDING} ({describe(e.node)})", problem)
        lins = shard_groups.linears(gm)
        named = [lin for lin in lins if (styled(sh, shard_groups.path_of(lin)) == HEAD if sh.plan else True)]
        if not named or (not sh.plan and not set(seg.outputs) & set(graph.loss_segment().inputs)):
            continue  # without a plan, a head is looked for only where the loss reads the outputs
        with _shapes_kept(gm):  # the shapes are recorded on the segment's own nodes, then taken off
            with torch.random.fork_rng(devices=[]):
                shapes(gm, example_args(graph, sh))
            stops = {lin.node for lin in lins}
            order = list(gm.graph.nodes)
            output = next(n for n in order if n.op == "output")
            outs = output.args[0] if isinstance(output.args[0], tuple | list) else (output.args[0],)
            for lin in named:
                node = lin.node
                what = f"{shard_groups.path_of(lin)} {HEAD} ({describe(lin.node)})"
                where[(seg_id, lin.weight)] = describe(lin.node)
                region, reached, escapes = shard_groups.region_after(node, stops)
                why = None
                if reached or not escapes:
                    why = "its output reaches another Linear, not only the region's outputs (the logits)"
                elif lin.out_features % sh.degree:
                    why = f"the tensor-parallel degree {sh.degree} does not divide its {lin.out_features} outputs"
                else:
                    try:
                        plan = follow([node], region, order, sh.degree)
                        if plan.narrows or plan.summed or plan.sizes:
                            why = "the code between it and the region's outputs reshapes or mixes in other tensors"
                    except Refusal as err:
                        why = f"{err}"
                sliced = set()
                if why is None:
                    for i, o in enumerate(outs):
                        if o is node or o in region:
                            if plan.cut.get(o) != len(o.meta["tensor_meta"].shape) - 1:
                                why = f"output {seg.outputs[i]} is not cut on its last axis"
                            sliced.add(seg.outputs[i])
                    users = {s.id for s in graph.segments if sliced & set(s.inputs)}
                    loss = graph.loss_segment()
                    if why is None and (users != {loss.id} or loss.id not in tp or tp[loss.id].degree != sh.degree):
                        why = (f"its logits ({', '.join(sorted(sliced))}) reach {sorted(users)}, not only the loss on "
                               "the same tensor-parallel group")
                if why is None:
                    heads.setdefault(seg_id, {})[lin.weight] = frozenset(sliced)
                elif sh.plan:
                    refuse(sh, what, why)

    loss = graph.loss_segment()
    for _ in range(3):  # ties drop heads/embeddings, a refusing loss drops heads: settle
        _untie(graph, emb, heads, where, tp)
        _unshare(modules, emb, heads, where, tp)
        sliced = frozenset().union(*(o for hs in heads.values() for o in hs.values()))
        if not sliced:
            break
        positions = tuple(i for i, name in enumerate(loss.inputs) if name in sliced)
        why = _loss_problem(graph, tp[loss.id], modules[loss.id], positions, example_args)
        if why is None:
            break
        if any(tp[s].plan for s in heads):
            raise DirectiveError(
                f"the plan cuts the logits by vocabulary ({HEAD}), but the loss cannot take them cut: {why} "
                f"({_loss_where(modules[loss.id])})",
                directive=next(tp[s].origin for s in heads if tp[s].plan),
            )
        heads.clear()
    outputs = {s: frozenset().union(*hs.values()) for s, hs in heads.items() if hs}
    sliced = frozenset().union(*outputs.values()) if outputs else frozenset()
    cuts = VocabCuts(
        {s: tuple(ws) for s, ws in emb.items() if ws},
        {s: tuple(hs) for s, hs in heads.items() if hs},
        outputs,
        {loss.id: tuple(i for i, name in enumerate(loss.inputs) if name in sliced)} if sliced else {},
    )
    return cuts


@contextlib.contextmanager
def _shapes_kept(gm: torch.fx.GraphModule) -> Iterator[None]:
    """Shapes recorded on ``gm``'s nodes inside are taken off after (each node's
    ``meta["tensor_meta"]`` as before): cheaper than recording them on a copy of the module."""
    missing = object()
    before = {n: n.meta.get("tensor_meta", missing) for n in gm.graph.nodes}
    try:
        yield
    finally:
        for n, meta in before.items():
            if meta is missing:
                n.meta.pop("tensor_meta", None)
            else:
                n.meta["tensor_meta"] = meta


def _untie(graph, emb: dict, heads: dict, where: dict, tp: dict) -> None:
    """A tied parameter is cut by every holder or by none (the pieces are one parameter's)."""
    from piper_ir import DirectiveError

    for tie in graph.ties:
        cut = [(s, q) for s, q in tie.holders if q in emb.get(s, ()) or q in heads.get(s, {})]
        if not cut or len(cut) == len(tie.holders):
            continue
        planned = [s for s, _ in tie.holders if s in tp and tp[s].plan]
        if planned:
            whole = [f"{q!r} in {s}" for s, q in tie.holders if (s, q) not in cut]
            raise DirectiveError(
                f"parameter {tie.name!r} is tied ({tie.describe()}); the plan cuts it by vocabulary at "
                f"{', '.join(where.get(c, repr(c[1])) for c in cut)} but not as {', '.join(whole)}: name every "
                f"use ({EMBEDDING} for the embedding, {HEAD} for the head) or none",
                directive=tp[planned[0]].origin,
            )
        for s, q in cut:
            if q in emb.get(s, ()):
                emb[s].remove(q)
            heads.get(s, {}).pop(q, None)


def _unshare(modules, emb: dict, heads: dict, where: dict, tp: dict) -> None:
    """A tensor one region holds under several names (a tied embedding and head in one region)
    is cut under all of them or none: each name's use must be a cut embedding or head."""
    from piper_ir import DirectiveError

    for seg in set(emb) | set(heads):
        names: dict[int, list[str]] = {}
        for name, p in modules[seg].named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        chosen = set(emb.get(seg, ())) | set(heads.get(seg, {}))
        for aliases in names.values():
            cut = [n for n in aliases if n in chosen]
            if not cut or len(cut) == len(aliases):
                continue
            if tp[seg].plan:
                whole = [n for n in aliases if n not in chosen]
                raise DirectiveError(
                    f"{', '.join(repr(n) for n in aliases)} are one tensor (tied) in {seg}; the plan cuts it by "
                    f"vocabulary at {', '.join(where.get((seg, n), repr(n)) for n in cut)} but not as "
                    f"{', '.join(repr(n) for n in whole)}: name every use ({EMBEDDING} for the embedding, {HEAD} "
                    "for the head) or none",
                    directive=tp[seg].origin,
                )
            for n in cut:
                if n in emb.get(seg, ()):
                    emb[seg].remove(n)
                heads.get(seg, {}).pop(n, None)


def _loss_problem(graph, sh, module: nn.Module, positions: tuple[int, ...], example_args: Callable) -> str | None:
    """Why the loss segment cannot take its inputs at ``positions`` sliced, or None (run once
    on slices, collectives unbound)."""
    from piper_directives.shard_code import TensorParallelComm

    args = example_args(graph, sh)
    args = [a[..., : a.shape[-1] // sh.degree].contiguous() if i in positions else a for i, a in enumerate(args)]
    wrapped = VocabParallelLoss(module, TensorParallelComm(sh.degree), positions)
    try:
        with torch.random.fork_rng(devices=[]):
            loss = wrapped(*args)
    except VocabRefusal as err:
        return str(err)
    except Exception as err:  # the loss's own code failing on a slice (a hard-coded vocabulary size)
        return f"it fails on a slice of the logits: {err}"
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        return "it does not return a scalar"
    return None


def _loss_where(module: nn.Module) -> str:
    fn = getattr(module, "loss_fn", module)
    try:
        return f"{getattr(fn, '__qualname__', fn)} at {inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return f"{getattr(fn, '__qualname__', type(fn).__name__)}"
