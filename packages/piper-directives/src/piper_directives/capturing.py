"""``capture``: trace a model into Piper's single-device training DAG.

The model is traced with ``torch.fx``, or where fx cannot trace it with ``torch.export``
(piper_directives.tracers; ``method`` chooses, ``CapturedModel.method`` says which ran). Its
regions are the ``annotate`` regions its ``forward`` enters, or regions named by module path
(``regions=``, piper_directives.regions), or for a model with neither one region per entry
of its largest ``ModuleList`` (``CapturedModel.regions`` says which). Every operation
remembers the annotation scopes and
the *run* (the stretch between two region boundaries, piper_directives.annotate) it was
created in, the autocast and grad mode it was traced under (piper_directives.contexts) and
whether it ran inside ``torch.utils.checkpoint``. Each run of operations becomes a
*segment*; the traced graph is split into one ``SegmentModule`` per segment, and the loss
function becomes one more segment. The result is the IR ``Graph`` of one training step (see
docs/ir-conventions.md, section 1) plus the torch modules that carry each segment's code.

Requires: every operation of ``forward`` lies inside some region; regions
exchange only tensors; ``forward`` mutates no buffer in place. Guarantees: the graph
validates; segment modules take their inputs positionally, return tuples in
``Segment.outputs`` order, keep the user's autocast and no-grad regions, and share
parameters with ``model`` (nothing is copied); a parameter used by several segments (tied
weights, or a module called from several regions) is in each one's ``params`` and in one
``Graph.ties`` entry; a segment that ran inside ``torch.utils.checkpoint`` has
``recompute=True``. Capturing leaves the model's buffers and the global random state as it
found them.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.fx
from torch import nn

from piper_directives.annotate import Scope
from piper_directives.contexts import insert_contexts
from piper_directives.diagnose import describe
from piper_directives.exporting import local_size, size_like
from piper_directives.precision import (
    cast_forward,
    cast_inputs,
    dtype_name,
    precision_of,
    torch_dtype,
    upcast,
)
from piper_directives.regions import ModuleRegions, RegionSpec
from piper_directives.segment_module import SegmentModule
from piper_directives.tracers import METHODS, module_regions, restored_buffers, traced
from piper_directives.training_graph import training_graph
from piper_directives.user_code import user_code_modules
from piper_ir import (
    CaptureError,
    CodeRef,
    Graph,
    Precision,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
    Tie,
    Value,
    grad_name,
    validate,
)

LOSS = "loss"
CODE_FORMAT = "torch.fx.GraphModule"


@attrs.define
class CapturedModel:
    """The training DAG of one step and the torch code of each of its segments.

    ``runs`` maps the region boundary at which each stage segment starts (numbered as
    ``forward`` crosses them, piper_directives.annotate) to the segment's id: what
    single-device training needs to draw the segments' random numbers
    (piper_directives.randomness.seeded_regions). ``user_modules`` names the user's own
    Python modules the segments refer to, which must travel to the workers by value
    (piper_directives.user_code). ``method`` is the tracer that captured the model (``"fx"``
    or ``"export"``); ``regions`` the module-path regions it was captured with (given, or the
    default for a model without annotations), None for a model that annotates itself.
    """

    graph: Graph
    modules: dict[str, torch.nn.Module]
    batch_size: int
    runs: dict[int, str] = attrs.field(factory=dict)
    user_modules: tuple[str, ...] = ()
    method: str = "fx"
    regions: ModuleRegions | None = None


class LossModule(torch.nn.Module):
    """The loss segment: ``loss_fn(*model_outputs, *targets)``; with ``master`` set (the
    master dtype of a ``Precision``), floating model outputs are first cast to it."""

    def __init__(
        self, loss_fn: Callable[..., torch.Tensor], n_outputs: int, master: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.n_outputs = n_outputs
        self.master = master

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        outputs = args[: self.n_outputs]
        if self.master is not None:
            outputs = upcast(outputs, self.master)
        return self.loss_fn(*outputs, *args[self.n_outputs :])


_COMPUTE_OPS = ("call_function", "call_method", "call_module")


Tensors = torch.Tensor | Sequence[torch.Tensor]  # a batch's inputs or targets: one tensor, or several


def as_tensors(value: Tensors) -> tuple[torch.Tensor, ...]:
    """A batch's inputs or targets as a tuple: one tensor is one input (not a sequence of its
    rows, which is what ``tuple(tensor)`` would make of it)."""
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def capture(
    model: torch.nn.Module,
    example_inputs: Tensors,
    example_targets: Tensors,
    loss_fn: Callable[..., torch.Tensor],
    *,
    precision: str | Precision | None = None,
    regions: RegionSpec | ModuleRegions | None = None,
    method: str = "auto",
) -> CapturedModel:
    """Trace ``model`` and build its single-device training DAG.

    ``example_inputs`` and ``example_targets`` are one full batch (split along dim 0 later),
    each a tensor or a sequence of tensors (a model with several inputs, a loss with several
    targets);
    the batch must hold at least 2 samples so the batch dimension of every value can be found.
    ``precision`` (``"bf16"``, or a ``Precision``) records a step that computes in that
    dtype with the parameters as fp32 master weights: values are recorded in the compute
    dtype and the loss casts the model outputs up (piper_directives.precision).
    ``regions`` names the regions by module path instead of ``annotate`` in ``forward``
    (piper_directives.regions); ``method`` is ``"fx"``, ``"export"`` or ``"auto"`` (fx, and
    export where fx cannot trace the model).
    """
    if method not in METHODS:
        raise CaptureError(f"capture method must be one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"the model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise CaptureError(f"the loss function must be callable as loss_fn(*outputs, *targets), got "
                           f"{type(loss_fn).__name__}")
    inputs, targets = as_tensors(example_inputs), as_tensors(example_targets)
    _check_batch(inputs, targets)
    policy = _precision(model, precision)
    named = module_regions(model, regions)
    with torch.random.fork_rng(devices=[]), restored_buffers(model) as buffers:
        compute = torch_dtype(policy.compute) if policy else None
        gm, method, named = traced(model, inputs, named, method, compute)
        if changed := buffers.changed():
            _refuse_traced_mutation(model, changed)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise CaptureError(
                f"{type(model).__name__}.forward takes {len(placeholders)} inputs but "
                f"{len(inputs)} example inputs were given"
            )
        _assign_segments(gm)  # refuses operations outside every region before anything else
        insert_contexts(gm.graph, lambda n: n.meta.get("piper_run"))
        partition_of, segment_nodes = _assign_segments(gm)  # again: the context calls are operations too
        gm.recompile()
        parts = _split(gm, partition_of, len(segment_nodes))
        captured = _build(model, gm, parts, segment_nodes, inputs, targets, loss_fn, policy)
        return attrs.evolve(captured, method=method, regions=named)


def _precision(model: nn.Module, precision: str | Precision | None) -> Precision | None:
    if precision is None or isinstance(precision, Precision):
        return precision
    masters = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(masters) > 1:
        raise CaptureError(f"--precision needs one parameter dtype to keep as master weights, found {sorted(map(str, masters))}")
    return precision_of(precision, masters.pop() if masters else torch.float32)


@attrs.define
class _Part:
    """One segment cut out of the traced graph: its module, inputs and outputs (fx nodes of
    the traced graph, in the order the module takes and returns them)."""

    module: torch.fx.GraphModule
    inputs: list[torch.fx.Node]
    outputs: list[torch.fx.Node]


def _split(gm: torch.fx.GraphModule, partition_of: dict[str, int], count: int) -> list[_Part]:
    """Cut the traced graph into one ``SegmentModule`` per segment.

    Unlike ``torch.fx.passes.split_module``, parameters and buffers (``get_attr``) are copied
    into every segment that uses them instead of being passed in as inputs, and attributes
    keep the model's qualified names (``blocks.0.lin.weight``).
    """
    graphs = [torch.fx.Graph() for _ in range(count)]
    envs: list[dict[torch.fx.Node, torch.fx.Node]] = [{} for _ in range(count)]
    inputs: list[list[torch.fx.Node]] = [[] for _ in range(count)]
    outputs: list[list[torch.fx.Node]] = [[] for _ in range(count)]
    for node in gm.graph.nodes:
        if node.op in _COMPUTE_OPS and not size_like(node):  # sizes: made where used (exporting.local_size)
            k = partition_of[node.name]
            env, graph = envs[k], graphs[k]

            def bring(arg: torch.fx.Node, env=env, graph=graph, k=k) -> torch.fx.Node:
                env[arg] = graph.placeholder(arg.name)  # produced by another segment or a model input
                inputs[k].append(arg)
                return env[arg]

            def local(arg: torch.fx.Node, env=env, graph=graph, bring=bring) -> torch.fx.Node:
                if arg not in env:
                    if arg.op == "get_attr":
                        env[arg] = graph.get_attr(arg.target)
                    elif size_like(arg):
                        return local_size(arg, graph, env, bring)
                    else:
                        return bring(arg)
                return env[arg]

            env[node] = graph.node_copy(node, local)
            for user in node.users:
                if user.op == "output" or (
                    user.op in _COMPUTE_OPS and not size_like(user) and partition_of[user.name] != k
                ):
                    outputs[k].append(node)
                    break
    parts = []
    for k in range(count):
        graphs[k].output(tuple(envs[k][n] for n in outputs[k]))
        graphs[k].lint()
        parts.append(_Part(SegmentModule(gm, graphs[k], class_name=f"Segment{k}"), inputs[k], outputs[k]))
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


def _assign_segments(gm: torch.fx.GraphModule) -> tuple[dict[str, int], list[list[torch.fx.Node]]]:
    """Map every fx node to a segment index; a segment is one run (the operations between
    two region boundaries). Returns the mapping and each segment's operations."""
    partition_of: dict[str, int] = {}
    segments: list[list[torch.fx.Node]] = []
    last_run: int | None = None
    outside = []
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE_OPS or size_like(node):
            continue
        if not node.meta.get("piper_scopes"):
            outside.append(node)
            continue
        run = node.meta["piper_run"]
        if run != last_run:
            segments.append([])
            last_run = run
        segments[-1].append(node)
        partition_of[node.name] = len(segments) - 1
    if outside:
        raise CaptureError(
            f"{len(outside)} operation(s) lie outside every annotate(...) region; wrap them in one. "
            f"First: {describe(outside[0])}",
            nodes=[n.name for n in outside],
        )
    if not segments:
        raise CaptureError("the model has no annotated region: wrap its forward in annotate(...)")
    # get_attr nodes (parameters, buffers, constants) are copied into every segment using them.
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            users = {partition_of[u.name] for u in node.users if u.name in partition_of}
            partition_of[node.name] = min(users) if users else 0
    return partition_of, segments


class _Recorder(torch.fx.Interpreter):
    """Runs the traced module and keeps every node's result."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.results: dict[str, object] = {}

    def run_node(self, n: torch.fx.Node) -> object:
        out = super().run_node(n)
        self.results[n.name] = out
        return out


class _Recording(nn.Module):
    """``_Recorder`` as a module, so ``cast_forward`` can run it on cast parameters."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *inputs: torch.Tensor) -> dict[str, object]:
        recorder = _Recorder(self.gm)
        recorder.run(*inputs)
        return recorder.results


def _run(gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...], compute: torch.dtype | None) -> dict[str, object]:
    with torch.enable_grad():
        if compute is None:
            return _Recording(gm)(*inputs)
        return cast_forward(_Recording(gm), inputs, compute)  # type: ignore[return-value]


def _meta(full: torch.Tensor, half: torch.Tensor | None, requires_grad: bool) -> TensorMeta:
    batch_dim = None
    if half is not None:
        for d, (a, b) in enumerate(zip(full.shape, half.shape, strict=False)):
            if a != b:
                batch_dim = d
                break
    return TensorMeta(
        shape=tuple(full.shape),
        dtype=dtype_name(full.dtype),
        batch_dim=batch_dim,
        requires_grad=requires_grad and full.is_floating_point(),
    )


def _refuse_buffer_mutation(gm: torch.fx.GraphModule, changed: list[str]) -> None:
    """Name the first buffer ``forward`` changed in place and the operation that uses it."""
    name = changed[0]
    users = [
        n for n in gm.graph.nodes
        if (n.op == "get_attr" and n.target == name)
        or (n.op == "call_module" and name.startswith(f"{n.target}."))
    ]
    users = [u for n in users for u in ([n] if n.op == "call_module" else list(n.users))] or users
    where = f" by {describe(users[0])}" if users else ""
    raise CaptureError(
        f"forward changes buffer {name!r} in place{where}. Piper refuses in-place buffer updates "
        "(BatchNorm's running statistics, counters, caches): replicas and pipeline stages would each "
        "update their own copy, so training would silently differ from one device. Use a "
        "normalisation without running statistics (LayerNorm, GroupNorm, or BatchNorm with "
        "track_running_stats=False), or keep the state outside forward."
        + (f" Other buffers changed: {', '.join(changed[1:])}." if len(changed) > 1 else "")
    )


def _refuse_traced_mutation(model: nn.Module, changed: list[str]) -> None:
    """A buffer changed while ``forward`` was traced: an in-place operation on it that
    involves no traced value ran once, now, and is not in the captured code at all."""
    name = changed[0]
    owner_path = name.rpartition(".")[0]
    owner = model.get_submodule(owner_path)
    try:
        where = f" ({type(owner).__name__}, {inspect.getsourcefile(type(owner))}:{inspect.getsourcelines(type(owner))[1]})"
    except (OSError, TypeError):
        where = f" ({type(owner).__name__})"
    raise CaptureError(
        f"forward changes buffer {name!r} of module {owner_path or '<model>'!r}{where} in place with an operation "
        "that involves no input (for example self.count.add_(1)): tracing ran it once, and the captured code "
        "would never run it again. Piper refuses in-place buffer updates; keep such state outside forward."
    )


def _ties(model: nn.Module, parts: list[_Part]) -> tuple[Tie, ...]:
    """A ``Tie`` for every parameter object that several segment modules hold, named as the
    model names it, with the operation of each holder that uses it (``Tie.uses``)."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    holders: dict[int, list[tuple[str, str]]] = {}
    for index, part in enumerate(parts):
        for qualname, p in part.module.named_parameters():
            holders.setdefault(id(p), []).append((f"s{index}", qualname))
    return tuple(
        Tie(
            canonical.get(pid, found[0][1]),
            found,
            tuple(_use(parts[int(seg[1:])].module, qualname) for seg, qualname in found),
        )
        for pid, found in holders.items()
        if len(found) > 1
    )


def _use(module: nn.Module, qualname: str) -> str:
    """The first operation of a segment module that uses parameter ``qualname`` (module path
    and the user's source line), or "" if none is found."""
    if isinstance(module, torch.fx.GraphModule):
        for node in module.graph.nodes:
            if node.op in ("get_attr", "call_module") and (
                qualname == node.target or qualname.startswith(f"{node.target}.")
            ):
                return describe(node if node.op == "call_module" else next(iter(node.users), node))
    return ""


def _build(
    model: torch.nn.Module,
    gm: torch.fx.GraphModule,
    parts: list[_Part],
    segment_nodes: list[list[torch.fx.Node]],
    inputs: tuple[torch.Tensor, ...],
    targets: tuple[torch.Tensor, ...],
    loss_fn: Callable[..., torch.Tensor],
    precision: Precision | None,
) -> CapturedModel:
    compute = torch_dtype(precision.compute) if precision else None
    batch = inputs[0].shape[0]
    buffers = restored_buffers(model)
    try:
        if compute is not None:
            # Under a precision the runs below update cast copies of the buffers, not the
            # buffers: look for in-place updates on one uncast run first.
            _run(gm, tuple(t[: batch // 2] for t in inputs), None)
            if changed := buffers.changed():
                _refuse_buffer_mutation(gm, changed)
            inputs = cast_inputs(inputs, compute)
        half_inputs = tuple(t[: batch // 2] for t in inputs)
        full = _run(gm, inputs, compute)
        half = _run(gm, half_inputs, compute)
    except CaptureError:
        raise
    except Exception as err:
        raise CaptureError(f"running {type(model).__name__} on the example inputs failed: {err}") from err
    if changed := buffers.changed():
        _refuse_buffer_mutation(gm, changed)
    segment_of = {n.name: i for i, nodes in enumerate(segment_nodes) for n in nodes}

    value_of: dict[str, str] = {}  # traced fx node name -> value name
    producer: dict[str, str] = {}  # value name -> segment id
    values: dict[str, Value] = {}
    segments: list[Segment] = []
    modules: dict[str, torch.nn.Module] = {}

    def add_value(node: torch.fx.Node, name: str, reader: str) -> None:
        tensor, half_tensor = full[node.name], half[node.name]
        if not isinstance(tensor, torch.Tensor):
            made = f"region s{segment_of[node.name]}" if node.name in segment_of else "the model"
            raise CaptureError(
                f"{made} hands {reader} a {type(tensor).__name__}, not a tensor: {describe(node)}. "
                "Regions may exchange only tensors: compute sizes and other Python values inside the "
                "region that uses them, and index tuples inside the region that made them."
            )
        value_of[node.name] = name
        ht = half_tensor if isinstance(half_tensor, torch.Tensor) else None
        values[name] = Value(name, _meta(tensor, ht, tensor.requires_grad))

    top_nodes = list(gm.graph.nodes)
    for i, node in enumerate(n for n in top_nodes if n.op == "placeholder"):
        add_value(node, f"input:{i}", "the model")

    readers: dict[str, str] = {}
    for index, part in enumerate(parts):
        for node in part.inputs:
            readers.setdefault(node.name, f"region s{index}")
    for index, part in enumerate(parts):
        seg_id = f"s{index}"
        outs = []
        for out_node in part.outputs:
            name = f"v:{out_node.name}"
            add_value(out_node, name, readers.get(out_node.name, "the loss"))
            outs.append(name)
            producer[name] = seg_id
        nodes = segment_nodes[index]
        scopes: tuple[Scope, ...] = nodes[0].meta["piper_scopes"]
        sub = part.module
        params = tuple(
            (pname, TensorMeta(tuple(p.shape), dtype_name(p.dtype), None, True))
            for pname, p in sub.named_parameters()
        )
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
                recompute=any(n.meta.get("piper_checkpoint") for n in nodes),
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

    master = torch_dtype(precision.master) if precision else None
    loss_module = LossModule(loss_fn, len(model_outputs), master)
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
    graph = attrs.evolve(graph, ties=_ties(model, parts), precision=precision)
    runs = {nodes[0].meta["piper_run"]: f"s{i}" for i, nodes in enumerate(segment_nodes)}
    return CapturedModel(validate(graph), modules, batch, runs, user_code_modules(modules))


def tie_locations(captured: CapturedModel, tie: Tie) -> str:
    """Each holder of ``tie`` with the operation that uses it (module path and source line),
    for messages that must name every holder (``Tie.describe``)."""
    if len(tie.uses) != len(tie.holders):
        tie = attrs.evolve(tie, uses=tuple(_use(captured.modules[seg], q) for seg, q in tie.holders))
    return tie.describe()
