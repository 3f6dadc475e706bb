"""A call's outcome as the processes of a launched job tell each other (``spmd_ranks``): data,
never a pickle.

An outcome is the method's name and either its value or what it raised. It travels as one
byte string: 8 bytes giving the JSON header's length, the header (``checkpoint_files.encode``'s
tagged tree, with the records a rank returns allowed by name: ``StepOutput``,
``InstructionTiming``, ``RankMemory``, a checkpoint's ``LocalPlan``), then a safetensors
buffer of its tensors. Reading one builds only those types: a peer, or anyone who can write
to the job's store, can send wrong numbers but cannot make this process run code.

An exception travels as its type's name, message and text (with the rank's traceback); the
reader rebuilds a ``piper_ir.PiperError`` subclass (with its ranks, nodes and step) or an
``OSError`` (with its errno), and gives any other only as text.
"""

from __future__ import annotations

import json
import struct
import traceback
from collections.abc import Callable
from typing import Any

import piper_ir
from piper_ir import CheckpointError, PiperError
from piper_runtime.checkpoint_files import decode, encode
from piper_runtime.driver.ranks import RankFailure
from piper_runtime.rank.memory import RankMemory
from piper_runtime.results import InstructionTiming, StepOutput

_LENGTH = struct.Struct("<Q")


def _records() -> dict[str, type]:
    from piper_runtime.checkpoint import LocalPlan  # as the worker imports it: on first use

    return {cls.__name__: cls for cls in (StepOutput, InstructionTiming, RankMemory, LocalPlan)}


class Outcome:
    """What ``run()`` gave: its value, or the exception and its traceback's text."""

    def __init__(self, method: str, run: Callable[[], Any]) -> None:
        self.method = method
        self.error: BaseException | None = None
        self.text = ""
        self.value: Any = None
        try:
            self.value = run()
        except BaseException as exc:  # a peer waits for it, whatever it is
            self.error, self.text = exc, "".join(traceback.format_exception(exc))

    def result(self, rank: int) -> Any:
        """The value, or ``RankFailure`` for what was raised."""
        if self.error is not None:
            raise RankFailure("raised", self.text, self.error)
        return self.value

    def pack(self) -> bytes:
        """This outcome as bytes (module doc); a value that is not data is sent as a failure
        saying so."""
        if self.error is None:
            try:
                return _pack({"method": self.method, "ok": True, "value": self.value})
            except TypeError as err:
                return _pack({"method": self.method, "ok": False,
                              "error": {"type": "TypeError", "message": str(err)},
                              "text": f"{self.method} returned what a launched job cannot send: {err}"})
        return _pack({"method": self.method, "ok": False, "error": _error(self.error), "text": self.text})


def unpack(blob: bytes, method: str, rank: int) -> Any:
    """The value of a published outcome of ``method`` on ``rank``, or ``RankFailure``."""
    try:
        (length,) = _LENGTH.unpack_from(blob)
        tree = json.loads(blob[_LENGTH.size:_LENGTH.size + length])
        buffer = blob[_LENGTH.size + length:]
        tensors = _load_tensors(buffer) if buffer else {}
        outcome = decode(tree, tensors.__getitem__, f"rank {rank}'s answer to {method}", _records())
        answered, ok = outcome["method"], outcome["ok"]
    except (ValueError, KeyError, TypeError, struct.error, CheckpointError) as err:
        raise RankFailure("raised", f"rank {rank}'s answer to {method} is not one a rank sends: {err}") from None
    if answered != method:
        raise RankFailure(
            "raised",
            f"the processes' drivers diverged: this one's call was {method}, the process of rank {rank} answered "
            f"{answered} (every process must run the same program and make the same calls in one order)",
        )
    if ok:
        return outcome["value"]
    raise RankFailure("raised", str(outcome.get("text", "")), _rebuilt(outcome.get("error") or {}))


def _pack(outcome: dict[str, Any]) -> bytes:
    tree, tensors = encode(outcome, "t", _records())
    header = json.dumps(tree, allow_nan=False).encode()
    return _LENGTH.pack(len(header)) + header + (_save_tensors(tensors) if tensors else b"")


def _save_tensors(tensors: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def _load_tensors(buffer: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    return load(buffer)


def _error(exc: BaseException) -> dict[str, Any]:
    """What a reader may rebuild of ``exc`` (module doc)."""
    error: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, PiperError):
        error.update(message=exc.message, directive=exc.directive, nodes=list(exc.nodes),
                     ranks=list(exc.ranks), step=exc.step)
    elif isinstance(exc, OSError):
        error.update(errno=exc.errno, strerror=exc.strerror)
    return error


def _rebuilt(error: dict[str, Any]) -> BaseException | None:
    """A ``PiperError`` subclass of ``piper_ir`` or an ``OSError`` as ``_error`` described it;
    ``None`` for any other (its text says what it was)."""
    kind = getattr(piper_ir, str(error.get("type")), None)
    try:
        if isinstance(kind, type) and issubclass(kind, PiperError):
            return kind(str(error.get("message", "")), directive=error.get("directive"),
                        nodes=tuple(error.get("nodes") or ()), ranks=tuple(error.get("ranks") or ()),
                        step=error.get("step"))
        if error.get("type") in ("OSError", "FileNotFoundError", "PermissionError") and isinstance(
            error.get("errno"), int
        ):
            return OSError(error["errno"], str(error.get("strerror") or ""))
    except TypeError:  # a subclass with a constructor of its own: the text still says it all
        return None
    return None
