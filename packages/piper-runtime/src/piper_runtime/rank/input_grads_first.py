"""Send a stage's last input gradient of the step before computing its weight gradients.

In every schedule a stage's ``B`` is followed, on the rank, by the ``SEND`` of its input
gradient to the previous stage, which waits for it. Autograd computes that gradient last: the
first layer's input gradient comes out of the pass's final node, after every weight product.
So where the last ``B`` of a stage in the step runs through layers whose weight products can
be left for later (``nn.Linear`` layers with the fused backward of
``piper_runtime.rank.accumulation``), the runtime computes the pass with those products deferred,
posts the sends that follow it, and only then adds the products into ``.grad``
(``WeightProducts.settle``). The previous stage starts its last backward one weight-gradient
pass sooner: in 1F1B at pp=2 the last microbatch's gradient
reaches rank 0 about half a backward earlier, and the step's drain is that much shorter.
Zero-bubble schedules split ``B`` in the plan (``BI``/``BW``); this changes no plan and no
schedule, only when inside one ``B``'s window the weight products run. A compiled segment
(``--compile``) defers the same way with its split functions: the window's ``B`` runs as the
segment's compiled ``BI`` and its ``BW`` settles with the window (``WeightProducts.later``).

Only each segment's last ``B`` of the step defers: that gradient is the one the previous stage
waits for in the pipeline's drain, in every schedule. Earlier ones would gain little (in the
steady state of 1F1B the previous stage is busy when the gradient arrives) and cost time:
products computed after the pass find their operands out of cache. On one ``stack`` stage
(4 blocks of 256 x 1024, 128 positions, one thread) a pass took 11.5 ms, its input part 6.5
ms, and its 8 weight products 7-8 ms after it against about 5 ms inside it. With every
``B`` deferring, a 1F1B pp=2 ``stack`` step took 1.04x as long as without; with the last
ones only, 0.95x (``benchmarks/bench_fusion.py --fusion input-grads-first``, 6 rounds).

A *window* is a ``B`` (not part of an overlapped slot) and the instructions that follow it on
the same thread, while they are ``SEND``s or the ``B`` of a stage whose pass the first one
already ran (a fused loss backward, ``piper_runtime.rank.compute``); the products settle right
after the window's last ``SEND``, inside that instruction, before anything else of the thread
runs. Nothing in a window reads ``.grad``, and the per-weight order of the sums is unchanged,
so the gradients are bit for bit those of the undeferred run. A window needs at least one
``SEND``, and no instruction of it but the last may record an event another thread waits for
(such a reader, a data-parallel reduction on a lane of its own, might read the gradient before
the products are in it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from piper_ir import Instruction, NodeKind, Phase
from piper_runtime.rank.streams import StreamLayout


def deferral_windows(
    instructions: Sequence[Instruction],
    defers: Callable[[Instruction], bool],
    passes_with: Callable[[Instruction, Instruction], bool],
    layout: StreamLayout | None,
) -> dict[int, tuple[int, ...]]:
    """The rank's windows (module doc), one at most per segment, around its last ``B``: the
    index of each window's last ``SEND`` -> the indices of its ``B``s (the first one and the
    ones whose pass it ran). ``defers(b)``: ``b``'s
    pass runs through layers whose weight products can wait; ``passes_with(b, other)``:
    ``b``'s pass is ``other``'s too. ``layout``: the threads' layout, ``None`` for a plan run
    sequentially on one thread."""
    shared = frozenset(layout.events) if layout is not None else frozenset()
    lanes = layout.lanes if layout is not None else [None] * len(instructions)
    windows: dict[int, tuple[int, ...]] = {}
    claimed: set[int] = set()
    for k, ins in enumerate(instructions):
        if k in claimed or not _is_backward(ins) or not defers(ins):
            continue
        passes, last = [k], None
        for j in range(k + 1, len(instructions)):
            nxt = instructions[j]
            if lanes[j] != lanes[k]:
                continue  # another thread's (or a lazy receive, run by whichever needs it)
            if nxt.kind is NodeKind.SEND:
                last = j
            elif _is_backward(nxt) and passes_with(ins, nxt) and last is None:
                passes.append(j)
            else:
                break
        if last is None:
            continue
        inside = [*passes, *(j for j in range(k + 1, last) if instructions[j].kind is NodeKind.SEND and lanes[j] == lanes[k])]
        if any(instructions[j].record in shared for j in inside if instructions[j].record):
            continue
        windows[last] = tuple(passes)
        claimed.update(passes)
    final = {ins.segment: k for k, ins in enumerate(instructions) if _is_backward(ins)}  # each one's last B
    return {last: passes for last, passes in windows.items() if final[instructions[passes[-1]].segment] == passes[-1]}


def _is_backward(ins: Instruction) -> bool:
    return ins.kind is NodeKind.COMPUTE and ins.phase is Phase.B and ins.overlap is None
