"""Lossless, versioned JSON for every IR value.

``to_json(value)`` writes ``{"format": "piper-ir", "version": 1, "type": "Graph", "value": ...}``;
``from_json(text)`` reads it back so that ``from_json(to_json(x)) == x``. Decoding is driven by
the attrs field types, so it never evaluates code from the document.
"""

from __future__ import annotations

import json
import types
import typing
from enum import Enum
from typing import Any

import attrs

from piper_ir.errors import SerializationError

FORMAT = "piper-ir"
VERSION = 1


def _registry() -> dict[str, type]:
    from piper_ir import graph, program, tags

    classes: dict[str, type] = {}
    for module in (graph, program, tags):
        for name in dir(module):
            obj = getattr(module, name)
            if isinstance(obj, type) and attrs.has(obj) and obj.__module__ == module.__name__:
                classes[name] = obj
    return classes


def encode(value: Any) -> Any:
    """Plain JSON data for an IR value (attrs classes, tuples, enums, scalars)."""
    if attrs.has(type(value)):
        return {f.name: encode(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [encode(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise SerializationError(f"cannot encode {type(value).__name__} value {value!r}")


def decode(hint: Any, data: Any) -> Any:
    """Rebuild a value of type ``hint`` from ``encode``'s output."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if data is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return decode(option, data)
            except (SerializationError, TypeError, ValueError):
                continue
        raise SerializationError(f"{data!r} matches none of {hint}")
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(data, list):
            raise SerializationError(f"expected a list for {hint}, got {data!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], item) for item in data)
        if len(args) != len(data):
            raise SerializationError(f"expected {len(args)} items for {hint}, got {data!r}")
        return tuple(decode(a, item) for a, item in zip(args, data, strict=True))
    if isinstance(hint, type) and attrs.has(hint):
        if not isinstance(data, dict):
            raise SerializationError(f"expected an object for {hint.__name__}, got {data!r}")
        hints = typing.get_type_hints(hint)
        kwargs = {}
        for f in attrs.fields(hint):
            if f.name in data:
                kwargs[f.name] = decode(hints[f.name], data[f.name])
        unknown = set(data) - {f.name for f in attrs.fields(hint)}
        if unknown:
            raise SerializationError(f"unknown fields {sorted(unknown)} for {hint.__name__}")
        return hint(**kwargs)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(data)
    if hint in (int, str, float, bool):
        if hint is float and isinstance(data, int) and not isinstance(data, bool):
            return float(data)
        if not isinstance(data, hint) or (hint is int and isinstance(data, bool)):
            raise SerializationError(f"expected {hint.__name__}, got {data!r}")
        return data
    if hint is type(None):
        if data is not None:
            raise SerializationError(f"expected null, got {data!r}")
        return None
    raise SerializationError(f"cannot decode type {hint!r}")


def to_json(value: Any, *, indent: int | None = None) -> str:
    """Serialise an IR value (``Graph``, ``Program``, ...) to a versioned JSON document."""
    doc = {"format": FORMAT, "version": VERSION, "type": type(value).__name__, "value": encode(value)}
    return json.dumps(doc, indent=indent, sort_keys=False)


def from_json(text: str) -> Any:
    """Read a document written by ``to_json``; raises ``SerializationError`` on anything else."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise SerializationError(f"not JSON: {err}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SerializationError("not a piper-ir document (missing 'format': 'piper-ir')")
    version = doc.get("version")
    if isinstance(version, bool) or version != VERSION:
        raise SerializationError(f"piper-ir document version {version!r}; this code reads {VERSION}")
    type_name = doc.get("type")
    cls = _registry().get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise SerializationError(f"unknown IR type {type_name!r}")
    try:
        return decode(cls, doc.get("value"))
    except (TypeError, ValueError) as err:  # a bad enum member, a missing field, a converter
        raise SerializationError(f"invalid {type_name} document: {err}") from None
