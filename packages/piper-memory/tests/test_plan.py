"""plan_memory: the nodes and edges of ZeRO 0-3 (docs/ir-conventions.md, section 7), chains of
uses, an unchanged compute order; estimate_memory per zero level; check_budget."""

from __future__ import annotations

import attrs
import pytest

from piper_directives import Place, Replicate, Split, Strategy, build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_ir import (
    EdgeKind,
    ExecutionOptions,
    Graph,
    MemoryPlanError,
    NodeKind,
    Phase,
    Program,
    Residency,
    from_json,
    rank_orders,
    to_json,
)
from piper_memory import check_budget, estimate_memory, plan_memory, zero_residency
from piper_scheduler import compile_program

HIDDEN = 8
NUMEL = HIDDEN * HIDDEN + HIDDEN  # weight + bias of one synthetic segment
FULL, SHARD = NUMEL * 4, NUMEL * 4 // 2


def _placed(schedule: str = "1f1b", zero: int = 0, pp: int = 2, mb: int = 4, stages: int | None = None, **kw) -> Graph:
    regions = stages or pp
    graph = synthetic_graph(regions, mb, hidden=HIDDEN, batch=2, **kw)
    return build_schedule(schedule, pp, mb, stages=stages, dp=2, zero=zero).apply(graph)


def _kinds(graph: Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in graph.nodes:
        out[n.kind.value] = out.get(n.kind.value, 0) + 1
    return out


def _preds(graph: Graph, nid: str) -> set[str]:
    return {e.src for e in graph.predecessors[nid]}


def _succs(graph: Graph, nid: str) -> set[str]:
    return {e.dst for e in graph.successors[nid]}


def test_zero_0_reduces_once_per_bucket_after_every_backward() -> None:
    graph = plan_memory(_placed(zero=0))
    ar = graph.node("allreduce.bucket:s0:0")
    assert (ar.kind, ar.devices, ar.segment, ar.value, ar.stream) == (
        NodeKind.ALL_REDUCE, (0, 2), "s0", "bucket:s0:0", "dp"
    )
    assert _preds(graph, ar.id) == {f"B.s0.mb{i}" for i in range(4)}
    assert _succs(graph, ar.id) == {"OPT.s0"}
    assert _kinds(graph)["all_reduce"] == 2 and "reduce_scatter" not in _kinds(graph)


def test_zero_1_reduce_scatters_then_gathers_after_the_step() -> None:
    graph = plan_memory(_placed(zero=1))
    assert _preds(graph, "reducescatter.bucket:s1:0") == {f"B.s1.mb{i}" for i in range(4)}
    assert _succs(graph, "reducescatter.bucket:s1:0") == {"OPT.s1"}
    assert _preds(graph, "allgather.bucket:s1:0") == {"OPT.s1"}
    assert graph.node("allgather.bucket:s1:0").kind is NodeKind.ALL_GATHER


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_zero_2_reduce_scatters_each_microbatch_before_the_next_accumulates(schedule: str) -> None:
    graph = plan_memory(_placed(schedule, zero=2))
    grad = "BW" if schedule == "zb1p" else "B"
    order = [n for n in rank_orders(graph)[0] if graph.node(n).phase is (Phase.BW if grad == "BW" else Phase.B)]
    assert order == [f"{grad}.s0.mb{i}" for i in range(4)]
    for i in range(4):
        rs = f"reducescatter.bucket:s0:0.mb{i}"
        assert graph.node(rs).microbatch == i
        assert _preds(graph, rs) == {f"{grad}.s0.mb{i}"}
        nxt = {f"{grad}.s0.mb{i + 1}"} if i < 3 else set()
        assert _succs(graph, rs) == {"OPT.s0"} | nxt
        for e in graph.successors[rs]:
            assert e.kind is (EdgeKind.TEMPORAL if e.dst != "OPT.s0" else EdgeKind.DATA)
    assert _preds(graph, "allgather.bucket:s0:0") == {"OPT.s0"}


def test_zero_3_one_segment_per_rank_is_one_chain() -> None:
    graph = plan_memory(_placed("1f1b", zero=3))
    kinds = _kinds(graph)
    assert "all_gather" not in kinds
    assert kinds["materialize"] == kinds["free"] == 2  # one chain per bucket: nothing else needs the rank
    uses = {n.id for n in graph.nodes if n.segment == "s1" and n.kind is NodeKind.COMPUTE}
    assert _succs(graph, "materialize.bucket:s1:0.0") == uses
    assert _preds(graph, "free.bucket:s1:0.0") == uses


def test_zero_3_chains_break_at_another_segment_but_not_at_the_loss() -> None:
    # One rank pair, two regions: F s0, F s1, loss F/B, B s1, B s0 (GPipe, one microbatch).
    graph = synthetic_graph(2, 1, hidden=HIDDEN, batch=2)
    strategy = Strategy([Split(1), Place({"PP": "*"}, (0, 1)), Replicate({"PP": "*"}, (0, 1), zero=3)])
    planned = plan_memory(strategy.apply(graph))
    assert _succs(planned, "materialize.bucket:s1:0.0") == {"F.s1.mb0", "B.s1.mb0"}  # F and its B share a gather
    assert _succs(planned, "materialize.bucket:s0:0.0") == {"F.s0.mb0"}
    assert _succs(planned, "materialize.bucket:s0:0.1") == {"B.s0.mb0"}
    # s0's second gather waits for its first free, and for s1's free (one segment gathered at a time).
    assert _preds(planned, "materialize.bucket:s0:0.1") >= {"free.bucket:s0:0.0", "free.bucket:s1:0.0", "B.s1.mb0"}
    assert _preds(planned, "materialize.bucket:s1:0.0") >= {"free.bucket:s0:0.0", "F.s0.mb0"}
    program = compile_program(planned)
    ops = [(i.kind.value, i.value, i.segment, i.phase) for i in program.ranks[0].instructions]
    assert [o[0] for o in ops] == [
        "materialize", "compute", "free", "materialize", "compute", "compute", "compute", "compute",
        "reduce_scatter", "free", "materialize", "compute", "reduce_scatter", "free", "optimizer", "optimizer",
    ]


def test_zero_3_several_buckets_each_get_a_chain() -> None:
    graph = synthetic_graph(1, 2, hidden=HIDDEN, batch=2)
    tiny = (HIDDEN * HIDDEN * 4) / 2**20  # the weight fills a bucket, the bias gets the next
    strategy = Strategy([Split(2), Place({"PP": 0}, (0, 1)), Replicate({"PP": 0}, (0, 1), zero=3, bucket_mb=tiny)])
    planned = plan_memory(strategy.apply(graph))
    assert {n.id for n in planned.nodes if n.kind is NodeKind.MATERIALIZE} == {
        "materialize.bucket:s0:0.0", "materialize.bucket:s0:1.0"
    }
    assert _kinds(planned)["reduce_scatter"] == 4  # 2 buckets x 2 microbatches


@pytest.mark.parametrize(
    ("schedule", "stages", "mb"),
    [("gpipe", 2, 4), ("1f1b", 2, 4), ("zb1p", 2, 4), ("interleaved_1f1b", 4, 4), ("dualpipev", 4, 4)],
)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_planning_keeps_the_compute_order(schedule: str, stages: int, mb: int, zero: int) -> None:
    placed = _placed(schedule, zero=zero, stages=stages, mb=mb)
    planned = plan_memory(placed)
    before = compile_program(placed)
    after = compile_program(planned)

    def computes(program: Program, rank: int) -> list[str]:
        return [i.id for i in program.ranks[rank].instructions if i.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER)]

    for rank in range(4):
        assert computes(after, rank) == computes(before, rank)
    # Every use of a ZeRO-3 segment lies between a materialization and its free on every member.
    if zero == 3:
        for plan in after.ranks:
            live: set[str] = set()
            for ins in plan.instructions:
                if ins.kind is NodeKind.MATERIALIZE:
                    assert ins.value not in live
                    live.add(ins.value)
                elif ins.kind is NodeKind.FREE:
                    live.remove(ins.value)
                elif ins.kind is NodeKind.COMPUTE and ins.segment != "loss":
                    assert f"bucket:{ins.segment}:0" in live, (plan.rank, ins.id)
            assert not live
            # one segment's parameters gathered at a time
        assert after.ranks[0].replica == 0 and after.ranks[2].replica == 1


@pytest.mark.parametrize("zero", [2, 3])
def test_dualpipe_zero_2_3_plans_each_direction_and_sums_shards_over_the_mirror(zero: int) -> None:
    """DualPipe x DP=2: stage s runs direction 0 on (s, s+2), direction 1 on (1-s, 3-s). Each
    direction reduce-scatters (and gathers) its own buckets over its own ranks, per microbatch;
    the ranks holding one shard range in both directions sum its gradient before the step."""
    placed = _placed("dualpipe", zero=zero)
    planned = plan_memory(placed)
    half = [f"reducescatter.bucket:s0:d0:0.mb{i}" for i in (0, 1)]
    other = [f"reducescatter.bucket:s0:d1:0.mb{i}" for i in (2, 3)]
    assert [planned.node(n).devices for n in half + other] == [(0, 2)] * 2 + [(1, 3)] * 2
    for rs, mb in zip(half + other, range(4), strict=True):  # its microbatch's B or BW
        assert [p.rsplit(".", 2)[1:] for p in _preds(planned, rs)] == [["s0", f"mb{mb}"]]
    for j, pair in ((0, (0, 1)), (1, (2, 3))):
        ar = planned.node(f"allreduce.bucket:s0:d0:0.{j}")
        assert (ar.kind, ar.devices, ar.value, ar.stream) == (NodeKind.ALL_REDUCE, pair, "bucket:s0:d0:0", "dp")
        assert _preds(planned, ar.id) == set(half + other) and _succs(planned, ar.id) == {"OPT.s0"}
    s1 = planned.node("allreduce.bucket:s1:d0:0.0")
    assert s1.devices == (0, 1)  # rank 1 runs s1's direction 0, rank 0 its direction 1
    gathers = {n.id: n.devices for n in planned.nodes if n.kind is NodeKind.ALL_GATHER}
    materialized = {n.devices for n in planned.nodes if n.kind is NodeKind.MATERIALIZE and n.segment == "s0"}
    if zero == 2:
        assert gathers == {
            "allgather.bucket:s0:d0:0": (0, 2), "allgather.bucket:s0:d1:0": (1, 3),
            "allgather.bucket:s1:d0:0": (1, 3), "allgather.bucket:s1:d1:0": (0, 2),
        }
    else:
        assert not gathers and materialized == {(0, 2), (1, 3)}
    program = compile_program(planned)  # verified: no deadlock, one collective order per group

    def computes(p: Program, rank: int) -> list[str]:
        return [i.id for i in p.ranks[rank].instructions if i.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER)]

    before = compile_program(placed)
    assert all(computes(program, r) == computes(before, r) for r in range(4))
    est = estimate_memory(program, "adamw")
    for rank in range(4):  # every rank holds two stages (one per direction), each sharded 2 ways
        e = est[rank]
        assert (e.param_bytes, e.grad_bytes, e.optimizer_state_bytes) == (
            2 * (FULL if zero == 2 else SHARD), 2 * SHARD, 4 * SHARD
        )
        assert e.materialized_bytes == (FULL if zero == 3 else 0)


@pytest.mark.parametrize(
    ("zero", "homes"),
    [
        (0, ("full", "full", "full")),
        (1, ("full", "full", "sharded")),
        (2, ("full", "sharded", "sharded")),
        (3, ("sharded", "sharded", "sharded")),
    ],
)
def test_buckets_say_where_their_state_lives(zero: int, homes: tuple[str, str, str]) -> None:
    """What the runtime reads instead of the ZeRO level: (parameters, gradients, optimizer
    state) of every bucket, carried into the program and through its JSON form."""
    placed = _placed(zero=zero)
    assert {(b.params_home, b.grads_home, b.optimizer_home) for b in placed.buckets} == {("full",) * 3}
    planned = plan_memory(placed)
    assert planned.buckets and {(b.params_home, b.grads_home, b.optimizer_home) for b in planned.buckets} == {homes}
    assert {k: v.value for k, v in zero_residency(zero).items()} == dict(
        zip(("params_home", "grads_home", "optimizer_home"), homes, strict=True)
    )
    program = compile_program(planned)
    assert program.buckets == planned.buckets
    assert from_json(to_json(program)) == program


def test_residency_follows_the_zero_ladder() -> None:
    bucket = _placed(zero=0).buckets[0]
    with pytest.raises(ValueError, match="parameters full, gradients sharded, optimizer state full"):
        attrs.evolve(bucket, grads_home=Residency.SHARDED)
    with pytest.raises(ValueError, match="parameters sharded, gradients full, optimizer state sharded"):
        attrs.evolve(bucket, params_home="sharded", optimizer_home="sharded")
    with pytest.raises(MemoryPlanError, match="ZeRO level 4"):
        zero_residency(4)


def test_plan_is_pure_and_refuses_a_second_run() -> None:
    placed = _placed(zero=2)
    planned = plan_memory(placed)
    assert len(planned.nodes) > len(placed.nodes) and placed == _placed(zero=2)
    with pytest.raises(MemoryPlanError, match="already memory-planned"):
        plan_memory(planned)
    plain = build_schedule("1f1b", 2, 2).apply(synthetic_graph(2, 2, hidden=HIDDEN))
    assert plan_memory(plain) is plain


# --- estimates --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("zero", "params", "grads", "state", "gathered", "unreduced"),
    [
        (0, FULL, FULL, 2 * FULL, 0, 0),
        (1, FULL, FULL, 2 * SHARD, 0, 0),
        (2, FULL, SHARD, 2 * SHARD, 0, FULL),
        (3, SHARD, SHARD, 2 * SHARD, FULL, FULL),
    ],
)
def test_estimate_divides_model_state_by_the_replicas(zero, params, grads, state, gathered, unreduced) -> None:
    program = compile_program(plan_memory(_placed(zero=zero)))
    est = estimate_memory(program, "adamw")
    assert set(est) == {0, 1, 2, 3}
    for rank in range(4):
        e = est[rank]
        assert (e.param_bytes, e.grad_bytes, e.optimizer_state_bytes, e.materialized_bytes, e.grad_buffer_bytes) == (
            params, grads, state, gathered, unreduced
        )
        assert e.total_bytes == e.model_state_bytes + e.peak_activation_bytes
    assert est[0].peak_activation_bytes == est[2].peak_activation_bytes > 0


def _small_buckets(schedule: str, zero: int) -> Graph:
    """A planned 2 x 2 graph whose segments have two buckets each (weight, bias)."""
    strategy = build_schedule(schedule, 2, 4, dp=2, zero=zero)
    directives = [attrs.evolve(d, bucket_mb=0.003) if isinstance(d, Replicate) else d for d in strategy.directives]
    graph = plan_memory(attrs.evolve(strategy, directives=directives).apply(synthetic_graph(2, 4, hidden=64, batch=2)))
    assert len([b for b in graph.buckets if b.segment == "s0"]) == 2
    return graph


def test_the_estimate_reads_the_programs_execution_options() -> None:
    """Receives posted ahead and early reduce-scatters in flight cost communication memory;
    the estimate takes both from ``Program.execution`` (the runtime obeys the same)."""
    graph = _small_buckets("1f1b", zero=2)

    def comm(**options: int) -> int:
        program = compile_program(graph, ExecutionOptions(**options))
        assert program.execution == ExecutionOptions(**options)
        return max(e.communication_bytes for e in estimate_memory(program).values())

    assert compile_program(graph).execution == ExecutionOptions()
    assert comm(recv_lookahead=0) < comm(recv_lookahead=2)
    assert comm(reduce_scatters_in_flight=0) < comm(reduce_scatters_in_flight=2)


def test_check_budget() -> None:
    program = compile_program(plan_memory(_placed(zero=3)))
    estimates = check_budget(program, 10 * 2**20)
    need = max(e.total_bytes for e in estimates.values())
    with pytest.raises(MemoryPlanError, match=r"rank 0: .*parameters .*gathered parameters") as err:
        check_budget(program, need - 1)
    assert set(err.value.ranks) <= {0, 1, 2, 3} and 0 in err.value.ranks
    assert "exceeds the per-rank budget" in str(err.value)
    with pytest.raises(MemoryPlanError, match="must be a positive number"):
        check_budget(program, 0)
