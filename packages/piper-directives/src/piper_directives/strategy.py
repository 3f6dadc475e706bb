"""A strategy: a list of directives applied to a captured graph in a fixed phase order.

Phases: ``Split`` first, then every ``Place``, then every ``Shard`` (marking tensor-parallel
groups), then every ``Replicate`` (recording how replicated groups stay in sync and sharding
the batch among replicas), after which
communication is inserted, then the backward split that the ``Order`` directives ask for (``split_backward``: a chunk named
with ``PASS: "BI"``/``"BW"`` gets its ``B`` split), then every ``Order`` in the order written.
A strategy is plain data: ``Strategy.from_json`` reads the same program from JSON
(``docs/strategies.md``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from piper_directives.order import Order, apply_orders
from piper_directives.place import Place, place_all
from piper_directives.replicate import Replicate
from piper_directives.shard import Shard
from piper_directives.split import Split
from piper_directives.split_backward import requested_splits, split_backward
from piper_ir import DirectiveError, Filter, Graph, validate

Directive = Split | Place | Replicate | Shard | Order


@attrs.frozen
class Strategy:
    directives: tuple[Directive, ...] = attrs.field(converter=tuple)

    def apply(self, graph: Graph) -> Graph:
        for d in self.directives:
            if not isinstance(d, Split | Place | Replicate | Shard | Order):
                raise DirectiveError(f"{d!r} is not a directive (Split, Place, Replicate, Shard or Order)")
        splits = [d for d in self.directives if isinstance(d, Split)]
        places = [d for d in self.directives if isinstance(d, Place)]
        orders = [d for d in self.directives if isinstance(d, Order)]
        replicates = [d for d in self.directives if isinstance(d, Replicate)]
        shards = [d for d in self.directives if isinstance(d, Shard)]
        if len(splits) > 1:
            raise DirectiveError("a strategy may split the batch once", directive=str(splits[1]))
        if not places:
            raise DirectiveError("a strategy needs at least one Place directive")
        for split in splits:
            graph = split.apply(graph)
        graph = place_all(graph, places, replicates, shards)
        graph = split_backward(graph, requested_splits(graph, orders))
        graph = apply_orders(graph, orders)
        return validate(graph)

    def to_json(self) -> str:
        return json.dumps({"directives": [_encode(d) for d in self.directives]}, indent=1)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<json>") -> Strategy:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise DirectiveError(f"{source}: not valid JSON: {err}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("directives"), list):
            raise DirectiveError(f'{source}: expected an object {{"directives": [...]}}')
        return cls(_decode(item, f"{source}#{i}") for i, item in enumerate(doc["directives"]))


def _encode(d: Directive) -> dict[str, Any]:
    if isinstance(d, Split):
        return {"op": "split", "microbatches": d.microbatches}
    if isinstance(d, Place):
        return {"op": "place", "filter": d.filter.as_dict(), "devices": list(d.devices), "stream": d.stream}
    if isinstance(d, Replicate):
        return {"op": "replicate", "filter": d.filter.as_dict(), "devices": list(d.devices), "zero": d.zero,
                "bucket_mb": d.bucket_mb, "reduce_stream": d.reduce_stream, "gather_stream": d.gather_stream}
    if isinstance(d, Shard):
        out = {"op": "shard", "filter": d.filter.as_dict(), "devices": list(d.devices), "kind": d.kind}
        return out if d.degree == len(d.devices) else {**out, "degree": d.degree}
    return {"op": "order", "name": d.name, "slots": [[f.as_dict() for f in slot] for slot in d.slots]}


_FIELDS = {
    "split": {"microbatches"},
    "place": {"filter", "devices", "stream"},
    "replicate": {"filter", "devices", "zero", "bucket_mb", "reduce_stream", "gather_stream"},
    "shard": {"filter", "devices", "kind", "degree"},
    "order": {"slots", "name"},
}
_REQUIRED = {"split": {"microbatches"}, "place": {"filter", "devices"}, "replicate": {"filter", "devices"},
             "shard": {"filter", "devices"}, "order": {"slots"}}


def _decode(item: object, where: str) -> Directive:
    if not isinstance(item, dict) or "op" not in item:
        raise DirectiveError(f'{where}: a directive is an object with an "op" field, got {item!r}')
    op = item["op"]
    if op not in _FIELDS:
        raise DirectiveError(f"{where}: unknown op {op!r}; expected one of {sorted(_FIELDS)}")
    fields = set(item) - {"op"}
    if unknown := fields - _FIELDS[op]:
        raise DirectiveError(f"{where}: {op} has no field(s) {sorted(unknown)}")
    if missing := _REQUIRED[op] - fields:
        raise DirectiveError(f"{where}: {op} needs field(s) {sorted(missing)}")
    try:
        if op == "split":
            return Split(item["microbatches"], where=where)
        if op == "place":
            return Place(_filter(item["filter"], where), _devices(item["devices"], where), item.get("stream", "pp"), where=where)
        if op == "replicate":
            return Replicate(
                _filter(item["filter"], where),
                _devices(item["devices"], where),
                item.get("zero", 0),
                item.get("bucket_mb", 25.0),
                item.get("reduce_stream", "dp"),
                item.get("gather_stream", "dp"),
                where=where,
            )
        if op == "shard":
            devices = _devices(item["devices"], where)
            return Shard(_filter(item["filter"], where), devices, item.get("kind", "tp"),
                         item.get("degree", len(devices)), where=where)
        slots = item["slots"]
        if not isinstance(slots, list) or not slots:
            raise DirectiveError(f"{where}: slots must be a non-empty list")
        parsed = [[_filter(f, where) for f in (s if isinstance(s, list) else [s])] for s in slots]
        return Order(parsed, name=item.get("name", "Order"), where=where)
    except (TypeError, ValueError) as err:
        raise DirectiveError(f"{where}: malformed {op}: {err}") from None


def _filter(value: object, where: str) -> Filter:
    if not isinstance(value, dict):
        raise DirectiveError(f"{where}: a filter is an object like {{\"PP\": 0}}, got {value!r}")
    return Filter.of(value)


def _devices(value: object, where: str) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DirectiveError(f"{where}: devices must be an int or a list of ints, got {value!r}")
    return tuple(value)


def apply_strategy(graph: Graph, directives: Sequence[Directive] | Strategy) -> Graph:
    strategy = directives if isinstance(directives, Strategy) else Strategy(directives)
    return strategy.apply(graph)
