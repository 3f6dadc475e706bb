"""``annotate``: mark a region of a model's ``forward`` as a unit Piper can place and order.

Outside ``capture`` an annotation costs nothing: the model runs eagerly as usual. While
``capture`` traces the model, every operation records the stack of annotation scopes it was
created in; each scope gets an index per tag name in trace order (the first
``annotate("PP")`` is ``PP=0``, the next ``PP=1``, ...), unless the user gives one.

Every entry into and exit from a region is a *boundary*; boundaries are numbered in the
order ``forward`` runs them (1, 2, ...), and the operations between two boundaries form one
*run*. Capture records each operation's run (``current_run``); eagerly, a listener
(``on_boundaries``) is told each boundary, which is how single-device training reseeds the
random number generator exactly where a captured segment starts (piper_directives.randomness).

Under ``torch.export`` (``tracing(export=True)``) the operations are recorded by export's own
tracer, which copies ``torch.fx.traceback``'s current meta into every node it creates: each
boundary therefore publishes the run and scopes there (``node.meta["custom"]["piper"]``,
read back by piper_directives.exporting).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import attrs


@attrs.frozen
class Scope:
    """One entered annotation: a tag name, its index, and where the user wrote it."""

    uid: int  # unique per capture, in trace order
    tag: str
    index: int
    source: str


class _TraceState(threading.local):
    def __init__(self) -> None:
        self.active = False
        self.stack: list[Scope] = []
        self.counters: dict[str, int] = {}
        self.next_uid = 0
        self.run = 0  # boundaries crossed so far in this capture
        self.listener: Callable[[], None] | None = None  # eager: told every boundary
        self.export = False  # torch.export records the operations: publish boundaries to its meta


_state = _TraceState()


def current_scopes() -> tuple[Scope, ...]:
    """The scopes enclosing the operation being traced (outermost first)."""
    return tuple(_state.stack)


def current_run() -> int:
    """The number of region boundaries crossed so far in this capture (the run an operation
    traced now belongs to)."""
    return _state.run


@contextmanager
def on_boundaries(listener: Callable[[], None]) -> Iterator[None]:
    """Call ``listener()`` at every region boundary an eager ``forward`` crosses on this
    thread (not while capturing)."""
    if _state.listener is not None:
        raise RuntimeError("on_boundaries is not re-entrant: a listener is already installed on this thread")
    _state.listener = listener
    try:
        yield
    finally:
        _state.listener = None


EXPORT_META = "piper"  # the key of ``node.meta["custom"]`` that holds (run, scopes) under torch.export


def _publish() -> None:
    """Under torch.export: make the current run and scopes what the next nodes record."""
    if _state.export:
        from torch.fx import traceback as fx_traceback

        custom = dict(fx_traceback.current_meta.get("custom") or {})
        custom[EXPORT_META] = (_state.run, tuple(_state.stack))
        fx_traceback.current_meta["custom"] = custom


@contextmanager
def tracing(*, export: bool = False) -> Iterator[None]:
    """Turn on scope recording for one capture (resets the per-tag counters); ``export``:
    torch.export records the operations (module doc)."""
    if _state.active:
        raise RuntimeError("capture is not re-entrant: a capture is already tracing on this thread")
    _state.active, _state.stack, _state.counters, _state.next_uid, _state.run = True, [], {}, 0, 0
    _state.export = export
    _publish()
    try:
        yield
    finally:
        if _state.export:
            from torch.fx import traceback as fx_traceback

            (fx_traceback.current_meta.get("custom") or {}).pop(EXPORT_META, None)
        _state.active, _state.stack, _state.export = False, [], False


class annotate:  # used like a keyword: ``with annotate("PP"):``
    """Mark the operations inside a ``with`` block as one region with ``tag``.

    ``index`` fixes the region's index for its tag; by default regions of one tag are
    numbered in trace order. Regions nest: an operation inside ``annotate("PP")`` and
    ``annotate("EP")`` carries both tags. ``source`` is where messages say the region was
    written (``file:line``); by default the ``with`` statement.
    """

    __slots__ = ("tag", "index", "source", "_scope")

    def __init__(self, tag: str, index: int | None = None, *, source: str | None = None) -> None:
        if not isinstance(tag, str) or not tag or not tag.replace("_", "").isalnum():
            raise ValueError(f"annotate: tag must be a non-empty identifier, got {tag!r}")
        if tag in ("PASS", "MB", "SEG"):
            raise ValueError(f"annotate: tag {tag!r} is reserved for filters")
        if index is not None and (not isinstance(index, int) or index < 0):
            raise ValueError(f"annotate: index must be a non-negative int, got {index!r}")
        self.tag = tag
        self.index = index
        self.source = source
        self._scope: Scope | None = None

    def __enter__(self) -> annotate:
        if not _state.active:
            if _state.listener is not None:
                _state.listener()
            return self
        source = self.source
        if source is None:
            frame = sys._getframe(1)
            source = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        if self.index is None:
            index = _state.counters.get(self.tag, 0)
            _state.counters[self.tag] = index + 1
        else:
            index = self.index
            _state.counters[self.tag] = max(_state.counters.get(self.tag, 0), index + 1)
        self._scope = Scope(_state.next_uid, self.tag, index, source)
        _state.next_uid += 1
        _state.run += 1
        _state.stack.append(self._scope)
        _publish()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._scope is not None:
            if self._scope in _state.stack:  # not if the capture it belonged to has ended
                _state.stack.remove(self._scope)
            _state.run += 1
            self._scope = None
            _publish()
        elif not _state.active and _state.listener is not None:
            _state.listener()
