"""What one rank holds, by category, handed to its ``MemoryTracker`` (``piper_runtime.rank.memory``).

Accounting is opt-in per step (``begin(..., active=True)``, the worker's ``memory``
argument): listing what a rank holds after every instruction cost more than the bookkeeping
of running it. In a step without it, ``sample`` returns at once, the executor does not call
it, and forwards do not track what autograd saves.

``MemorySampler.sample`` is called after every instruction of an accounted step and, by the
bucket operations, inside collectives while their buffers are alive. It lists the tensors of
each category:

- parameters: every module parameter except those whose memory is the flat buffer of a
  bucket with sharded parameters (communication while gathered), plus the bucket shards;
- gradients: the parameters' and the shards' ``.grad``;
- optimizer state: the optimizers' state tensors;
- communication: gathered flat buffers, posted receive buffers, unfinished sends, received
  values still held, and the buffers of the collective running now;
- activations: what autograd saved for a backward (weakly tracked), the saved inputs and
  outputs of forwards, what a split backward keeps for its ``BW``, and local values.

Model state changes only in backward, optimizer and bucket instructions: after the others
(``keeps_model_state``) the model-state categories of the previous sample are reused,
which keeps sampling cheap. The lists are taken under the gradient lock (model state) and
the step's lock, since other lanes change them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from piper_ir import Instruction, NodeKind, Phase
from piper_runtime.rank.memory import MemoryTracker
from piper_runtime.rank.state import StepState

if TYPE_CHECKING:  # what it reads; the worker wires them
    from piper_runtime.rank.data_parallel import DataParallel
    from piper_runtime.rank.optimizers import Optimizers


def keeps_model_state(ins: Instruction) -> bool:
    """Instructions that never change parameters, gradients or optimizer state."""
    return ins.kind in (NodeKind.SEND, NodeKind.RECV, NodeKind.MARKER) or (
        ins.kind is NodeKind.COMPUTE and ins.phase is Phase.F
    )


class MemorySampler:
    """Samples one rank's holdings into ``tracker`` (module doc)."""

    def __init__(
        self,
        tracker: MemoryTracker,
        grads_lock: threading.RLock,
        params: Iterable[nn.Parameter],
        data_parallel: DataParallel,
        optimizers: Optimizers,
    ) -> None:
        self.tracker = tracker
        self.grads_lock = grads_lock
        self.params = list(params)
        self.data_parallel = data_parallel
        self.optimizers = optimizers
        self.current: StepState | None = None  # the step running now, for ``sample_now``
        self.active = False  # whether the step running now is accounted

    def begin(
        self, st: StepState, excluded: Iterable[torch.Tensor], active: bool = True, timeline_from: float | None = None
    ) -> None:
        """Start a step's peaks; ``excluded`` (the batch) is never counted. With
        ``active=False`` the step is not accounted: every sample is skipped. ``timeline_from``:
        keep every sample, timed from this ``perf_counter`` value (``MemoryTracker.record_timeline``)."""
        self.current = st
        self.active = active
        self.tracker.reset(excluded=excluded if active else ())
        if timeline_from is not None:
            self.tracker.record_timeline(timeline_from)
        if active:
            self.sample(st)

    def end(self) -> None:
        self.current = None
        self.active = False

    def sample_now(self, buffers: list[torch.Tensor]) -> None:
        """``sample`` in the step running now (from gradient hooks, which do not know it)."""
        if self.current is not None:
            self.sample(self.current, *buffers)

    def sample(self, st: StepState, *buffers: torch.Tensor, model_state: bool = True) -> None:
        """Record what this rank holds now; ``buffers`` are a collective's live buffers.
        With ``model_state=False`` the parameters, gradients and optimizer state counted at
        the previous sample are taken as unchanged."""
        if not self.active:
            return
        dp = self.data_parallel
        with self.grads_lock if model_state else contextlib.nullcontext(), st.lock:
            held: dict[str, list] = {}
            if model_state:
                params = [p for p in self.params if id(p) not in dp.gathered_ids]
                shards = dp.shards()
                held["parameters"] = params + shards
                held["gradients"] = [p.grad for p in self.params] + [s.grad for s in shards]
                held["optimizer_state"] = self.optimizers.state_tensors()
            # Other threads change these dicts: ``list(...)`` copies each one atomically.
            comm = dp.gathered_buffers()
            comm += [t for _work, t in list(st.posted.values())] + [t for _work, t in list(st.sends)]
            values = list(st.values.items())
            received = set(st.received)
            comm += [t for k, t in values if k in received]
            comm += buffers
            acts = [t for refs in list(st.autograd_saved.values()) for r in refs if (t := r()) is not None]
            for args, outs in list(st.saved.values()):
                acts += args
                acts += outs or ()
            for outs, grads in list(st.pending_bw.values()):
                acts += outs
                acts += grads or []
            acts += [t for k, t in values if k not in received]
            held["communication"] = comm
            held["activations"] = acts
            self.tracker.sample(held, model_state=model_state)
