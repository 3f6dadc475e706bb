"""What the IR-only estimate (no profiled ``activation_bytes``) counts for a tensor-parallel
rank whose loss is vocabulary-parallel: the logits it reads are one rank's slice, which the IR
records whole (``estimate._vocabulary_sliced``)."""

from __future__ import annotations

import attrs
import pytest

from piper_directives import one_f_one_b, tensor_parallel
from piper_directives.synthetic import synthetic_graph
from piper_memory import estimate_memory, plan_memory
from piper_scheduler import compile_program


def _program(loss_collectives: int):
    graph = tensor_parallel(one_f_one_b(1, 2), 2).apply(synthetic_graph(1, 2, 1, hidden=16, batch=2))
    sharding = tuple(attrs.evolve(sh, collectives=loss_collectives if sh.segment == "loss" else 1)
                     for sh in graph.sharding)
    return compile_program(plan_memory(attrs.evolve(graph, sharding=sharding)))


@pytest.mark.parametrize("rank", [0, 1])
def test_logits_a_vocabulary_parallel_loss_reads_count_as_one_ranks_slice(rank):
    whole, sliced = _program(0), _program(1)  # the loss cut by vocabulary issues its all-reduce
    loss = sliced.segment_by_id["loss"]
    logits = [v for v in loss.inputs if v not in sliced.targets]
    assert logits
    per_mb = sum(sliced.value_by_name[v].meta.nbytes() for v in logits)
    # one stage, 1F1B: one microbatch's outputs held at a time
    a, b = estimate_memory(whole)[rank], estimate_memory(sliced)[rank]
    assert a.peak_activation_bytes - b.peak_activation_bytes == per_mb // 2
    assert a.param_bytes == b.param_bytes
