"""Autocast and grad-mode regions inside ``forward``, kept in the captured code.

``torch.fx`` traces the operations of ``forward`` but not the context managers around them:
``with torch.autocast(...)`` and ``with torch.no_grad()`` only flip global state while the
trace runs, so the traced graph would compute in fp32 and differentiate what the user
excluded. Capture therefore records the state each operation was traced in
(``current_context``) and ``insert_contexts`` wraps each run of operations traced in a
non-default state with explicit calls that enter and leave it again:
``torch.amp.autocast_mode._enter_autocast`` / ``_exit_autocast`` (what ``torch.export``
records for autocast) and ``grad_off`` / ``grad_restore``. The runs never cross a segment
boundary, so every segment enters and leaves its own contexts.

Not kept: an autocast for a device type this process lacks (torch disables it with a
warning while tracing, exactly as it would eagerly here), ``torch.inference_mode``, and
``torch.autocast``'s ``cache_enabled`` flag.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import attrs
import torch
import torch.fx

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


@attrs.frozen
class Context:
    """The global state an operation was traced in: the autocast dtype per enabled device
    type, and whether grad mode was on."""

    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    grad: bool = True

    @property
    def default(self) -> bool:
        return not self.autocast and self.grad


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    state = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                state.append((device, torch.get_autocast_dtype(device)))
        except RuntimeError:  # a device type this build of torch has no autocast for
            continue
    return tuple(state)


def current_context(*, in_checkpoint: bool) -> Context:
    """The context of an operation traced now. Inside ``torch.utils.checkpoint`` grad mode
    is the checkpoint's own business (the reentrant variant runs its forward without
    grad), so it counts as on."""
    return Context(_autocast_state(), True if in_checkpoint else torch.is_grad_enabled())


def grad_off() -> bool:
    """Turn grad mode off; returns the previous mode for ``grad_restore``."""
    previous = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    return previous


def grad_restore(previous: bool) -> None:
    torch._C._set_grad_enabled(previous)


_COMPUTE_OPS = ("call_function", "call_method", "call_module")


def insert_contexts(graph: torch.fx.Graph, group_of: Callable[[torch.fx.Node], Hashable]) -> int:
    """Wrap every maximal run of consecutive operations with one ``group_of`` key (the
    segment they will belong to) and one non-default ``node.meta["piper_context"]`` in
    enter/exit calls; the new nodes copy the meta of the run's first operation. Returns the
    number of runs wrapped."""
    runs: list[list[torch.fx.Node]] = []
    last: tuple[Hashable, Context] | None = None
    for node in graph.nodes:
        if node.op not in _COMPUTE_OPS:
            continue
        ctx: Context = node.meta.get("piper_context", Context())
        key = (group_of(node), ctx)
        if key != last:
            runs.append([])
            last = key
        if not ctx.default:
            runs[-1].append(node)
    wrapped = 0
    for run in runs:
        if not run:
            continue
        ctx, first, end = run[0].meta["piper_context"], run[0], run[-1]
        exits: list[tuple[Callable[..., object], torch.fx.Node]] = []
        with graph.inserting_before(first):
            for device, dtype in ctx.autocast:
                mode = graph.call_function(torch.amp.autocast_mode._enter_autocast, (device, dtype, True, None))
                exits.append((torch.amp.autocast_mode._exit_autocast, mode))
            if not ctx.grad:
                exits.append((grad_restore, graph.call_function(grad_off, ())))
        with graph.inserting_after(end):
            # Each new node goes right after ``end``: created outermost first, they run
            # innermost first.
            for fn, handle in exits:
                graph.call_function(fn, (handle,))
        for n in [*(h for _, h in exits), *(u for _, h in exits for u in h.users)]:
            n.meta.update({k: v for k, v in first.meta.items() if k.startswith("piper_") and k != "piper_context"})
        wrapped += 1
    return wrapped
