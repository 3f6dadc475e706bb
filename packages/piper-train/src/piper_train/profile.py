"""What one forward of each segment keeps for its backward, measured once on one process: the
activation profile ``piper_memory.estimate_memory(..., activation_bytes=...)`` takes.

Without a profile the estimate counts a segment's outputs only (the IR does not describe a
segment's interior), a lower bound that keeps its shape across schedules; a profile makes it
match what the runtime holds (``piper_runtime.rank.memory``): the distinct storages autograd saves
plus the forward's inputs and outputs, less parameters and the batch. A recomputed segment
(``Segment.recompute``) is profiled the same way: its full forward is what its backward
holds while it runs; the estimate counts only its inputs between the two passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from piper_ir import Program, Segment


def activation_bytes(
    program: Program,
    modules: Mapping[str, nn.Module],
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
) -> dict[str, int]:
    """Segment id -> bytes one forward of one microbatch shard keeps for its backward, run on
    the first microbatch shard of the batch ``(inputs, targets)`` (whole batches, as
    ``Runtime.step`` takes them)."""
    shard = program.microbatches * program.replicas
    values = {
        n: t[: t.shape[0] // shard]
        for n, t in zip((*program.inputs, *program.targets), (*inputs, *targets), strict=True)
    }
    return forward_kept_bytes(program.segments, modules, values)


def forward_kept_bytes(
    segments: Sequence[Segment], modules: Mapping[str, nn.Module], values: Mapping[str, torch.Tensor]
) -> dict[str, int]:
    """Segment id -> the bytes its forward keeps (module doc), running ``segments`` in
    dataflow order on ``values`` (the batch's tensors by name; the batch itself is not
    counted)."""
    values = dict(values)
    batch = {t.untyped_storage().data_ptr() for t in values.values()}
    out: dict[str, int] = {}
    with torch.random.fork_rng(devices=[]):
        for seg in segments:  # in dataflow order
            module = modules[seg.id]
            args = [
                values[n].detach().requires_grad_(True) if values[n].is_floating_point() else values[n]
                for n in seg.inputs
            ]
            saved: list[torch.Tensor] = []

            def pack(t: torch.Tensor, saved: list = saved) -> torch.Tensor:
                saved.append(t.detach())
                return t

            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                result = module(*args)
            outs = (result,) if isinstance(result, torch.Tensor) else tuple(result)
            seen = batch | {p.untyped_storage().data_ptr() for p in module.parameters()}
            total = 0
            for t in (*saved, *args, *outs):
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            out[seg.id] = total
            for name, o in zip(seg.outputs, outs):  # noqa: B905 - the loss may name no output
                values[name] = o.detach()
    return out
