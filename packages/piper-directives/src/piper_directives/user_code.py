"""Which of the user's Python modules the captured program needs on every worker.

Captured segments are ``torch.fx`` graphs, so most of the user's model code is inlined into
them; what is left are references to Python objects: the loss function, modules kept as one
call (expert modules, ``piper_experts = True``), functions a graph calls, and whatever their
module-level code refers to. A worker can import those by name only if they come from an
installed distribution or the standard library. Everything else (the ``--model`` file, a
module next to it, a test file, a script's own module) is *user code*: ``user_code_modules``
names those modules, and the front door ships them by value with the pickled segments
(piper_runtime.driver.user_code). ``__main__`` is left out: pickling already sends it by value.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import types
from collections.abc import Iterable, Mapping

import torch.fx
from torch import nn


@functools.lru_cache(maxsize=1)
def _installed_top_levels() -> frozenset[str]:
    return frozenset(importlib.metadata.packages_distributions())


def is_user_module(name: str) -> bool:
    """True for a module a worker cannot import by name: not ``__main__``, not built in, not
    in the standard library, not part of an installed distribution."""
    top = name.partition(".")[0]
    if name == "__main__" or top in sys.builtin_module_names or top in sys.stdlib_module_names:
        return False
    return top not in _installed_top_levels()


def _module_of(obj: object) -> str | None:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, functools.partial):
        return _module_of(obj.func)
    if isinstance(obj, types.MethodType):
        return _module_of(obj.__func__)
    name = getattr(obj, "__module__", None)
    if isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType) or name is None:
        return name if isinstance(name, str) else None
    return getattr(type(obj), "__module__", None)  # a callable object: its class's module


def _roots(modules: Mapping[str, nn.Module]) -> Iterable[object]:
    for module in modules.values():
        for sub in module.modules():
            yield type(sub)
            for value in vars(sub).values():  # callables a module holds (LossModule.loss_fn)
                if callable(value) and not isinstance(value, nn.Module | type):
                    yield value
            if isinstance(sub, torch.fx.GraphModule):
                for node in sub.graph.nodes:
                    if node.op == "call_function":
                        yield node.target


def user_code_modules(modules: Mapping[str, nn.Module]) -> tuple[str, ...]:
    """The user modules (``is_user_module``) that ``modules`` refer to, and the user modules
    those refer to at module level, transitively; sorted by name."""
    found: set[str] = set()
    todo = [name for obj in _roots(modules) if (name := _module_of(obj)) and is_user_module(name)]
    while todo:
        name = todo.pop()
        module = sys.modules.get(name)
        if name in found or module is None:
            continue
        found.add(name)
        for value in list(vars(module).values()):
            other = _module_of(value)
            if other and other not in found and is_user_module(other):
                todo.append(other)
    return tuple(sorted(found))
