"""Tracing a model for capture: which tracer, which regions.

``traced`` runs torch.fx (``_ScopeTracer``: every node records the annotation scopes, run,
autocast and grad mode it was traced in, and whether it ran inside ``torch.utils.checkpoint``)
or, where fx cannot trace the model, torch.export (piper_directives.exporting), with the
model's module-path regions installed (piper_directives.regions): those given, or for a model
that enters no ``annotate`` region one per entry of its largest ``ModuleList``. Capture
(piper_directives.capturing) cuts what it returns into segments.
"""

from __future__ import annotations

import contextlib
import copy as _copy
import os
import sys
import traceback
import warnings

import torch
import torch.fx
from torch import nn

from piper_directives.annotate import current_run, current_scopes, on_boundaries, tracing
from piper_directives.contexts import current_context
from piper_directives.diagnose import trace_error
from piper_directives.exporting import BatchDependence, check_other_batch_size, exported_graph
from piper_directives.precision import cast_inputs
from piper_directives.regions import ModuleRegions, RegionSpec, module_entered, told
from piper_ir import CaptureError

METHODS = ("auto", "fx", "export")  # how capture traces: fx, falling back to export; or one of them
CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")
_TORCH_DIR = os.path.dirname(torch.__file__)
_COMPUTE_OPS = ("call_function", "call_method", "call_module")


def _checkpoint_site() -> str | None:
    """``file:line`` of the user's ``torch.utils.checkpoint`` call enclosing the operation
    being traced (the outermost one), or None outside one."""
    frame, outermost = sys._getframe(2), None
    while frame is not None:
        if frame.f_code.co_filename.endswith(CHECKPOINT_FILE):
            outermost = frame
        frame = frame.f_back
    if outermost is None:
        return None
    caller = outermost.f_back
    while caller is not None and caller.f_code.co_filename.startswith(_TORCH_DIR):
        caller = caller.f_back  # decorators around checkpoint (torch._disable_dynamo)
    return f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "torch.utils.checkpoint"


# Frames of the tracer, not of the model: left out of a node's stack trace.
_TRACER_FILES = (os.path.join(_TORCH_DIR, "fx") + os.sep, os.path.join(_TORCH_DIR, "nn", "modules", "module.py"),
                 os.path.join(_TORCH_DIR, "overrides.py"), os.path.dirname(__file__) + os.sep)


def _stack_trace() -> str:
    """The user's frames from the outermost ``forward`` to the operation being traced, in
    ``traceback``'s format (what torch.fx's ``record_stack_traces`` writes, without its first
    call's seconds of imports and symbolization)."""
    frames = [f for f, _ in traceback.walk_stack(sys._getframe(2))][::-1]
    first = next((i for i, f in enumerate(frames) if f.f_code.co_name == "forward"), None)
    if first is None:
        return ""
    kept = [(f, f.f_lineno) for f in frames[first:] if not f.f_code.co_filename.startswith(_TRACER_FILES)]
    return "".join(traceback.StackSummary.extract(kept).format()).strip()


class _ScopeTracer(torch.fx.Tracer):
    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if not node.stack_trace:
            node.stack_trace = _stack_trace()
        site = _checkpoint_site()
        node.meta["piper_scopes"] = current_scopes()
        node.meta["piper_run"] = current_run()
        node.meta["piper_checkpoint"] = site
        node.meta["piper_context"] = current_context(in_checkpoint=site is not None)
        return node

    def call_module(self, m, forward, args, kwargs):
        module_entered(m)  # fx runs no hooks of a leaf module: the regions' switch is told here
        return super().call_module(m, forward, args, kwargs)

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        # An expert module (``piper_experts = True``) stays one call, so the expert-parallel
        # rewrite (piper_directives.expert_code) can route tokens around it.
        return bool(getattr(m, "piper_experts", False)) or super().is_leaf_module(m, module_qualified_name)


def module_regions(model: nn.Module, regions: RegionSpec | ModuleRegions | None) -> ModuleRegions | None:
    """``regions`` as ``ModuleRegions`` of ``model`` (a spec parsed; a bad one is a ``CaptureError``)."""
    if regions is None or isinstance(regions, ModuleRegions):
        return regions
    try:
        return ModuleRegions.parse(model, regions)
    except ValueError as err:
        raise CaptureError(str(err)) from err


def traced(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    regions: ModuleRegions | None,
    method: str,
    compute: torch.dtype | None = None,
) -> tuple[torch.fx.GraphModule, str, ModuleRegions | None]:
    """The traced graph, the method that traced it, and the module-path regions used: those
    given, or for a model that enters no ``annotate`` region the default ones."""
    if regions is None and not _enters_regions(model, inputs):
        regions = ModuleRegions.default(model)
        if regions is None:
            raise CaptureError(
                f"{type(model).__name__} has no region: wrap parts of its forward in annotate(...), or name them by "
                "module path (regions='embed | layers.* | head'); it has no ModuleList for a default of one region "
                "per layer"
            )
        gm, used, _ = _traced_with(model, inputs, regions, method, compute)
        return gm, used, regions
    gm, used, own = _traced_with(model, inputs, regions, method, compute)
    if regions is not None and own:
        raise CaptureError(
            f"regions were given by module path ({regions.spec!r}) and {type(model).__name__}.forward also "
            f"calls annotate(...) at {own[0]}: name the regions one way only"
        )
    return gm, used, regions


def _enters_regions(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``forward`` enters an ``annotate`` region, seen on one eager run of a one-sample
    batch (cheaper than a trace that would have to be redone with the default regions)."""
    crossed = 0

    def boundary() -> None:
        nonlocal crossed
        crossed += 1

    try:
        with torch.no_grad(), on_boundaries(boundary), restored_buffers(model):
            model(*(t[:1] for t in inputs))
    except Exception:
        return True
    return crossed > 0


def _traced_with(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    regions: ModuleRegions | None,
    method: str,
    compute: torch.dtype | None = None,
) -> tuple[torch.fx.GraphModule, str, list[str]]:
    """Trace once (``method``); with ``regions`` installed. Also returns the sources of the
    ``annotate`` regions the model entered itself. torch.export writes the dtypes it sees into
    the code (``x.to(input_dtype)``), so under a precision it traces a copy of the model and
    batch in the ``compute`` dtype and the code then reads the model's own tensors, which
    ``cast_forward`` casts to that dtype when it runs, as for fx's dtype-free code."""

    def installed(target: nn.Module) -> contextlib.AbstractContextManager:
        return regions.installed(target) if regions is not None else contextlib.nullcontext()

    fx_error: CaptureError | None = None
    if method in ("auto", "fx"):
        with installed(model) as switch:
            try:
                gm = _trace(model, switch)
                return gm, "fx", _own_regions(gm, switch)
            except CaptureError as err:
                if method == "fx" or err.__cause__ is None:  # refused by Piper itself, not by fx
                    raise
                fx_error = err
    target = model if compute is None else _compute_copy(model, compute)
    target_inputs = inputs if compute is None else cast_inputs(inputs, compute)
    with installed(target) as switch:
        try:
            gm = exported_graph(target, target_inputs)
            with restored_buffers(target):
                check_other_batch_size(target, gm, target_inputs)
        except CaptureError:
            raise
        except BatchDependence as err:  # fx's error names the line; export says why it cannot help
            raise CaptureError(f"{fx_error} {err}" if fx_error is not None else str(err)) from None
        except Exception as err:
            raise _export_error(model, err, fx_error) from err
        own = _own_regions(gm, switch)
    if target is not model:
        _read_tensors_of(gm, model)
    return gm, "export", own


def _own_regions(gm: torch.fx.GraphModule, switch) -> list[str]:
    """Sources of the ``annotate`` regions in ``gm`` that ``switch`` (module-path regions)
    did not make: the model's own."""
    ours = switch.scope_uids if switch is not None else set()
    return sorted({s.source for n in gm.graph.nodes for s in n.meta.get("piper_scopes", ()) if s.uid not in ours})


def _compute_copy(model: nn.Module, compute: torch.dtype) -> nn.Module:
    copy = _copy.deepcopy(model)
    with torch.no_grad():
        for t in (*copy.parameters(), *copy.buffers()):
            if t.is_floating_point():
                t.data = t.data.to(compute)
    return copy


def _read_tensors_of(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Make ``gm`` (traced on a copy of ``model``) hold ``model``'s own parameters and buffers
    under the same names."""
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        path, _, leaf = name.rpartition(".")
        try:
            owner = gm.get_submodule(path)
        except AttributeError:
            continue
        if leaf in owner._parameters:
            owner._parameters[leaf] = tensor
        elif leaf in owner._buffers:
            owner._buffers[leaf] = tensor


def _export_error(model: nn.Module, err: Exception, fx_error: CaptureError | None) -> CaptureError:
    error = trace_error(model, err)
    if fx_error is None:
        return CaptureError(f"torch.export could not capture {type(model).__name__}: {error}")
    return CaptureError(f"{fx_error} torch.export could not capture it either: {error}")



def _trace(model: nn.Module, switch=None) -> torch.fx.GraphModule:
    with tracing(), torch.enable_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if switch is not None:
                switch.begin()  # fx calls forward itself: the model's own hooks do not run
            try:
                with told(switch):
                    traced_graph = _ScopeTracer().trace(model)
            finally:
                if switch is not None:
                    switch.end()
        except CaptureError:
            raise
        except Exception as err:  # torch.fx's own errors: say where, and what to do
            raise trace_error(model, err) from err
    for w in caught:
        if w.filename.endswith(CHECKPOINT_FILE):
            continue  # checkpoint's complaints about traced (input-less) calls: an artefact
        if "autocast" in str(w.message):
            warnings.warn(
                f"{w.filename}:{w.lineno}: {w.message} The captured region runs without autocast, as it "
                "would eagerly on this machine.",
                stacklevel=3,
            )
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    gm = torch.fx.GraphModule(model, traced_graph)
    for node in gm.graph.nodes:
        node.type = None  # annotations like ``x: Tensor`` would not survive pickling
    return gm


class restored_buffers:
    """Snapshot the model's buffers; on exit put the snapshot back (capture runs the model on
    the example batch and must not, say, move BatchNorm's running statistics)."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = dict(model.named_buffers())
        self.saved = {name: b.detach().clone() for name, b in self.buffers.items()}

    def changed(self) -> list[str]:
        return [n for n, b in self.buffers.items() if not torch.equal(b, self.saved[n])]

    def __enter__(self) -> restored_buffers:
        return self

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for name, b in self.buffers.items():
                b.copy_(self.saved[name])
