"""``Split``: divide the batch into microbatches (the first phase of ``Strategy.apply``).

Requires a captured graph (``microbatches == 1``). Guarantees: every F/B node is copied per
microbatch (ids ``<id>.mb<i>``), edges are copied per microbatch, each ``OPT`` node waits for
the backward of every microbatch, and value metas are divided along their batch dimension.
The runtime scales each microbatch's loss by ``1/microbatches`` exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import repeat
from operator import attrgetter
from typing import ClassVar, TypeVar

import attrs

from piper_directives.common import JsonObject, user_location
from piper_ir import DirectiveError, Edge, Graph, Node, NodeKind, Value, microbatch_id, slot_maker

T = TypeVar("T")


def copier(cls: type[T], *changed: str) -> Callable[..., T]:
    """``copy(obj, *values)``: what ``attrs.evolve(obj, **dict(zip(changed, values)))`` returns
    for an instance of the attrs class ``cls``, for passes that copy every node or edge.

    ``attrs.evolve`` looks the class's fields up and passes every field by keyword, for each
    copy; this looks them up once and passes them by position (0.9 us a ``Node`` against 3.2
    us, 0.8 us an ``Edge`` against 1.9 us; ``Place`` copies every node: 131k at 16,384
    devices; ``Split``'s copies per microbatch go through ``copies``), to a constructor that
    sets the class's slots (``_maker``). The converters of the changed fields still run (the
    others' values come from ``obj``, converted already), so the copy equals what
    ``attrs.evolve`` makes."""
    names, make, convert = _maker(cls, changed)
    values_of = attrgetter(*names) if len(names) > 1 else (lambda obj: (getattr(obj, names[0]),))
    slots = [names.index(name) for name in changed]

    def copy(obj: T, *values: object) -> T:
        args = list(values_of(obj))
        for k, v in zip(slots, values, strict=True):
            args[k] = convert[k](v) if k in convert else v
        return make(*args)

    if len(slots) != 1:
        return copy
    (k,) = slots
    conv = convert.get(k)

    def copy_one(obj: T, value: object) -> T:  # one field changed (``Place``: a node's devices)
        args = list(values_of(obj))
        args[k] = value if conv is None else conv(value)
        return make(*args)

    return copy_one


def copies(cls: type[T], first: str, second: str) -> Callable[[T, Iterable[tuple[object, object]]], list[T]]:
    """``copies(obj, pairs)``: ``[copier(cls, first, second)(obj, a, b) for a, b in pairs]``,
    reading ``obj``'s fields once for all its copies (``Split`` makes one per microbatch: 512
    of every node and edge at 16,384 devices, and reading the fields again for each was a
    third of a copy). ``first`` and ``second`` must be fields without a converter."""
    names, make, convert = _maker(cls, (first, second))
    if convert:
        raise TypeError(f"copies: {cls.__name__}.{first} or .{second} has a converter")
    values_of = attrgetter(*names)
    i, j = names.index(first), names.index(second)

    def copy_all(obj: T, pairs: Iterable[tuple[object, object]]) -> list[T]:
        args = list(values_of(obj))
        out = []
        for args[i], args[j] in pairs:
            out.append(make(*args))
        return out

    return copy_all


def _maker(cls: type[T], changed: Iterable[str]) -> tuple[list[str], Callable[..., T], dict[int, Callable]]:
    """``cls``'s field names, a positional constructor (``piper_ir.slot_maker``, which runs no
    converter, where ``cls`` allows it; else ``cls`` itself) and, for the ``changed`` fields,
    position -> the converter to run on a new value before that constructor."""
    fields = attrs.fields(cls)  # type: ignore[arg-type]
    if any(not a.init or a.kw_only or a.alias != a.name for a in fields):
        raise TypeError(f"copier: {cls.__name__} has a field __init__ does not take by position under its name")
    names = [a.name for a in fields]
    convert = {names.index(name): fields[names.index(name)].converter for name in changed}
    convert = {k: c for k, c in convert.items() if c is not None}
    try:
        if any(isinstance(c, attrs.Converter) for c in convert.values()):
            raise TypeError("a converter that takes the instance or the field")
        return names, slot_maker(cls), convert  # type: ignore[return-value]
    except TypeError:
        return names, cls, {}  # its __init__ converts and checks


@attrs.frozen
class Split:
    op: ClassVar[str] = "split"

    microbatches: int
    where: str = attrs.field(factory=user_location, eq=False)

    def __str__(self) -> str:
        return f"Split(microbatches={self.microbatches}) at {self.where}"

    def to_json(self) -> JsonObject:
        return {"op": self.op, "microbatches": self.microbatches}

    @classmethod
    def from_json(cls, item: JsonObject, where: str) -> Split:
        return cls(**item, where=where)

    def apply(self, graph: Graph) -> Graph:
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise DirectiveError(f"microbatches must be a positive int, got {m!r}", directive=str(self))
        if graph.microbatches != 1:
            raise DirectiveError(f"the graph is already split into {graph.microbatches} microbatches", directive=str(self))
        if any(n.kind not in (NodeKind.COMPUTE, NodeKind.OPTIMIZER) for n in graph.nodes):
            raise DirectiveError("Split must come before Place (the graph already has communication)", directive=str(self))
        values = []
        for v in graph.values:
            meta = v.meta
            if meta.batch_dim is not None and meta.shape[meta.batch_dim] % m:
                raise DirectiveError(
                    f"value {v.name} has {meta.shape[meta.batch_dim]} samples along its batch dimension, "
                    f"not divisible into {m} microbatches",
                    directive=str(self),
                )
            values.append(Value(v.name, meta.split(m)))
        # Each compute node's copies' ids, made once: the edges name the very same strings,
        # which the passes after look up in tables keyed by node id.
        per_mb = {n.id: [microbatch_id(n.id, i) for i in range(m)] for n in graph.nodes if n.kind is NodeKind.COMPUTE}
        nodes_of_mb, edges_between = copies(Node, "id", "microbatch"), copies(Edge, "src", "dst")
        nodes: list[Node] = []
        for n in graph.nodes:
            if n.id in per_mb:
                nodes.extend(nodes_of_mb(n, zip(per_mb[n.id], range(m), strict=True)))
            else:
                nodes.append(n)
        edges: list[Edge] = []
        for e in graph.edges:
            src_ids, dst_ids = per_mb.get(e.src), per_mb.get(e.dst)
            if src_ids is None and dst_ids is None:
                edges.extend(edges_between(e, ((e.src, e.dst),)))
            else:
                edges.extend(edges_between(e, zip(src_ids or repeat(e.src, m), dst_ids or repeat(e.dst, m), strict=True)))
        return attrs.evolve(graph, values=tuple(values), nodes=tuple(nodes), edges=tuple(edges), microbatches=m)
