"""Numbers a user gives (a learning rate, a timeout, a tolerance, a budget): finite, and above
or at least a bound where a smaller value means nothing.

One rule for the Python API (``check``: a ``ValueError`` naming the parameter) and the command
line (``piper_train.cli.options``: a usage error naming the flag), so that a NaN is refused
where it is given, before any worker starts, and not where it first breaks something (an
optimizer's constructor on a worker, an ``int()`` of a budget, a deadline that never comes).
"""

from __future__ import annotations

import math
from numbers import Real

# About 31 years: a longer timeout bounds nothing more, and overflows where it becomes a
# deadline (``datetime.timedelta`` on a worker, a C timeout in Ray).
MAX_TIMEOUT_S = 1e9


def problem(
    value: object, *, minimum: float | None = None, strict: bool = False, maximum: float | None = None
) -> str | None:
    """What is wrong with ``value`` as a number of at least ``minimum`` (above it, ``strict``)
    and at most ``maximum``: ``"must be a finite number"``, ``"must be > 0"``, ...; ``None``
    when nothing is."""
    if isinstance(value, bool) or not isinstance(value, Real):  # numpy's scalars are Real too
        return "must be a number"
    if not math.isfinite(value):
        return "must be a finite number"
    if minimum is not None and (value <= minimum if strict else value < minimum):
        return f"must be {'>' if strict else '>='} {minimum:g}"
    if maximum is not None and value > maximum:
        return f"must be <= {maximum:g}"
    return None


def check(
    name: str, value: object, *, minimum: float | None = None, strict: bool = False, maximum: float | None = None
) -> None:
    """``ValueError`` naming ``name`` when ``value`` breaks the rule (``problem``)."""
    wrong = problem(value, minimum=minimum, strict=strict, maximum=maximum)
    if wrong is not None:
        raise ValueError(f"{name} {wrong}, got {value!r}")
