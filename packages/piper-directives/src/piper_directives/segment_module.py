"""``SegmentModule``: a segment's ``torch.fx.GraphModule`` that travels with its graph intact.

torch.fx pickles a ``GraphModule`` as its generated source and re-traces that source when it
is loaded. Re-tracing records only calls that receive a traced value, so a call without
one — entering ``torch.autocast``, switching grad mode off, the very context switches capture
keeps so a segment means what the user wrote — would run once during loading and vanish from
the worker's copy. ``SegmentModule`` pickles its graph node by node instead and rebuilds it
unchanged, so the worker runs exactly the captured code (and loading never traces). The
torch operators torch.export's code calls travel by name (``_Op``).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.fx
from torch import nn


@attrs.frozen
class _Ref:
    """A reference to an earlier node of the graph, by name."""

    name: str


@attrs.frozen
class _Op:
    """A torch operator by name (``aten.linear.default``; ``higher_order.wrap_with_autocast``):
    torch.export's code calls operator objects, which pickle cannot hold."""

    path: str

    @classmethod
    def of(cls, target: Any) -> Any:
        if isinstance(target, torch._ops.OpOverload):
            return cls(str(target))  # "aten.linear.default"
        if isinstance(target, torch._ops.HigherOrderOperator):
            return cls(f"higher_order.{target.name()}")
        return target

    def resolve(self) -> Any:
        found: Any = torch.ops
        for part in self.path.split("."):
            found = getattr(found, part)
        return found


def _node_data(node: torch.fx.Node) -> tuple[str, str, Any, Any, Any]:
    def ref(arg: Any) -> Any:
        return _Ref(arg.name) if isinstance(arg, torch.fx.Node) else _Op.of(arg)

    args = torch.fx.node.map_aggregate(node.args, ref)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, ref)
    return (node.op, node.name, _Op.of(node.target), args, kwargs)


def _graph_from_data(data: list[tuple[str, str, Any, Any, Any]]) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}

    def resolve(arg: Any) -> Any:
        if isinstance(arg, _Ref):
            return env[arg.name]
        return arg.resolve() if isinstance(arg, _Op) else arg

    for op, name, target, args, kwargs in data:
        args = torch.fx.node.map_aggregate(args, resolve)
        kwargs = torch.fx.node.map_aggregate(kwargs, resolve)
        node = graph.create_node(op, resolve(target), args, kwargs, name=name)
        if node.name != name:  # create_node renames only on a clash, which a valid graph has not
            raise RuntimeError(f"node {name!r} came back as {node.name!r}")
        env[name] = node
    graph.lint()
    return graph


def _rebuild(body: dict[str, Any], data: list[tuple[str, str, Any, Any, Any]], class_name: str) -> SegmentModule:
    root = nn.Module()
    root.__dict__.update(body)
    module = SegmentModule(root, _graph_from_data(data), class_name=class_name)
    for key, value in body.items():  # plain attributes the graph does not name (like torch.fx does)
        if key not in module.__dict__:
            module.__dict__[key] = value
    return module


class SegmentModule(torch.fx.GraphModule):
    """A ``GraphModule`` whose pickle holds its graph, not source to re-trace."""

    def __reduce__(self) -> tuple[Any, ...]:
        body = {k: v for k, v in self.__dict__.items() if k not in ("_graph", "_code")}
        data = [_node_data(n) for n in self.graph.nodes]
        return (_rebuild, (body, data, type(self).__name__))


def like(module: nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A module with ``graph`` built from ``module``'s attributes, of the same kind (a
    ``SegmentModule`` stays one) — for passes that rewrite a segment's code."""
    cls = SegmentModule if isinstance(module, SegmentModule) else torch.fx.GraphModule
    return cls(module, graph, class_name=type(module).__name__)
