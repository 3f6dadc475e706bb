"""A strategy: a list of directives applied to a captured graph in a fixed phase order.

The order of the phases, not the order the directives are written in, decides what each
directive sees (``Strategy.apply``):

1. ``Split``: microbatches first, so every later phase sees per-microbatch nodes;
2. every ``Recompute`` (``recompute_all``): which regions recompute their activations (a
   property of segments, before anything is placed);
3. every ``Place`` (``place_all``): a device group on every node;
4. every ``Shard`` (``shard_all``): which groups are tensor- or expert-parallel;
5. every ``Replicate`` (``replicate_all``): how replicated groups stay in sync, the batch
   cut among the replicas (which needs to know the sharded groups: their ranks share data);
   every ``ContextParallel`` around it (``context_all`` before: sequences kept whole per
   data-parallel shard; ``context_records`` after: the ``cp`` shardings);
6. communication (``insert_communication``): a SEND/RECV pair for each value crossing groups;
7. the backward split the ``Order`` directives ask for (``split_backward``: a chunk named
   with ``PASS: "BI"``/``"BW"`` gets its ``B`` split);
8. every ``Order``, in the order written.

A strategy is plain data: ``Strategy.to_json`` / ``Strategy.from_json`` write and read the
same program as JSON. Each directive class defines its own JSON form (``op``, ``to_json``,
``from_json``; ``common``); ``DIRECTIVES`` registers them. docs/strategies.md describes the
language.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs

from piper_directives.common import JsonObject, json_fields
from piper_directives.communication import insert_communication
from piper_directives.context_parallel import ContextParallel, context_all, context_records
from piper_directives.order import Order, apply_orders
from piper_directives.place import Place, place_all, send_streams
from piper_directives.recompute import Recompute, recompute_all
from piper_directives.replicate import Replicate, replicate_all
from piper_directives.shard import Shard, shard_all
from piper_directives.split import Split
from piper_directives.split_backward import requested_splits, split_backward
from piper_ir import DirectiveError, Graph, gc_paused, validate

Directive = Split | Recompute | Place | Replicate | Shard | ContextParallel | Order

#: Every directive, registered once: its class's ``op`` names it in JSON.
DIRECTIVES: tuple[type[Directive], ...] = (Split, Recompute, Place, Replicate, Shard, ContextParallel, Order)
_BY_OP: dict[str, type[Directive]] = {cls.op: cls for cls in DIRECTIVES}

D = TypeVar("D", Split, Recompute, Place, Replicate, Shard, ContextParallel, Order)


@attrs.frozen
class Strategy:
    directives: tuple[Directive, ...] = attrs.field(converter=tuple)

    def of(self, kind: type[D]) -> list[D]:
        """The directives of one kind, in the order written."""
        return [d for d in self.directives if isinstance(d, kind)]

    def apply(self, graph: Graph, progress: Callable[[str, float], None] | None = None) -> Graph:
        """The phases of the module doc, then ``validate``; ``progress(name, seconds)`` is
        called as each phase ends (``phases`` names them).

        Python's cyclic collector is paused meanwhile (``gc_paused``): every phase copies
        the graph, and at 392k nodes the full collections those copies trigger took a
        sixth of the time."""
        phases = self.phases()
        with gc_paused():
            for name, phase in phases:
                started = time.perf_counter()
                graph = phase(graph)
                if progress is not None:
                    progress(name, time.perf_counter() - started)
        return graph

    def phases(self) -> list[tuple[str, Callable[[Graph], Graph]]]:
        """What ``apply`` runs, in order: (name, graph -> graph), after checking the
        directives. Named so a benchmark or a progress report can time each phase."""
        for d in self.directives:
            if not isinstance(d, DIRECTIVES):
                names = [cls.__name__ for cls in DIRECTIVES]
                raise DirectiveError(f"{d!r} is not a directive ({', '.join(names[:-1])} or {names[-1]})")
        splits, places, shards, replicates, orders = (
            self.of(Split), self.of(Place), self.of(Shard), self.of(Replicate), self.of(Order)
        )
        if len(splits) > 1:
            raise DirectiveError("a strategy may split the batch once", directive=str(splits[1]))
        if not places:
            raise DirectiveError("a strategy needs at least one Place directive")
        recomputes = self.of(Recompute)
        contexts = self.of(ContextParallel)
        return [
            *(("split", split.apply) for split in splits),
            ("recompute", lambda g: recompute_all(g, recomputes)),
            ("place", lambda g: place_all(g, places)),
            ("shard", lambda g: shard_all(g, shards, replicates)),
            ("context", lambda g: context_all(g, contexts)),
            ("replicate", lambda g: replicate_all(g, replicates)),
            ("context records", lambda g: context_records(g, contexts)),
            ("communication", lambda g: insert_communication(g, send_streams(g, places))),
            ("split backward", lambda g: split_backward(g, requested_splits(g, orders))),
            ("order", lambda g: apply_orders(g, orders)),
            # apply_orders searched the ordered graph for cycles already
            ("validate", lambda g: validate(g, cycles=not orders)),
        ]

    def to_json(self) -> str:
        return json.dumps({"directives": [d.to_json() for d in self.directives]}, indent=1)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<json>") -> Strategy:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise DirectiveError(f"{source}: not valid JSON: {err}") from None
        except RecursionError:  # Python's decoder recurses once per nesting level
            raise DirectiveError(f"{source}: JSON nested too deeply to read (a strategy is a flat list)") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("directives"), list):
            raise DirectiveError(f'{source}: expected an object {{"directives": [...]}}')
        return cls(_decode(item, f"{source}#{i}") for i, item in enumerate(doc["directives"]))


def _decode(item: object, where: str) -> Directive:
    """One directive from its JSON object: the checks every directive shares, then its
    class's ``from_json`` (given the fields but ``op``)."""
    if not isinstance(item, dict) or "op" not in item:
        raise DirectiveError(f'{where}: a directive is an object with an "op" field, got {item!r}')
    op = item["op"]
    if not isinstance(op, str) or op not in _BY_OP:
        raise DirectiveError(f"{where}: unknown op {op!r}; expected one of {sorted(_BY_OP)}")
    kind = _BY_OP[op]
    fields: JsonObject = {k: v for k, v in item.items() if k != "op"}
    known, required = json_fields(kind)
    if unknown := set(fields) - known:
        raise DirectiveError(f"{where}: {op} has no field(s) {sorted(unknown)}")
    if missing := required - set(fields):
        raise DirectiveError(f"{where}: {op} needs field(s) {sorted(missing)}")
    try:
        return kind.from_json(fields, where)
    except (TypeError, ValueError) as err:
        raise DirectiveError(f"{where}: malformed {op}: {err}") from None


@attrs.frozen
class SizedStrategy:
    """A strategy made once the model's region count is known (``build(regions)``), on a
    device count known before: a runtime can start its ranks' machinery while the model is
    captured (``Trainer``, ``piper_runtime.prepare_runtime``)."""

    build: Callable[[int], Strategy]
    devices: int

    def __call__(self, regions: int) -> Strategy:
        return self.build(regions)


def device_count(strategy: Strategy | Callable[[int], Strategy]) -> int | None:
    """How many ranks ``strategy`` runs on, where that is known before the model is captured
    (the devices a ``Strategy``'s directives name, a ``SizedStrategy``'s ``devices``)."""
    if isinstance(strategy, SizedStrategy):
        return strategy.devices
    if isinstance(strategy, Strategy):
        devices = {d for directive in strategy.directives for d in getattr(directive, "devices", ())}
        return max(devices) + 1 if devices else None
    return None


def apply_strategy(graph: Graph, directives: Sequence[Directive] | Strategy) -> Graph:
    strategy = directives if isinstance(directives, Strategy) else Strategy(directives)
    return strategy.apply(graph)
