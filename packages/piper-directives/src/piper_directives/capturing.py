"""``capture``: trace an annotated model into Piper's single-device training DAG.

The model is traced with ``torch.fx``; every operation remembers the annotation scopes it was
created in. Maximal runs of operations with the same scopes become *segments*; the traced
graph is split into one ``GraphModule`` per segment, and the loss function becomes one more
segment. The result is the IR ``Graph`` of one training step (see docs/ir-conventions.md,
section 1) plus the torch modules that carry each segment's code.

Requires: every operation of ``forward`` lies inside some ``annotate`` region, and each
parameter is used by one segment only. Guarantees: the graph validates, segment modules take
their inputs positionally and return tuples in ``Segment.outputs`` order, and they share
parameters with ``model`` (nothing is copied).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.fx

from piper_directives.annotate import Scope, current_scopes, tracing
from piper_directives.training_graph import training_graph
from piper_ir import (
    CaptureError,
    CodeRef,
    Graph,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
    Value,
    grad_name,
    validate,
)

LOSS = "loss"
CODE_FORMAT = "torch.fx.GraphModule"


@attrs.define
class CapturedModel:
    """The training DAG of one step and the torch code of each of its segments."""

    graph: Graph
    modules: dict[str, torch.nn.Module]
    batch_size: int


class LossModule(torch.nn.Module):
    """The loss segment: ``loss_fn(*model_outputs, *targets)``."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], n_outputs: int) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.n_outputs = n_outputs

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(*args[: self.n_outputs], *args[self.n_outputs :])


class _ScopeTracer(torch.fx.Tracer):
    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["piper_scopes"] = current_scopes()
        return node

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        # An expert module (``piper_experts = True``) stays one call, so the expert-parallel
        # rewrite (piper_directives.expert_code) can route tokens around it.
        return bool(getattr(m, "piper_experts", False)) or super().is_leaf_module(m, module_qualified_name)


_COMPUTE_OPS = ("call_function", "call_method", "call_module")


def capture(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    example_targets: Sequence[torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
) -> CapturedModel:
    """Trace ``model`` and build its single-device training DAG.

    ``example_inputs`` and ``example_targets`` are one full batch (split along dim 0 later);
    the batch must hold at least 2 samples so the batch dimension of every value can be found.
    """
    inputs, targets = tuple(example_inputs), tuple(example_targets)
    _check_batch(inputs, targets)
    with tracing():
        try:
            traced_graph = _ScopeTracer().trace(model)
        except CaptureError:
            raise
        except Exception as err:  # torch.fx's own errors: keep its message, name the model
            raise CaptureError(f"torch.fx could not trace {type(model).__name__}: {err}") from err
    gm = torch.fx.GraphModule(model, traced_graph)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise CaptureError(
            f"{type(model).__name__}.forward takes {len(placeholders)} inputs but "
            f"{len(inputs)} example inputs were given"
        )
    for node in gm.graph.nodes:
        node.type = None  # annotations like ``x: Tensor`` would not survive pickling
    gm.recompile()
    partition_of, segment_scopes = _assign_segments(gm)
    parts = _split(gm, partition_of, len(segment_scopes))
    return _build(model, gm, parts, segment_scopes, inputs, targets, loss_fn)


@attrs.define
class _Part:
    """One segment cut out of the traced graph: its module, inputs and outputs (fx nodes of
    the traced graph, in the order the module takes and returns them)."""

    module: torch.fx.GraphModule
    inputs: list[torch.fx.Node]
    outputs: list[torch.fx.Node]


def _split(gm: torch.fx.GraphModule, partition_of: dict[str, int], count: int) -> list[_Part]:
    """Cut the traced graph into one GraphModule per segment.

    Unlike ``torch.fx.passes.split_module``, parameters and buffers (``get_attr``) are copied
    into the segment that uses them instead of being passed in as inputs, and attributes keep
    the model's qualified names (``blocks.0.lin.weight``).
    """
    graphs = [torch.fx.Graph() for _ in range(count)]
    envs: list[dict[torch.fx.Node, torch.fx.Node]] = [{} for _ in range(count)]
    inputs: list[list[torch.fx.Node]] = [[] for _ in range(count)]
    outputs: list[list[torch.fx.Node]] = [[] for _ in range(count)]
    for node in gm.graph.nodes:
        if node.op in _COMPUTE_OPS:
            k = partition_of[node.name]
            env, graph = envs[k], graphs[k]

            def local(arg: torch.fx.Node, env=env, graph=graph, k=k) -> torch.fx.Node:
                if arg not in env:
                    if arg.op == "get_attr":
                        env[arg] = graph.get_attr(arg.target)
                    else:  # produced by another segment or a model input
                        env[arg] = graph.placeholder(arg.name)
                        inputs[k].append(arg)
                return env[arg]

            env[node] = graph.node_copy(node, local)
            for user in node.users:
                if user.op == "output" or (user.op in _COMPUTE_OPS and partition_of[user.name] != k):
                    outputs[k].append(node)
                    break
    parts = []
    for k in range(count):
        graphs[k].output(tuple(envs[k][n] for n in outputs[k]))
        graphs[k].lint()
        parts.append(_Part(torch.fx.GraphModule(gm, graphs[k], class_name=f"Segment{k}"), inputs[k], outputs[k]))
    return parts


def _check_batch(inputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> None:
    if not inputs or not targets:
        raise CaptureError("capture needs at least one example input and one example target")
    for kind, tensors in (("input", inputs), ("target", targets)):
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise CaptureError(f"example {kind} {i} must be a tensor with a batch dimension (dim 0)")
    sizes = {t.shape[0] for t in inputs + targets}
    if len(sizes) != 1:
        raise CaptureError(f"example inputs and targets disagree on the batch size (dim 0): {sorted(sizes)}")
    if sizes.pop() < 2:
        raise CaptureError("capture needs an example batch of at least 2 samples")


def _describe(node: torch.fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    where = ""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    torch_dir = os.path.dirname(torch.__file__)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File ") and torch_dir not in lines[i] and "piper_directives" not in lines[i]:
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            where = f" at {lines[i]}" + (f": {code}" if code else "")
            break
    return f"{node.op} {target!s} (fx node {node.name!r}){where}"


def _assign_segments(gm: torch.fx.GraphModule) -> tuple[dict[str, int], list[tuple[Scope, ...]]]:
    """Map every fx node to a segment index; segments are maximal runs of one scope stack."""
    partition_of: dict[str, int] = {}
    segment_scopes: list[tuple[Scope, ...]] = []
    last_key: tuple[int, ...] | None = None
    outside = []
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE_OPS:
            continue
        scopes: tuple[Scope, ...] = node.meta.get("piper_scopes", ())
        if not scopes:
            outside.append(node)
            continue
        key = tuple(s.uid for s in scopes)
        if key != last_key:
            segment_scopes.append(scopes)
            last_key = key
        partition_of[node.name] = len(segment_scopes) - 1
    if outside:
        raise CaptureError(
            f"{len(outside)} operation(s) lie outside every annotate(...) region; wrap them in one. "
            f"First: {_describe(outside[0])}",
            nodes=[n.name for n in outside],
        )
    if not segment_scopes:
        raise CaptureError("the model has no annotated region: wrap its forward in annotate(...)")
    # get_attr nodes (parameters, buffers, constants) belong to the segment of their users.
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            users = {partition_of[u.name] for u in node.users if u.name in partition_of}
            if len(users) > 1 and isinstance(_fetch_attr(gm, node.target), torch.nn.Parameter):
                raise CaptureError(
                    f"parameter {node.target!r} is used by several segments "
                    f"({', '.join(f's{i}' for i in sorted(users))}); tied parameters are not supported"
                )
            partition_of[node.name] = min(users) if users else 0
    return partition_of, segment_scopes


def _fetch_attr(module: torch.nn.Module, qualname: str) -> object:
    obj: object = module
    for atom in qualname.split("."):
        obj = getattr(obj, atom)
    return obj


class _Recorder(torch.fx.Interpreter):
    """Runs the traced module and keeps every node's result."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.results: dict[str, object] = {}

    def run_node(self, n: torch.fx.Node) -> object:
        out = super().run_node(n)
        self.results[n.name] = out
        return out


def _run(gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[str, object]:
    recorder = _Recorder(gm)
    with torch.enable_grad():
        recorder.run(*inputs)
    return recorder.results


def _meta(full: torch.Tensor, half: torch.Tensor | None, requires_grad: bool) -> TensorMeta:
    batch_dim = None
    if half is not None:
        for d, (a, b) in enumerate(zip(full.shape, half.shape, strict=False)):
            if a != b:
                batch_dim = d
                break
    return TensorMeta(
        shape=tuple(full.shape),
        dtype=str(full.dtype).removeprefix("torch."),
        batch_dim=batch_dim,
        requires_grad=requires_grad and full.is_floating_point(),
    )


def _build(
    model: torch.nn.Module,
    gm: torch.fx.GraphModule,
    parts: list[_Part],
    segment_scopes: list[tuple[Scope, ...]],
    inputs: tuple[torch.Tensor, ...],
    targets: tuple[torch.Tensor, ...],
    loss_fn: Callable[..., torch.Tensor],
) -> CapturedModel:
    batch = inputs[0].shape[0]
    half_inputs = tuple(t[: batch // 2] for t in inputs)
    try:
        full = _run(gm, inputs)
        half = _run(gm, half_inputs)
    except Exception as err:
        raise CaptureError(f"running {type(model).__name__} on the example inputs failed: {err}") from err

    value_of: dict[str, str] = {}  # traced fx node name -> value name
    producer: dict[str, str] = {}  # value name -> segment id
    values: dict[str, Value] = {}
    segments: list[Segment] = []
    modules: dict[str, torch.nn.Module] = {}
    owner: dict[str, str] = {}  # parameter name -> segment id

    def add_value(node_name: str, name: str) -> None:
        tensor, half_tensor = full[node_name], half[node_name]
        if not isinstance(tensor, torch.Tensor):
            raise CaptureError(
                f"value {node_name!r} is a {type(tensor).__name__}; segments may only exchange tensors"
            )
        value_of[node_name] = name
        ht = half_tensor if isinstance(half_tensor, torch.Tensor) else None
        values[name] = Value(name, _meta(tensor, ht, tensor.requires_grad))

    top_nodes = list(gm.graph.nodes)
    for i, node in enumerate(n for n in top_nodes if n.op == "placeholder"):
        add_value(node.name, f"input:{i}")

    for index, part in enumerate(parts):
        seg_id = f"s{index}"
        outs = []
        for out_node in part.outputs:
            name = f"v:{out_node.name}"
            add_value(out_node.name, name)
            outs.append(name)
            producer[name] = seg_id
        scopes = segment_scopes[index]
        sub = part.module
        params = tuple(
            (pname, TensorMeta(tuple(p.shape), str(p.dtype).removeprefix("torch."), None, True))
            for pname, p in sub.named_parameters()
        )
        for pname, _ in params:
            if pname in owner:
                raise CaptureError(
                    f"parameter {pname!r} is used by segments {owner[pname]} and {seg_id}; "
                    "tied parameters are not supported"
                )
            owner[pname] = seg_id
        digest = hashlib.sha256(sub.code.encode()).hexdigest()[:16]
        segments.append(
            Segment(
                id=seg_id,
                role=SegmentRole.STAGE,
                tags=Tags(tuple((s.tag, s.index) for s in scopes)),
                inputs=tuple(value_of[a.name] for a in part.inputs),
                outputs=tuple(outs),
                params=params,
                code=CodeRef(CODE_FORMAT, 1, digest),
                source=scopes[-1].source,
            )
        )
        modules[seg_id] = sub

    out_arg = next(n for n in top_nodes if n.op == "output").args[0]
    out_nodes = list(out_arg) if isinstance(out_arg, tuple | list) else [out_arg]
    model_outputs = []
    for n in out_nodes:
        if not isinstance(n, torch.fx.Node) or n.name not in value_of:
            raise CaptureError(f"{type(model).__name__}.forward must return tensors computed by the model, got {n!r}")
        model_outputs.append(value_of[n.name])

    target_names = []
    for i, t in enumerate(targets):
        name = f"target:{i}"
        values[name] = Value(name, _meta(t, t[: batch // 2], False))
        target_names.append(name)

    loss_module = LossModule(loss_fn, len(model_outputs))
    example_outputs = [full[n.name] for n in out_nodes]
    try:
        loss = loss_module(*example_outputs, *targets)
    except Exception as err:
        raise CaptureError(f"the loss function failed on the model output: {err}") from err
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        raise CaptureError("the loss function must return a floating-point scalar tensor")
    segments.append(
        Segment(LOSS, SegmentRole.LOSS, Tags(), tuple(model_outputs) + tuple(target_names), (), (), None)
    )
    modules[LOSS] = loss_module

    # Gradient values: one per value that carries a gradient between segments.
    for name in list(values):
        meta = values[name].meta
        if meta.requires_grad and name in producer:
            values[grad_name(name)] = Value(grad_name(name), meta)

    graph = training_graph(segments, list(values.values()), [f"input:{i}" for i in range(len(inputs))], target_names)
    return CapturedModel(graph=validate(graph), modules=modules, batch_size=batch)
