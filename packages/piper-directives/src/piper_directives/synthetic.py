"""``synthetic_graph``: a captured training DAG of a made-up model, built without torch.

The graph is what ``capture`` would return for a chain of ``stages * segments_per_stage``
annotated linear layers (docs/ir-conventions.md, section 1): segments ``s0, s1, ...`` in chain
order, the ``k``-th tagged ``{"PP": k // segments_per_stage}``, each mapping the previous
segment's output (``input:0`` for ``s0``) to ``v:s<k>``, plus the ``loss`` segment reading the
last output and ``target:0``. Every segment has F, B and OPT nodes, the loss F and B. There is
no code behind the segments (``Segment.code`` is ``None``), so the graph can be scheduled,
compiled and simulated but not run. Scale benchmarks and the ``piper simulate`` command use
it: the real directive passes (``build_schedule(...).apply(graph)``) run on it unchanged.

This module imports only ``piper_ir``.
"""

from __future__ import annotations

from piper_directives.training_graph import training_graph
from piper_ir import Graph, Segment, SegmentRole, Tags, TensorMeta, Value, grad_name

LOSS = "loss"


def synthetic_graph(
    stages: int,
    microbatches: int = 1,
    segments_per_stage: int = 1,
    *,
    hidden: int = 1024,
    batch: int = 1,
    dtype: str = "float32",
    tag: str = "PP",
) -> Graph:
    """A captured single-device graph of ``stages`` regions of ``segments_per_stage`` segments.

    ``batch`` is the batch size of one microbatch: the full batch holds
    ``batch * microbatches`` samples, so ``Split(microbatches)`` divides it evenly. Activations
    are ``(batch * microbatches, hidden)``; each segment owns a ``(hidden, hidden)`` weight and
    a ``(hidden,)`` bias.
    """
    for name, v in (("stages", stages), ("microbatches", microbatches), ("segments_per_stage", segments_per_stage),
                    ("hidden", hidden), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"synthetic_graph: {name} must be a positive int, got {v!r}")
    rows = batch * microbatches
    activation = TensorMeta((rows, hidden), dtype, batch_dim=0, requires_grad=True)
    batch_meta = TensorMeta((rows, hidden), dtype, batch_dim=0, requires_grad=False)
    weight = TensorMeta((hidden, hidden), dtype, None, True)
    bias = TensorMeta((hidden,), dtype, None, True)

    count = stages * segments_per_stage
    values = [Value("input:0", batch_meta)]
    segments: list[Segment] = []
    for k in range(count):
        src = "input:0" if k == 0 else f"v:s{k - 1}"
        segments.append(
            Segment(
                id=f"s{k}",
                role=SegmentRole.STAGE,
                tags=Tags(((tag, k // segments_per_stage),)),
                inputs=(src,),
                outputs=(f"v:s{k}",),
                params=((f"layers.{k}.weight", weight), (f"layers.{k}.bias", bias)),
                source="synthetic",
            )
        )
        values.append(Value(f"v:s{k}", activation))
    last = f"v:s{count - 1}"
    values.append(Value("target:0", batch_meta))
    segments.append(Segment(LOSS, SegmentRole.LOSS, Tags(), (last, "target:0"), (), (), None))
    # capture adds gradient values after all others, in value order, for produced values.
    values += [Value(grad_name(f"v:s{k}"), activation) for k in range(count)]

    return training_graph(segments, values, ["input:0"], ["target:0"])
