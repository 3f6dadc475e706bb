"""What every directive module shares: where the user wrote a directive, and turning what
the user wrote (Python values or a JSON document) into filters and device groups.

Each directive class (``Split``, ``Recompute``, ``Place``, ``Shard``, ``Replicate``, ``Order``) defines its
own JSON form: a class attribute ``op`` (the ``"op"`` of its JSON object), ``to_json()`` and
``from_json(fields, where)``, given the object's fields but ``op``. Its JSON fields are its
attrs fields but ``where``; those without a default are required (``json_fields``), so
``Strategy.from_json`` checks every directive's object the same way before ``from_json``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import attrs

from piper_ir import DirectiveError, Filter

JsonObject = dict[str, Any]

# Piper's packages: a frame of their code is never where a user wrote a directive. (A user's
# ``--model`` file is imported as ``piper_user_<name>``, which is the user's code.)
_PIPER_PACKAGES = (
    "piper_ir", "piper_semantics", "piper_directives", "piper_scheduler", "piper_runtime", "piper_memory", "piper_train",
)
_WRITTEN_AT: ContextVar[str | None] = ContextVar("piper_directives_written_at", default=None)


def user_location() -> str:
    """Where the user wrote the directive being made (errors name it): what the innermost
    ``written_at`` says, else ``file:line`` of the first stack frame outside Piper's own
    packages (a library schedule built through ``piper_train``'s ``Trainer`` names the line of
    the user's script that asked for it, not Piper's)."""
    said = _WRITTEN_AT.get()
    if said is not None:
        return said
    frame = sys._getframe(1)
    while frame is not None and (
        str(frame.f_globals.get("__name__", "")).partition(".")[0] in _PIPER_PACKAGES
        or "<attrs generated" in frame.f_code.co_filename
    ):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def written_at_or(where: str) -> str:
    """Where a directive derived from another (written at ``where``) was asked for: what the
    innermost ``written_at`` says, else ``where``."""
    said = _WRITTEN_AT.get()
    return where if said is None else said


@contextmanager
def written_at(origin: str) -> Iterator[None]:
    """Directives made inside are said to be written at ``origin`` (a command's flags, say:
    ``piper train`` makes its schedule from ``--schedule``, ``--pp`` and ``--microbatches``,
    and a user of the command has no line of code to be pointed at)."""
    token = _WRITTEN_AT.set(origin)
    try:
        yield
    finally:
        _WRITTEN_AT.reset(token)


def to_filter(value: object) -> Filter:
    """attrs converter: a ``Filter``, or a dict such as ``{"PP": 0}``."""
    if isinstance(value, Filter):
        return value
    if isinstance(value, dict):
        return Filter.of(value)
    raise TypeError(f"expected a Filter or a dict, got {value!r}")


def to_devices(value: object) -> tuple[int, ...]:
    """attrs converter: one device (an int) or a sequence of them. The directive checks the
    values, so its error can name it."""
    return (value,) if isinstance(value, int) else tuple(value)  # type: ignore[call-overload]


def check_degree(directive: str, devices: tuple[int, ...], degree: object, groups: str) -> None:
    """A group directive's ``degree``: an int >= 2 that divides its ``devices`` (``groups`` says
    what each group of ``degree`` devices is); else ``DirectiveError`` naming ``directive``."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 2 or len(devices) % degree:
        raise DirectiveError(
            f"degree must be an int >= 2 that divides the {len(devices)} devices ({groups}), got {degree!r}",
            directive=directive,
        )


def json_fields(cls: type) -> tuple[frozenset[str], frozenset[str]]:
    """The JSON fields of directive class ``cls`` and the required ones among them."""
    fields = [f for f in attrs.fields(cls) if f.name != "where"]
    return frozenset(f.name for f in fields), frozenset(f.name for f in fields if f.default is attrs.NOTHING)


def filter_from_json(value: object, where: str) -> Filter:
    if not isinstance(value, dict):
        raise DirectiveError(f"{where}: a filter is an object like {{\"PP\": 0}}, got {value!r}")
    return Filter.of(value)


def devices_from_json(value: object, where: str) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DirectiveError(f"{where}: devices must be an int or a list of ints, got {value!r}")
    return tuple(value)
