"""Naming conventions of IR values, written down once.

The gradient of value ``v`` is the value ``grad:v`` (same meta): capture creates it, the
scheduler routes it on the backward communicator, the memory estimate and the runtime
accumulate it. Every package builds and reads such names through these helpers only.
"""

from __future__ import annotations

GRAD_PREFIX = "grad:"


def grad_name(value: str) -> str:
    """The name of ``value``'s gradient."""
    return GRAD_PREFIX + value


def is_grad(name: str) -> bool:
    """Whether ``name`` is the gradient of another value."""
    return name.startswith(GRAD_PREFIX)


def grad_of(name: str) -> str:
    """The value that gradient ``name`` belongs to (``grad_of(grad_name(v)) == v``)."""
    if not is_grad(name):
        raise ValueError(f"{name!r} is not a gradient value (no {GRAD_PREFIX!r} prefix)")
    return name[len(GRAD_PREFIX) :]
