"""Regions named by module path: a model Piper can place and order without editing it.

``ModuleRegions.parse(model, spec)`` reads a spec such as
``"model.embed_tokens | model.layers.* | model.norm, lm_head"``: regions are separated by
``|``, the module paths of one region by ``,``; ``*`` matches one path component. A region
written as a single pattern with a wildcard becomes one region per module it matches (in the
model's order): ``model.layers.*`` is one region per layer. Several patterns in one region put
everything they match in that one region. A spec may also be a sequence of such regions.

``ModuleRegions.default(model)`` is the rule for a model with no annotation and no spec: one
region per entry of its largest ``ModuleList`` (the first one found when several are as large).

While installed (``ModuleRegions.install``), each region is an ``annotate(tag, index)``
region, entered by forward pre-hooks: the model's forward starts in the first region;
calling a module of another region leaves the current region and enters that one. So what
runs before the first region's modules belongs to the first region, what runs between two
regions to the earlier one, and what runs after the last region's modules to the last.
Because the hooks cross the same ``annotate`` boundaries when the model runs eagerly, single-device
training reseeds its random numbers exactly where each captured segment starts
(piper_directives.randomness), as for a model that calls ``annotate`` itself.
"""

from __future__ import annotations

import fnmatch
import inspect
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import attrs
from torch import nn

from piper_directives.annotate import annotate

RegionSpec = str | Sequence[str]  # "a | b.* | c, d", or one string per region


def _matches(pattern: str, path: str) -> bool:
    parts, names = pattern.split("."), path.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names, strict=True))


_SOURCES: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()


def _source(module: nn.Module) -> str:
    """Where ``module``'s class is defined (``file:line``), once per class: finding a class's
    line parses its whole file, and a model has many modules of a few classes."""
    cls = type(module)
    found = _SOURCES.get(cls)
    if found is None:
        try:
            found = f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
        except (OSError, TypeError):
            found = cls.__name__
        _SOURCES[cls] = found
    return found


def _region_texts(spec: RegionSpec) -> list[str]:
    if isinstance(spec, str):
        texts = spec.split("|")
    elif isinstance(spec, Sequence) and all(isinstance(s, str) for s in spec):
        texts = list(spec)
    else:
        raise ValueError(f"regions must be a string like 'embed | layers.* | head' or a list of such strings, got {spec!r}")
    texts = [t.strip() for t in texts]
    if not texts or any(not t for t in texts):
        raise ValueError(f"regions {spec!r}: every region between '|' must name at least one module path")
    return texts


@attrs.frozen
class ModuleRegions:
    """Regions of a model, each a tuple of module paths (module doc); ``spec`` is what the
    user wrote (or ``"default"``), for messages; ``tag`` the ``annotate`` tag they get."""

    regions: tuple[tuple[str, ...], ...]
    spec: str
    tag: str = "PP"

    @classmethod
    def parse(cls, model: nn.Module, spec: RegionSpec, tag: str = "PP") -> ModuleRegions:
        """The regions ``spec`` names in ``model``; a ``ValueError`` names a pattern that
        matches nothing, and a module that two regions claim (itself or one inside it)."""
        paths = [name for name, _ in model.named_modules() if name]
        regions: list[tuple[str, ...]] = []
        for text in _region_texts(spec):
            patterns = [p.strip() for p in text.split(",")]
            if any(not p for p in patterns):
                raise ValueError(f"regions {spec!r}: empty module path in region {text!r}")
            found: list[list[str]] = []
            for pattern in patterns:
                hits = [p for p in paths if _matches(pattern, p)]
                if not hits:
                    raise ValueError(f"regions: {pattern!r} matches no module of {type(model).__name__}; "
                                     f"{_suggest(model, pattern)}")
                found.append(hits)
            if len(patterns) == 1 and any(c in patterns[0] for c in "*?["):
                regions.extend((hit,) for hit in found[0])
            else:
                regions.append(tuple(h for hits in found for h in hits))
        _refuse_overlap(regions)
        return cls(tuple(regions), spec if isinstance(spec, str) else " | ".join(spec), tag)

    @classmethod
    def default(cls, model: nn.Module, tag: str = "PP") -> ModuleRegions | None:
        """One region per entry of the model's largest ModuleList, or None without one."""
        best: tuple[str, nn.ModuleList] | None = None
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) > 0 and (best is None or len(module) > len(best[1])):
                best = (name, module)
        if best is None:
            return None
        prefix = f"{best[0]}." if best[0] else ""
        regions = tuple((f"{prefix}{i}",) for i in range(len(best[1])))
        return cls(regions, f"{prefix}*", tag)

    def describe(self) -> str:
        """The regions as a spec that ``parse`` reads back (wildcards expanded)."""
        return " | ".join(", ".join(r) for r in self.regions)

    def install(self, model: nn.Module) -> _Switch:
        """Hooks on ``model`` that make each region an ``annotate`` region whenever the model
        runs (module doc), until ``remove()`` on what this returns."""
        switch = _Switch(self, model)
        switch.handles = [model.register_forward_pre_hook(switch.root_pre), model.register_forward_hook(switch.root_post)]
        for index, paths in enumerate(self.regions):
            for path in paths:
                module = model.get_submodule(path)
                switch.region_of[id(module)] = index
                switch.handles.append(module.register_forward_pre_hook(switch.module_pre))
        return switch

    @contextmanager
    def installed(self, model: nn.Module) -> Iterator[_Switch]:
        """``install`` for the block."""
        switch = self.install(model)
        try:
            yield switch
        finally:
            switch.remove()


def _suggest(model: nn.Module, pattern: str) -> str:
    stem = pattern.rsplit(".", 1)[0] if "." in pattern else ""
    try:
        parent = model.get_submodule(stem) if stem else model
        names = [f"{stem}.{n}" if stem else n for n, _ in parent.named_children()]
    except AttributeError:
        names = [n for n, _ in model.named_children()]
    return "its modules there are: " + (", ".join(names[:12]) + (" ..." if len(names) > 12 else "") if names else "none")


def _refuse_overlap(regions: list[tuple[str, ...]]) -> None:
    owner: dict[str, int] = {}
    for index, paths in enumerate(regions):
        for path in paths:
            for other, k in owner.items():
                if path == other or path.startswith(f"{other}.") or other.startswith(f"{path}."):
                    if k != index or path != other:
                        raise ValueError(f"regions: module {path!r} (region {index}) and {other!r} (region {k}) "
                                         "overlap; a module may belong to one region only")
            owner[path] = index


class _Active(threading.local):
    switch: _Switch | None = None


_active = _Active()


@contextmanager
def told(switch: _Switch | None) -> Iterator[None]:
    """``module_entered`` tells ``switch`` for the block (a torch.fx trace)."""
    _active.switch = switch
    try:
        yield
    finally:
        _active.switch = None


def module_entered(module: nn.Module) -> None:
    """Tell the installed regions (if any) that ``module`` is being called: what a tracer
    that does not run a leaf module's hooks (torch.fx) calls instead."""
    if _active.switch is not None:
        _active.switch.module_pre(module, ())


class _Switch:
    """The state of one installed ``ModuleRegions``: the region the forward is in."""

    def __init__(self, regions: ModuleRegions, model: nn.Module) -> None:
        self.regions = regions
        self.region_of: dict[int, int] = {}
        self.current: tuple[int, annotate] | None = None
        self.scope_uids: set[int] = set()  # the captured scopes these regions made (not the model's own)
        self.sources = [_source(model.get_submodule(paths[0])) for paths in regions.regions]
        self.handles: list[object] = []

    def remove(self) -> None:
        """Leave the current region and take the hooks off the model."""
        self.end()
        for handle in self.handles:
            handle.remove()  # type: ignore[attr-defined]
        self.handles = []

    def begin(self) -> None:
        """Enter the first region (the forward starts there); no-op if already begun."""
        if self.current is None:
            self._enter(0)

    def end(self) -> None:
        if self.current is not None:
            self.current[1].__exit__(None, None, None)
            self.current = None

    def _enter(self, index: int) -> None:
        region = annotate(self.regions.tag, index, source=self.sources[index])
        region.__enter__()
        self.current = (index, region)
        if region._scope is not None:
            self.scope_uids.add(region._scope.uid)

    def root_pre(self, module: nn.Module, args: object) -> None:
        self.end()  # left open by a forward that raised
        self.begin()

    def root_post(self, module: nn.Module, args: object, output: object) -> None:
        self.end()

    def module_pre(self, module: nn.Module, args: object) -> None:
        index = self.region_of.get(id(module))
        if index is None or (self.current is not None and self.current[0] == index):
            return
        self.end()
        self._enter(index)
