"""Where in the user's code a capture problem lies, and what to do about it.

Capture errors name the user's file, line and source text (the innermost stack frame outside
torch and Piper), the module path the operation belongs to, and for the failures torch.fx
reports tersely a hint at the usual fix.
"""

from __future__ import annotations

import linecache
import os
import traceback
from types import TracebackType

import torch
import torch.fx

import piper_semantics
from piper_ir import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(__file__)
# Capture runs the user's code through piper_semantics (cast_forward): its frames are ours too.
_SEMANTICS_DIR = os.path.dirname(piper_semantics.__file__)
_OURS = (_TORCH_DIR, _PACKAGE_DIR, _SEMANTICS_DIR)


def _is_ours(filename: str) -> bool:
    return filename.startswith(_OURS) or filename.startswith("<")


def _frame_text(filename: str, lineno: int | None, code: str | None) -> str:
    code = (code or linecache.getline(filename, lineno or 0)).strip()
    return f"{filename}:{lineno}" + (f": {code}" if code else "")


def module_path(node: torch.fx.Node) -> str | None:
    """The qualified name of the module whose ``forward`` traced ``node`` (``blocks.0.attn``)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return str(path) or None


def describe(node: torch.fx.Node) -> str:
    """One line naming an fx node: what it calls, in which module, at which user line."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    where = ""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File ") and not any(d in lines[i] for d in _OURS):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            where = f" at {lines[i]}" + (f": {code}" if code else "")
            break
    path = module_path(node)
    inside = f" in module {path!r}" if path else ""
    return f"{node.op} {target!s} (fx node {node.name!r}){inside}{where}"


def user_frame(tb: TracebackType | None) -> str | None:
    """``file:line: code`` of the innermost frame of ``tb`` that is the user's."""
    frames = [f for f in traceback.extract_tb(tb) if not _is_ours(f.filename)]
    if not frames:
        return None
    last = frames[-1]
    return _frame_text(last.filename, last.lineno, last.line)


_HINTS = (
    (
        "cannot be used as inputs to control flow",
        "Python control flow (if, while, assert, and/or, bool()) on a tensor, or on a size read "
        "from one. Capture traces forward once with symbolic values (torch.fx), so a branch cannot "
        "depend on them: move shape checks out of forward (into the factory), compute with sizes "
        "through tensor operations (x.narrow(0, 0, n), x.unflatten(-1, (heads, -1))), and use "
        "torch.where for choices that depend on data.",
    ),
    (
        "cannot be iterated",
        "iterating over a traced value (for t in x, *x): use x.unbind(dim) or index it explicitly.",
    ),
    (
        "'len' is not supported",
        "len() of a traced value: use x.size(0).",
    ),
)


def trace_error(model: torch.nn.Module, err: Exception) -> CaptureError:
    """A ``CaptureError`` for an exception raised while torch.fx traced ``model``."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    hint = next((h for key, h in _HINTS if key in str(err)), None)
    where = user_frame(err.__traceback__)
    parts = [f"cannot capture {type(model).__name__}.forward" + (f" at {where}" if where else ""), f"{type(err).__name__}: {text}"]
    if hint:
        parts.append(f"hint: {hint}")
    return CaptureError("\n  ".join(parts))
