"""Fixtures shared by the integration tests (the Ray cluster fixture is in the root conftest).

Runtimes: the integration tests run on the ``local`` runtime (every rank a thread of this
process: no worker processes to start), which computes what the ``ray`` runtime computes,
bit for bit (``test_runtimes.py`` holds the two equal on every schedule and parallelism).
Tests of what only Ray does (actors killed, placement groups, worker pools, several nodes)
are marked ``ray`` and run on it. ``PIPER_RUNTIME=ray ./dev test`` puts the others on Ray too.

The export memo (``export_memo``: one for the session, which the autouse ``memoised_export``
installs for each integration test only, not for the package tests of a ``nox -s all`` run):
capture through ``torch.export`` (piper_directives.exporting.exported_graph) costs about 2 s a
model, and the tests build a fresh model for every run of the same structure. The memo
exports each (model structure, example inputs) once per pytest process; a later capture of an
equal structure gets a copy of that graph (its own graph, node meta dicts, sub-graphs,
constants and attributes) that reads the new model's own parameters and buffers, and its
module-path regions record the scopes the trace would have (``_Switch.scope_uids``). The key
is conservative: every submodule's path, class (for a class torch does not define, also the
code, defaults, closures and named globals of its functions and a hash of their source files),
``training`` and plain attributes (plain values; classes the code names by module, name and
file hash; configs and other objects with a ``__repr__`` by repr; anything else by identity,
held so the id stays unique); tensor
attributes by content; parameters and buffers by name, shape, stride, dtype, device,
``requires_grad`` and ties (``remove_duplicate=False``); the regions' hooks (any other hook:
not memoised); each input's type, shape, stride and dtype; the default dtype, autocast and
inference mode. Errors (``BatchDependence``, export's own) are raised and never stored. Every
copy's ``val``s share the first export's symbolic shapes: an entry whose shapes have since
learnt a guard or a replacement is exported again. What the key cannot see: code ``forward``
reaches other than through those (an attribute of a module it imports, or a function two
calls down, monkeypatched between two captures: no test does). ``test_export_memo.py`` holds
a hit equal to a fresh export; the session's summary says how many captures hit;
``PIPER_EXPORT_MEMO=0`` turns the memo off.
"""

from __future__ import annotations

import copy
import enum
import functools
import hashlib
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator

import attrs
import pytest
import ray
import torch
import torch.fx
from torch import nn

from piper_train.cli import main

_CHOSEN = os.environ.get("PIPER_RUNTIME")  # what the whole run asked for, if anything


@pytest.fixture(autouse=True)
def runtime(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The runtime this test's runs start by default (``PIPER_RUNTIME``; module doc)."""
    name = "ray" if request.node.get_closest_marker("ray") else _CHOSEN or "local"
    monkeypatch.setenv("PIPER_RUNTIME", name)
    yield name


@attrs.frozen
class Done:
    """What a run of the ``piper`` command gave: its exit code and its output."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def piper(capsys: pytest.CaptureFixture[str], ray_cluster: None) -> Callable[..., Done]:
    """``piper ARGS`` in this process: ``main``'s return value (argparse's exit code for a
    usage error) and what it printed. ``main`` must raise nothing else, print no traceback
    and leave the session's Ray running (``ray_cluster`` starts it first: a command that
    started Ray itself would give it too few CPUs for the tests after it)."""

    def run(*args: str) -> Done:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse: usage errors
            code = exit_.code
        assert ray.is_initialized(), "the command shut down the session's Ray"
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return Done(code, out, err)

    return run


def router_counts(workload) -> list[list[int]]:  # a piper_train ModelSpec
    """Tokens per expert in every MoE layer of the built-in MoE model on the first batch
    (top-2: 2 per token)."""
    counts: list[list[int]] = []
    hooks = [
        block["moe"].experts.register_forward_hook(
            lambda mod, args, out: counts.append(torch.bincount(args[1], minlength=mod.num_experts).tolist())
        )
        for block in workload.model.blocks
    ]
    try:
        with torch.no_grad():
            workload.model(*workload.example_inputs)
    finally:
        for h in hooks:
            h.remove()
    return counts


def _assert_uneven(workload) -> None:
    for layer in router_counts(workload):
        assert len(set(layer)) > 1, f"routing is even: {layer}"
        # Per destination rank of an EP=2 group (experts 0-1 on one rank, 2-3 on the other).
        assert layer[0] + layer[1] != layer[2] + layer[3], layer


@pytest.fixture
def assert_uneven() -> Callable[..., None]:
    """Asserts that the router sends different token counts to each expert and to each rank
    of an EP=2 group, so the all-to-alls are genuinely uneven."""
    return _assert_uneven


# --- The export memo (module doc) ------------------------------------------------------------

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_MODULE_STATE = {  # nn.Module's own bookkeeping: keyed through the parameters, buffers and hooks
    "training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
    "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
}
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


class _Uncacheable(Exception):
    """The model holds something the memo cannot key: it is exported afresh every time."""


class _Key:
    """Builds one model's memo key (``ExportMemo``): a nested tuple of plain values."""

    def __init__(self, files: dict[tuple[str, int, int], str]) -> None:
        self.files = files  # (path, mtime_ns, size) -> content hash, shared across keys
        self.keep: list[object] = []  # objects keyed by identity: held so no id is reused
        self.switches: list[object] = []  # the module-path regions' switches installed on the model
        self.classes: dict[type, tuple] = {}

    def source(self, path: str) -> object:
        try:
            stat = os.stat(path)
        except OSError:
            return ("no file", path)
        found = self.files.get((path, stat.st_mtime_ns, stat.st_size))
        if found is None:
            with open(path, "rb") as f:
                found = hashlib.sha256(f.read()).hexdigest()
            self.files[(path, stat.st_mtime_ns, stat.st_size)] = found
        return (path, found)

    def code(self, code: types.CodeType) -> tuple:
        consts = tuple(self.code(c) if isinstance(c, types.CodeType) else self.value(c, 0) for c in code.co_consts)
        return (code.co_filename, code.co_name, code.co_code, code.co_names, code.co_varnames, code.co_freevars,
                consts, self.source(code.co_filename))

    def function(self, fn: types.FunctionType, depth: int) -> tuple:
        """Its code, defaults, closure and (at depth 0) the globals it names."""
        key: tuple = ("fn", fn.__module__, fn.__qualname__, self.code(fn.__code__),
                      self.value(fn.__defaults__, depth + 1), self.value(fn.__kwdefaults__, depth + 1),
                      tuple(self.value(c.cell_contents, depth + 1) for c in fn.__closure__ or ()))
        if depth == 0:
            names = _names(fn.__code__)
            key += (tuple((n, self.value(fn.__globals__[n], depth + 1)) for n in sorted(names)
                          if n in fn.__globals__),)
        return key

    def named(self, cls: type) -> tuple:
        """A class the model's code names (not one of its modules' classes): by name and its
        file; one defined inside a function by identity (its closures could differ)."""
        if "<locals>" in cls.__qualname__:
            return self.identity(cls)
        module = sys.modules.get(cls.__module__)
        path = getattr(module, "__file__", None)
        return ("class", cls.__module__, cls.__qualname__, self.source(path) if path else None)

    def cls(self, cls: type) -> tuple:
        """A class of the model's modules (or a base of one): by name where torch defines it,
        else also by its functions (code, defaults, closures, the globals they name)."""
        if cls.__module__.split(".")[0] in ("torch", "builtins"):
            return ("class", cls.__module__, cls.__qualname__)
        if cls in self.classes:  # known, or being keyed (``super()``'s cell names the class)
            return self.classes[cls]
        self.classes[cls] = ("class being keyed", cls.__module__, cls.__qualname__)
        functions = []
        for name, attr in sorted(vars(cls).items()):
            attr = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if isinstance(attr, types.FunctionType):
                functions.append((name, self.function(attr, 0)))
            elif name not in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__",
                              "__firstlineno__", "__static_attributes__", "__annotations__", "_is_protocol"):
                functions.append((name, self.value(attr, 1)))
        self.classes[cls] = ("class", cls.__module__, cls.__qualname__, tuple(functions),
                             tuple(self.cls(base) for base in cls.__bases__ if base is not object))
        return self.classes[cls]

    def value(self, obj: object, depth: int) -> object:
        if isinstance(obj, _PLAIN) or obj is Ellipsis:
            return (type(obj).__name__, repr(obj) if isinstance(obj, float | complex) else obj)
        if depth > 4:
            return self.identity(obj)
        if isinstance(obj, enum.Enum):
            return ("enum", self.named(type(obj)), obj.name)
        if isinstance(obj, tuple | list | set | frozenset):
            items = [self.value(x, depth + 1) for x in obj]
            return (type(obj).__name__, tuple(sorted(items, key=repr) if isinstance(obj, set | frozenset) else items))
        if isinstance(obj, dict):
            return ("dict", tuple((self.value(k, depth + 1), self.value(v, depth + 1)) for k, v in obj.items()))
        if isinstance(obj, types.ModuleType):
            return ("module", obj.__name__)
        if isinstance(obj, type):
            return self.named(obj)
        if isinstance(obj, types.FunctionType):
            return self.function(obj, depth)
        if isinstance(obj, types.BuiltinFunctionType | types.BuiltinMethodType | types.WrapperDescriptorType
                      | types.MethodDescriptorType | torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return self.identity(obj)  # defined once per process
        if isinstance(obj, functools.partial):
            return ("partial", self.value(obj.func, depth + 1), self.value(obj.args, depth + 1),
                    self.value(obj.keywords, depth + 1))
        if isinstance(obj, torch.Tensor):
            raise _Uncacheable("a tensor the model's code names, not a module attribute")
        if isinstance(obj, nn.Module):  # held, not registered (a kernel wrapper): one without tensors
            if any(True for _ in obj.parameters()) or any(True for _ in obj.buffers()):
                raise _Uncacheable(f"a {type(obj).__name__} with tensors held as a plain attribute")
            return ("module object", self.cls(type(obj)), obj.training, self.hooks(obj),
                    tuple((a, self.value(v, depth + 1)) for a, v in sorted(vars(obj).items())
                          if a not in _MODULE_STATE),
                    tuple((n, self.value(m, depth + 1)) for n, m in obj._modules.items()))
        if type(obj).__repr__ is not object.__repr__ and not isinstance(obj, types.MethodType | nn.Module):
            return ("repr", self.named(type(obj)), repr(obj))  # configs: dataclasses, attrs, HF configs
        return self.identity(obj)

    def identity(self, obj: object) -> tuple:
        self.keep.append(obj)
        return ("id", type(obj).__qualname__, id(obj))

    def hooks(self, module: nn.Module) -> tuple:
        """Only the module-path regions' hooks are keyed (by their regions): any other hook
        could do anything while export traces, so the model is not memoised."""
        from piper_directives.regions import _Switch

        found = []
        for kind in _HOOKS:
            for hook in getattr(module, kind).values():
                owner = getattr(hook, "__self__", None)
                if not isinstance(owner, _Switch):
                    raise _Uncacheable(f"a {kind} hook that is not a module-path region's")
                if owner not in self.switches:
                    self.switches.append(owner)
                found.append((kind, hook.__name__, self.switches.index(owner), owner.region_of.get(id(module))))
        return tuple(found)

    def model(self, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[tuple, dict[str, torch.Tensor]]:
        """The key, and the model's tensors by path (what a hit re-binds)."""
        from torch.nn.modules import module as torch_module

        if any(getattr(torch_module, name) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                         "_global_backward_hooks", "_global_backward_pre_hooks")):
            raise _Uncacheable("a global module hook")
        tensors: dict[str, torch.Tensor] = {}
        first: dict[int, str] = {}

        def tensor(path: str, t: torch.Tensor, persistent: bool | None = None) -> tuple:
            tensors[path] = t
            alias = first.setdefault(id(t), path)  # a tie: the path it shares a tensor with
            return (path, type(t).__qualname__, tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad,
                    persistent, alias)

        modules = []
        for name, module in model.named_modules(remove_duplicate=False):
            prefix = f"{name}." if name else ""
            attrs_ = []
            for attr, value in sorted(vars(module).items()):
                if attr in _MODULE_STATE:
                    continue
                if isinstance(value, torch.Tensor):  # a plain tensor attribute: export makes it a constant
                    data = value.detach().cpu().contiguous()
                    digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
                    attrs_.append((attr, tensor(prefix + attr, value), digest))
                else:
                    attrs_.append((attr, self.value(value, 1)))
            modules.append((
                name, self.cls(type(module)), module.training, tuple(attrs_), self.hooks(module),
                tuple(tensor(prefix + n, p) for n, p in module._parameters.items() if p is not None),
                tuple(tensor(prefix + n, b, n not in module._non_persistent_buffers_set)
                      for n, b in module._buffers.items() if b is not None),
                tuple(module._parameters), tuple(module._buffers)))
        from piper_directives.annotate import _state

        if _state.active:
            raise _Uncacheable("a capture is already tracing on this thread (export raises)")
        ambient = (torch.get_default_dtype(), torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"),
                   torch.is_inference_mode_enabled())
        regions = tuple((self.value(s.regions, 1), tuple(s.sources)) for s in self.switches)
        shapes = tuple((type(t).__qualname__, tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
                       for t in inputs)
        return (tuple(modules), shapes, ambient, regions), tensors


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


@attrs.frozen
class _Entry:
    graph: torch.fx.GraphModule  # a copy nobody else holds, reading the first model's tensors
    tensors: dict[str, torch.Tensor]  # the first model's tensors by path
    uids: tuple[frozenset[int], ...]  # scopes each installed regions' switch made (in key order)
    keep: tuple[object, ...]  # what the key names by identity
    shapes: object  # ``_shape_state`` when stored


def _shape_state(gm: torch.fx.GraphModule) -> object:
    """The state of the symbolic-shape environments the graph's ``val``s belong to (shared by
    every copy): a graph whose environment later learnt a guard or a replacement would no
    longer be the one a fresh export gives, so it is not handed out again."""
    envs = {id(env): env for env in [getattr(gm, "shape_env", None)] + [
        getattr(getattr(n.meta.get("val"), "fake_mode", None), "shape_env", None) for n in gm.graph.nodes]
        if env is not None}
    return tuple((len(e.guards), len(e.axioms), len(e.replacements), len(e.divisible), e.num_deferred_runtime_asserts,
                  sorted((str(k), str(v)) for k, v in e.var_to_range.items())) for e in envs.values())


class ExportMemo:
    """``exported_graph`` once per (model structure, example inputs) in this pytest process
    (module doc). ``original`` is the unmemoised function; ``hits``/``misses``/``uncached``
    count the calls."""

    def __init__(self, original: Callable[..., torch.fx.GraphModule]) -> None:
        self.original = original
        self.entries: dict[tuple, _Entry] = {}
        self.files: dict[tuple[str, int, int], str] = {}
        self.lock = threading.Lock()
        self.hits = self.misses = self.uncached = self.stale = 0
        self.why: set[str] = set()  # why models were not memoised

    def key(self, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple:
        """What ``model`` and ``inputs`` are stored under (raises ``_Uncacheable``)."""
        return _Key(self.files).model(model, inputs)[0]

    def __call__(self, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.fx.GraphModule:
        key_maker = _Key(self.files)
        try:
            key, tensors = key_maker.model(model, inputs)
        except _Uncacheable as why:
            self.uncached += 1
            self.why.add(str(why))
            return self.original(model, inputs)
        with self.lock:
            entry = self.entries.get(key)
        if entry is not None and _shape_state(entry.graph) != entry.shapes:
            self.stale += 1  # exported afresh (below), and stored anew
            entry = None
        if entry is not None:
            self.hits += 1
            for switch, uids in zip(key_maker.switches, entry.uids, strict=True):
                switch.scope_uids |= uids  # what the trace's regions would have recorded
            return _copy_graph(entry.graph, {id(entry.tensors[p]): t for p, t in tensors.items()})
        before = [set(s.scope_uids) for s in key_maker.switches]
        gm = self.original(model, inputs)  # errors are raised, never cached
        self.misses += 1
        uids = tuple(frozenset(s.scope_uids - b) for s, b in zip(key_maker.switches, before, strict=True))
        stored = _copy_graph(gm, {id(t): t for t in tensors.values()})
        with self.lock:
            self.entries[key] = _Entry(stored, tensors, uids, tuple(key_maker.keep), _shape_state(stored))
        return gm


def _copy_graph(gm: torch.fx.GraphModule, tensors: dict[int, torch.Tensor]) -> torch.fx.GraphModule:
    """A copy of ``gm`` as export made it (its own graph, node meta dicts, sub-graphs, constants
    and attributes) whose model tensors are ``tensors`` (old id -> tensor). Not
    ``copy.deepcopy(gm)``: that rebuilds a GraphModule through ``__init__``, which turns
    constants into buffers; export's tree specs are shared (immutable)."""
    memo: dict[int, object] = dict(tensors)
    for name in ("_in_spec", "_out_spec"):
        spec = getattr(gm, name, None)
        if spec is not None:
            memo[id(spec)] = spec
    subs = [m for _, m in gm.named_modules(remove_duplicate=False) if isinstance(m, torch.fx.GraphModule)]
    for sub in reversed(subs):  # the deepest first, the root last
        if id(sub) not in memo:
            memo[id(sub)] = _copy_one(sub, memo)
    return memo[id(gm)]  # type: ignore[return-value]


def _copy_one(gm: torch.fx.GraphModule, memo: dict[int, object]) -> torch.fx.GraphModule:
    copied = type(gm).__new__(type(gm))  # GraphModule.__new__: a class of its own for its forward
    memo[id(gm)] = copied
    graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
    output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    assert isinstance(output, tuple)
    graph.output(output[0], type_expr=getattr(output[1], "type", None)).meta = copy.copy(output[1].meta)
    graph._codegen = copy.copy(gm.graph._codegen)
    memo[id(gm.graph)] = graph
    copied.__dict__.update(copy.deepcopy(gm.__dict__, memo))
    copied.graph = graph  # owned by the copy, recompiled
    return copied


@pytest.fixture(scope="session")
def export_memo() -> ExportMemo:
    """The session's export memo (module doc)."""
    from piper_directives import tracers

    memo = ExportMemo(tracers.exported_graph)
    _MEMOS.append(memo)
    return memo


@pytest.fixture(autouse=True)
def memoised_export(export_memo: ExportMemo, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture calls the memo, in the integration tests only (``PIPER_EXPORT_MEMO=0``: not)."""
    from piper_directives import tracers

    if os.environ.get("PIPER_EXPORT_MEMO", "1") != "0":
        monkeypatch.setattr(tracers, "exported_graph", export_memo)


_MEMOS: list[ExportMemo] = []  # the session's, for the summary


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for memo in _MEMOS if os.environ.get("PIPER_EXPORT_MEMO", "1") != "0" else ():
        terminalreporter.write_line(f"export memo: {memo.hits} hits, {memo.misses} exports stored ({memo.stale} "
                                    f"again: their shapes had changed), {memo.uncached} models not memoised"
                                    + "".join(f"; {w}" for w in sorted(memo.why)))
