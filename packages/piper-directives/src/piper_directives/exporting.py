"""Capture through ``torch.export``: the models ``torch.fx`` cannot trace symbolically.

``torch.fx`` runs ``forward`` on proxies, so Python that needs a real value fails: slicing a
rotary table by ``x.shape[1]``, ``**kwargs`` forwards, branches on a config. ``torch.export``
(non-strict) runs ``forward`` as Python on fake tensors whose sizes are symbols, so such code
traces, and the sizes stay symbolic: ``Dim.AUTO`` on every dimension of every input keeps each
size dynamic unless the model fixes it (a hidden size a Linear needs), so the captured code
runs on microbatches and other sequence lengths than the example's.

``exported_graph`` returns export's graph in the form capture reads (piper_directives.capturing):
a ``torch.fx.GraphModule`` whose parameters and buffers are ``get_attr`` nodes of the user's
own tensors (nothing copied), each operation carrying the run and scopes of the ``annotate``
regions it was traced in (``node.meta["piper_scopes"]``, ``["piper_run"]``). Export's guards
and dtype assertions are dropped: Piper checks batches itself, and a ``--precision`` run
computes in another dtype than the one traced. Grad-mode and autocast regions stay as export
records them (higher-order operations that enter their context around a sub-graph), so they
need no ``insert_contexts``. ``torch.utils.checkpoint`` inside ``forward`` is not recorded as
recompute under export: use the ``Recompute`` directive.

Sizes are values too: a size read in one region and used in another (``x.view(b, t, -1)``)
must not travel between segments as a Python int. ``size_like`` tells them apart, and
capture recomputes such a size from a tensor the using segment has (``local_size``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.fx
from torch import nn
from torch.fx import traceback as fx_traceback

from piper_directives.annotate import EXPORT_META, tracing
from piper_directives.contexts import Context

_ASSERTIONS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
}


def exported_graph(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.fx.GraphModule:
    """``model`` captured by ``torch.export`` on ``inputs`` (module doc). Raises what export
    raises."""
    dynamic = tuple({d: torch.export.Dim.AUTO for d in range(t.dim())} for t in inputs)
    with tracing(export=True), fx_traceback.preserve_node_meta(), torch.enable_grad():
        program = torch.export.export(model, inputs, dynamic_shapes=dynamic, strict=False)
    _refuse_batch_dependence(program, model)
    gm = program.module()
    _normalise(gm)
    _name_tied_uses(gm, model)
    return gm


class BatchDependence(Exception):
    """The exported code holds only for some batch sizes (module ``exported_graph``)."""


def _refuse_batch_dependence(program: torch.export.ExportedProgram, model: nn.Module) -> None:
    """Microbatches are smaller than the example batch, so code traced for the example must hold
    for every batch size: refuse a batch dimension export fixed (``x.view(8, ...)``) or
    bounded (a branch or assert on the batch size), which it would otherwise only have guarded."""
    inputs = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in program.graph_signature.user_inputs]
    for i, node in enumerate(inputs):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        size = value.shape[0]
        if not isinstance(size, torch.SymInt):
            raise BatchDependence(
                f"{type(model).__name__}.forward fixes the batch size of input {i} to {size} (a size written into "
                "the code, such as view(8, ...)): microbatches are smaller; read it from the input (x.size(0))")
        bounds = program.range_constraints.get(size.node.expr)
        if bounds is not None and (float(bounds.lower) > 2 or not math.isinf(float(bounds.upper))):
            raise BatchDependence(
                f"{type(model).__name__}.forward holds only for batch sizes in [{bounds.lower}, {bounds.upper}] (a "
                "branch or assert on the batch size): microbatches would take another path")


def check_other_batch_size(model: nn.Module, gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> None:
    """Run the exported code and the model itself on half the example batch, drawing the same
    random numbers, and refuse if they differ: export may bake a size into the code without a
    guard (``x * len(x)`` traces as ``x * 8``), which microbatches would silently get wrong."""
    half = tuple(t[: t.shape[0] // 2] for t in inputs)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        want = torch.utils._pytree.tree_leaves(model(*half))
        torch.manual_seed(0)
        try:
            got = torch.utils._pytree.tree_leaves(gm(*half))
        except Exception as err:  # export's own input checks: the trace fixed the batch size
            raise BatchDependence(
                f"torch.export's trace of {type(model).__name__}.forward does not hold for another batch size (a "
                f"size turned into a constant, such as len(x)): {str(err).splitlines()[0]}") from None
    same = len(want) == len(got) and all(
        isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) and w.shape == g.shape
        and torch.allclose(g.double(), w.double(), rtol=1e-4, atol=1e-5) for w, g in zip(want, got, strict=False)
    )
    if not same:
        raise BatchDependence(
            f"torch.export's trace of {type(model).__name__}.forward does not hold for another batch size (a size "
            "turned into a constant, such as len(x)): on half the example batch it computes other values than "
            "forward; read sizes with x.size(0) or x.shape[0]")


def _normalise(gm: torch.fx.GraphModule) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if (node.op == "call_module" and node.target == "_guards_fn") or (
            node.op == "call_function" and node.target in _ASSERTIONS and not node.users
        ):
            graph.erase_node(node)
    previous: tuple[int, tuple] | None = None
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        recorded = _recorded(gm, node)
        if recorded is None:  # made by export's own passes (a getitem of a higher-order op)
            recorded = previous if previous is not None else (0, ())
        previous = recorded
        node.meta["piper_run"], node.meta["piper_scopes"] = recorded
        node.meta["piper_checkpoint"] = None
        node.meta["piper_context"] = Context()
        node.type = None
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    graph.lint()
    gm.recompile()


def _name_tied_uses(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Export reads a tied parameter under one of its names everywhere; read it under the name
    of the module that uses it (``embed.weight`` in the embedding, ``head.weight`` in the head),
    as fx does, so each segment names it as the model's code does."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        try:
            param = gm.get_parameter(str(node.target))
        except AttributeError:
            continue
        names = aliases.get(id(param), [])
        if len(names) < 2:
            continue
        for user in list(node.users):
            stack = user.meta.get("nn_module_stack") or {}
            owner = next(reversed(stack.values()))[0] if stack else ""
            wanted = next((n for n in names if n.rpartition(".")[0] == owner), None)
            if wanted is None or wanted == node.target:
                continue
            with graph.inserting_before(user):
                alias = graph.get_attr(wanted)
            alias.meta.update(node.meta)
            user.replace_input_with(node, alias)
        if not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _recorded(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[int, tuple] | None:
    """The (run, scopes) ``node`` was traced in; for a higher-order operation (a grad-mode or
    autocast block), those of the last operation of its sub-graph: a block that spans two
    regions belongs to the one where it ends, which receives what the block reads from the
    earlier one."""
    found = (node.meta.get("custom") or {}).get(EXPORT_META)
    if found is not None:
        return found
    for arg in node.args:
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            sub = getattr(gm, str(arg.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                for inner in reversed(sub.graph.nodes):
                    inner_found = (inner.meta.get("custom") or {}).get(EXPORT_META)
                    if inner_found is not None and inner.op.startswith("call_"):
                        return inner_found
    return None


def size_like(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes a Python number (a size, or arithmetic on sizes), not a tensor."""
    value = node.meta.get("val")
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool | int | float | bool):
        return node.op == "call_function"
    return False


def local_size(
    node: torch.fx.Node,
    graph: torch.fx.Graph,
    available: dict[torch.fx.Node, torch.fx.Node],
    bring: Callable[[torch.fx.Node], torch.fx.Node],
) -> torch.fx.Node:
    """A copy of size node ``node`` in ``graph``, computed from what ``graph`` has: a size of a
    tensor it does not have is read off one it has (``available``: original -> local node)
    that carries the same symbolic size; only if none does is the tensor brought in
    (``bring``). Arithmetic on sizes is copied with its operands made local the same way."""
    if node in available:
        return available[node]
    if node.target is torch.ops.aten.sym_size.int:
        tensor, dim = node.args
        if tensor not in available:
            found = _same_size(node, available)
            if found is not None:
                local = graph.call_function(torch.ops.aten.sym_size.int, found)
                local.meta.update(node.meta)
                available[node] = local
                return local
        local = graph.call_function(torch.ops.aten.sym_size.int, (available.get(tensor) or bring(tensor), dim))
    else:
        def arg(a: object) -> object:
            if isinstance(a, torch.fx.Node):
                return local_size(a, graph, available, bring) if size_like(a) else available.get(a) or bring(a)
            return a

        local = graph.call_function(node.target, tuple(torch.fx.node.map_aggregate(node.args, arg)),
                                    dict(torch.fx.node.map_aggregate(node.kwargs, arg)))
    local.meta.update(node.meta)
    available[node] = local
    return local


def _same_size(node: torch.fx.Node, available: dict[torch.fx.Node, torch.fx.Node]) -> tuple[torch.fx.Node, int] | None:
    wanted = node.meta.get("val")
    if not isinstance(wanted, torch.SymInt):
        return None
    expr = wanted.node.expr
    # A segment's inputs first: they exist before any of its operations run.
    ordered = sorted(available.items(), key=lambda item: item[1].op != "placeholder")
    for original, local in ordered:
        value = original.meta.get("val")
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == expr:
                    return local, d
    return None


__all__ = ["BatchDependence", "check_other_batch_size", "exported_graph", "local_size", "size_like"]
