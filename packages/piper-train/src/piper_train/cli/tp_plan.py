"""``--tp-plan``: a tensor-parallel plan by module path on the command line or in a job file.

The plan is ``Shard(plan=...)``'s (``piper_directives.shard``): which module each pattern
names (``*`` one path component; the first pattern that matches wins) and how it is cut.
One flag takes three spellings, so that a plan fits a shell line, a JSON file kept beside
the model, and a job file's table:

- ``'layers.*.attention.wq=colwise,layers.*.attention.wo=rowwise'`` (inline pairs);
- ``plan.json``: a file holding one JSON object, pattern -> style;
- ``{...}``: the object itself (what a job file's ``[tp_plan]`` table reads as).

Styles are checked here against ``PLAN_STYLES`` (the one list, piper-directives'); whether a
pattern names a module of the model is known only once it is captured, and is
``shard_modules``'s error (it lists the module paths that exist).
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

from piper_directives import PLAN_STYLES

Plan = tuple[tuple[str, str], ...]


def tp_plan(text: str) -> Plan:
    """The plan ``text`` spells (module doc); ``argparse.ArgumentTypeError`` naming the pair
    or the file at fault."""
    text = text.strip()
    if text.startswith("{"):
        return _pairs(_object(text, "the plan"), "the plan")
    if "=" in text:
        pairs = []
        for item in filter(None, (p.strip() for p in text.split(","))):
            pattern, sep, style = (s.strip() for s in item.partition("="))
            if not sep or not pattern:
                raise argparse.ArgumentTypeError(f"{item!r} is not PATTERN=STYLE (e.g. layers.*.attention.wq=colwise)")
            pairs.append((pattern, style))
        return _pairs(dict(pairs), "the plan")
    path = Path(text)
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither PATTERN=STYLE,... nor a readable JSON file ({err})"
        ) from None
    try:
        value = json.loads(content)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{path}: not JSON ({err})") from None
    return _pairs(value, str(path))


def write(plan: Plan) -> dict[str, str]:
    """The plan as a job file holds it (a table; ``tp_plan`` reads its text back)."""
    return dict(plan)


def _object(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:  # a job file's table reaches the type as str(dict): Python's spelling of it
            return ast.literal_eval(text)
        except (ValueError, SyntaxError) as err:
            raise argparse.ArgumentTypeError(f"{where} is not a JSON object ({err})") from None


def _pairs(value: object, where: str) -> Plan:
    if not isinstance(value, dict) or not value:
        raise argparse.ArgumentTypeError(f"{where} must be a non-empty object of module-path pattern -> style")
    for pattern, style in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise argparse.ArgumentTypeError(f"{where}: pattern {pattern!r} is not a module path")
        if style not in PLAN_STYLES:
            raise argparse.ArgumentTypeError(
                f"{where}: {pattern!r} has style {style!r}; the styles are {', '.join(PLAN_STYLES)}"
            )
    return tuple(value.items())
