"""The replay's fast loop (``_RankReplay.run``: running sums and two peaks in local names, the
tallies' pops and stores written out in ``_compute``) against the plain replay it stands
for: every instruction applied, then ``_sample`` after it, on the library schedules with
data parallelism and ZeRO. The peaks must be equal, and every tally's running total must be
the sum of what it holds at the end."""

from __future__ import annotations

import attrs
import pytest

from piper_directives import Replicate
from piper_directives.schedules import build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_memory import estimate_memory, plan_memory
from piper_memory.estimate import (
    BUCKET_KINDS,
    COMPUTE,
    OPTIMIZER,
    OPTIMIZER_STATE_FACTOR,
    RECV,
    SEND,
    _RankReplay,
)
from piper_scheduler import compile_program


class _PlainReplay(_RankReplay):
    """Each instruction's change through the tallies' own methods, then a full sample."""

    def run(self):  # type: ignore[override]
        self._sample(-1)
        for k, ins in enumerate(self.instructions):
            self.position = k
            nbytes = ins.meta.nbytes() if ins.meta is not None else 0
            if ins.kind is SEND:
                self.sent += nbytes
            elif ins.kind is RECV:
                self.received[(ins.value, ins.microbatch)] = nbytes
            elif ins.kind is COMPUTE:
                self._compute(ins)
            elif ins.kind is OPTIMIZER:
                for key in self.full.get(ins.segment, {}):
                    self.grads.pop(key, None)
                    self.grad_shards.pop(key, None)
            elif ins.kind in BUCKET_KINDS:
                self._bucket_op(k, ins)
            self._sample(k)
        return dict(self.peaks)


# (schedule, pipeline ranks, microbatches, stages, dp, ZeRO level, planned with small buckets:
# ``plan_memory`` shards the gradients of ZeRO 2, whose reduce-scatters start in the backward)
CASES = [
    ("1f1b", 4, 8, None, 1, 0, False),
    ("gpipe", 4, 8, None, 1, 0, False),
    ("zb1p", 4, 8, None, 2, 2, False),
    ("interleaved_1f1b", 2, 4, 4, 2, 3, False),
    ("dualpipev", 2, 4, 4, 2, 1, False),
    ("1f1b", 2, 4, None, 2, 2, True),
    ("zb1p", 2, 4, None, 2, 3, True),
]


@pytest.mark.parametrize(("name", "pp", "m", "stages", "dp", "zero", "planned"), CASES)
def test_the_fast_replay_gives_the_plain_replays_peaks(name, pp, m, stages, dp, zero, planned):
    strategy = build_schedule(name, pp, m, stages=stages, dp=dp, zero=zero)
    if planned:  # two buckets per segment
        strategy = attrs.evolve(strategy, directives=[
            attrs.evolve(d, bucket_mb=0.003) if isinstance(d, Replicate) else d for d in strategy.directives
        ])
    graph = strategy.apply(synthetic_graph(stages or pp, m, 1, hidden=64, batch=2 if dp > 1 else 1))
    program = compile_program(plan_memory(graph) if planned else graph)
    estimates = estimate_memory(program)
    factor = OPTIMIZER_STATE_FACTOR["adamw"]
    for plan in program.ranks:
        fast = _RankReplay(program, plan.rank, factor, None)
        fast.run()
        plain = _PlainReplay(program, plan.rank, factor, None).run()
        assert fast.peaks == plain, f"rank {plan.rank}"
        assert estimates[plan.rank].peak_bytes == plain["total"]
        for tally in (fast.grads, fast.grad_shards, fast.gathered, fast.acts, fast.received, fast.inflight):
            assert tally.total == sum(tally.values())
    assert any(e.communication_bytes for e in estimates.values())  # the transfers were counted
    if planned:  # the reduce-scatters in flight were replayed
        assert any(_RankReplay(program, plan.rank, factor, None).early for plan in program.ranks)
