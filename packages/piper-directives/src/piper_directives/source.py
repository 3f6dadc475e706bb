"""Where the user wrote a directive: the first stack frame outside piper_directives."""

from __future__ import annotations

import os
import sys

_PACKAGE_DIR = os.path.dirname(__file__)


def user_location() -> str:
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR) or "<attrs generated" in frame.f_code.co_filename
    ):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
