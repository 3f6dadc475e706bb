"""``slot_maker(cls)``: a positional constructor of a frozen, slotted attrs class, for the
passes that make an object per node, edge or instruction (at 16,384 devices
``Strategy.apply`` makes 525k nodes and 787k edges, and ``compile_program`` 392k
instructions).

attrs' ``__init__`` of a frozen class sets each field with ``object.__setattr__``, which
looks the field's name up on the class first (an ``Instruction``, 13 fields: 1.3 us); setting
each slot through its descriptor skips that lookup but still calls the descriptor once per
field (1.0-1.1 us). The maker fills an instance of a twin of ``cls`` instead, a subclass that
adds no slot and keeps ``object``'s ``__setattr__``, so each field is one plain assignment
(the interpreter's fastest store), then assigns ``__class__ = cls``: 0.4 us an
``Instruction``, 0.35 us against 0.6 us an ``Edge``. What it returns is a ``cls``, frozen,
as ``cls(*values)`` would make it; the twin never leaves the maker. Where the interpreter
refuses the ``__class__`` assignment (tried once, when the maker is made), the slots are set
through their descriptors.

The maker runs no converter or validator, so it is for callers that pass every field as the
class's converter would leave it (a tuple where the converter is ``tuple``); classes with a
validator or an ``__attrs_post_init__`` are refused. What it makes equals what
``cls(*values)`` makes.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TypeVar

import attrs

T = TypeVar("T")


def slot_maker(cls: type[T]) -> Callable[..., T]:
    """``make(*values)``: an instance of ``cls`` with its fields, in ``attrs.fields`` order,
    set to ``values`` as given (module doc); every field must be passed."""
    fields = attrs.fields(cls)  # type: ignore[arg-type]
    if hasattr(cls, "__attrs_post_init__") or any(a.validator is not None for a in fields):
        raise TypeError(f"slot_maker: {cls.__name__} checks its fields; build it with its __init__")
    others = set(getattr(cls, "__slots__", ())) - {a.name for a in fields} - {"__weakref__"}
    if others:  # a cached hash or property: __init__ may set it too
        raise TypeError(f"slot_maker: {cls.__name__} has slots besides its fields: {sorted(others)}")
    names = []
    for a in fields:
        slot = cls.__dict__.get(a.name)
        if not isinstance(slot, types.MemberDescriptorType) or not a.init:
            raise TypeError(f"slot_maker: {cls.__name__}.{a.name} is not a slot __init__ sets")
        names.append(a.name)
    make = _assigning_maker(cls, names) or _descriptor_maker(cls, names)
    make.__doc__ = f"A {cls.__name__} from its {len(fields)} fields, by position (``slot_maker``)."
    return make


def _assigning_maker(cls: type[T], names: list[str]) -> Callable[..., T] | None:
    """``make`` that fills an instance of a mutable twin of ``cls`` (a subclass adding no slot,
    with ``object``'s own ``__setattr__``) by plain assignments, then makes it a ``cls``
    (``__class__``: the two share one layout); None where the interpreter refuses that."""
    twin = type(
        f"_Mutable{cls.__name__}",
        (cls,),
        # ``__delattr__`` too: both fill one C slot, which must be object's for plain assignment
        {"__slots__": (), "__setattr__": object.__setattr__, "__delattr__": object.__delattr__},
    )
    body = "".join(f"    obj.{name} = v{k}\n" for k, name in enumerate(names))
    make = _compiled(names, body, {"_new": object.__new__, "_twin": twin, "_cls": cls},
                     "    obj = _new(_twin)\n", "    obj.__class__ = _cls\n")
    try:
        made = make(*names)
    except TypeError:  # ``__class__`` assignment refused: another layout or interpreter
        return None
    if type(made) is not cls or any(getattr(made, name) != name for name in names):
        return None
    return make


def _descriptor_maker(cls: type[T], names: list[str]) -> Callable[..., T]:
    """``make`` that sets each slot of a new ``cls`` through the slot's descriptor."""
    setters = {f"_set{k}": cls.__dict__[name].__set__ for k, name in enumerate(names)}
    body = "".join(f"    _set{k}(obj, v{k})\n" for k in range(len(names)))
    return _compiled(names, body, {**setters, "_new": object.__new__, "_cls": cls}, "    obj = _new(_cls)\n", "")


def _compiled(names: list[str], body: str, namespace: dict, first: str, last: str) -> Callable:
    """``def make(v0, v1, ...)``: ``first``, ``body``, ``last``, then ``return obj``."""
    params = ", ".join(f"v{k}" for k in range(len(names)))
    exec(f"def make({params}):\n{first}{body}{last}    return obj\n", namespace)
    return namespace["make"]  # type: ignore[no-any-return]
