"""Where the ``piper`` command writes, checked before any work starts.

A path that cannot be written is the user's mistake, so it is refused with exit code 2 and a
message naming the option, never a traceback; and it is refused up front, not when the file
is due: a checkpoint folder that cannot be made would otherwise end an hour of training at
its first checkpoint, and a ``--out`` whose folder is missing the tuning it was to save.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def output_file(text: str) -> Path:
    """argparse type of an option naming a file to write: its folder must exist and be
    writable, and the path must not be a folder."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; name a file in it")
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"cannot write {text}: {folder} {what}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: no permission to write in {folder}")
    return path


def writable_folder(path: Path, option: str) -> None:
    """Make folder ``path`` (and its parents) if missing and check that a file can be made in
    it; ``ValueError`` naming ``option`` if not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        reason = err.strerror or str(err)
        raise ValueError(f"{option} {path}: cannot write there ({reason})") from None


@contextmanager
def writing(path: Path, option: str) -> Iterator[None]:
    """Around the write of ``option``'s file: an ``OSError`` (the folder went away, the disk
    is full, a special filesystem refuses files) becomes a ``ValueError`` naming both."""
    try:
        yield
    except OSError as err:
        reason = err.strerror or str(err)
        raise ValueError(f"{option} {path}: cannot write it ({reason})") from None
