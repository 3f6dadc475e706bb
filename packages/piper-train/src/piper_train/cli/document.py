"""``--json``: stdout holds exactly one JSON document, whatever the outcome.

A program reading ``piper train --json`` parses stdout; a second line there breaks it, and an
empty stdout tells it nothing. So, with ``--json`` (``wanted``):

- While the command runs, everything else bound for stdout goes to stderr
  (``stdout_to_stderr``): Python's ``sys.stdout`` (Ray's driver prints a worker's death there,
  ``(raylet) A worker died ...``, from a thread of its own) and file descriptor 1 (what native
  code and child processes write).
- The command hands its document over (``emit``) instead of printing it; on a failure it hands
  over what it had so far (``piper train``: the steps done). ``main`` then writes one document
  on the real stdout (``Document.write``): the command's, with ``ok``, ``exit_code`` and
  ``error`` added, in every outcome (0, 1, 2, 3, 130, 143); argparse's usage errors included,
  whose message is read off stderr as argparse writes it (``Tee``).

Messages carry no ANSI colour codes (a worker's traceback comes coloured by Ray) unless they go
to a terminal (``readable``); the document's never do.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from piper_train.metrics import SCHEMA, dumps

_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (colours, cursor moves, terminal titles)."""
    return _ANSI.sub("", text)


def readable(text: str, stream: TextIO) -> str:
    """``text`` as it should reach ``stream``: its colour codes only on a terminal."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        tty = False
    return text if tty else strip_ansi(text)


def wanted(argv: Sequence[str]) -> bool:
    """Whether the command line asks for ``--json`` (options end at ``--``), read before
    argparse so that its usage errors get a document too."""
    for arg in argv:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


class Document:
    """The one ``--json`` document of a run: the command's body (``emit``) and its outcome."""

    def __init__(self) -> None:
        self.command: str | None = None
        self.body: dict[str, Any] = {}
        self.error: str | None = None
        self.quiet = False  # a torchrun job's process but rank 0's: rank 0 writes the document

    def fail(self, message: str) -> None:
        """Why the command did not end well; the first reason given is kept."""
        if self.error is None:
            self.error = strip_ansi(message)

    def write(self, stream: TextIO, exit_code: int) -> None:
        if self.quiet:
            return
        body = {"schema": SCHEMA, "command": self.command, **self.body}
        body.update(ok=exit_code == 0, exit_code=exit_code, error=self.error)
        stream.write(dumps(body) + "\n")
        stream.flush()


def emit(args: argparse.Namespace, body: dict[str, Any]) -> None:
    """Hand the command's ``--json`` document to ``main`` (a later call replaces an earlier
    one: a partial document, then the whole). Printed at once where ``main`` is not running
    the command (a caller of the command function)."""
    document = getattr(args, "document", None)
    if isinstance(document, Document):
        document.body = dict(body)
    else:
        print(dumps(body))


def fail(args: argparse.Namespace, message: str) -> None:
    """Say ``message`` on stderr and record it as the document's ``error``."""
    print(readable(message, sys.stderr), file=sys.stderr)
    document = getattr(args, "document", None)
    if isinstance(document, Document):
        document.fail(message)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Within the block, ``sys.stdout`` and file descriptor 1 lead to stderr; after it, both
    are back (what was buffered for stdout meanwhile is flushed to stderr first)."""
    original = sys.stdout
    with contextlib.suppress(OSError, ValueError):
        original.flush()
    try:
        saved: int | None = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no file descriptor 1 or 2 (an embedding program): Python's stream only
        saved = None
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        for stream in (original, sys.__stdout__, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):
                stream.flush()
        sys.stdout = original
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


class Tee(io.TextIOBase):
    """A text stream writing to ``stream`` and keeping a copy (argparse's usage errors, for
    the document)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def usage_error(self) -> str | None:
        """argparse's last ``prog: error: message`` line, if any."""
        lines = [line for line in self.copy.getvalue().splitlines() if ": error: " in line]
        return lines[-1] if lines else None
