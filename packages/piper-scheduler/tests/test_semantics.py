"""verify refuses plans that would run but compute the wrong thing: one broken plan per rule,
each error naming the rank, the instruction and the rule. The first five are the plans that
``piper show`` used to print as verified (issue 34)."""

from __future__ import annotations

import attrs
import pytest

from piper_directives import build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_ir import Instruction, NodeKind, Phase, Program, SchedulingError, TensorMeta
from piper_memory import add_grad_norm, plan_memory
from piper_scheduler import compile_program, forward_only, verify
from piper_scheduler.testing import pipeline_graph

PP = compile_program(pipeline_graph(2, 4, "1f1b"))


def _plans(program: Program, rank: int, instructions: list[Instruction]) -> Program:
    ranks = list(program.ranks)
    ranks[rank] = attrs.evolve(ranks[rank], instructions=instructions)
    return attrs.evolve(program, ranks=ranks)


def _at(program: Program, rank: int, id: str) -> int:
    return next(i for i, ins in enumerate(program.ranks[rank].instructions) if ins.id == id)


def _refused(program: Program, *parts: str) -> str:
    with pytest.raises(SchedulingError) as err:
        verify(program)
    text = str(err.value)
    for part in parts:
        assert part in text, text
    return text


def _without(program: Program, drop) -> Program:
    """``program`` without the instructions ``drop`` selects, and without waits on the
    events they recorded (so only the new rules can notice)."""
    gone = {ins.record for plan in program.ranks for ins in plan.instructions if drop(plan.rank, ins)}
    ranks = [
        attrs.evolve(plan, instructions=[attrs.evolve(ins, waits=[e for e in ins.waits if e not in gone])
                                         for ins in plan.instructions if not drop(plan.rank, ins)])
        for plan in program.ranks
    ]
    return attrs.evolve(program, ranks=ranks)


def test_the_base_plans_verify() -> None:
    verify(PP)


def test_a_microbatch_removed_everywhere_is_refused() -> None:
    bad = _without(PP, lambda rank, ins: ins.microbatch == 3)
    _refused(bad, "segment s0 runs no forward of microbatch 3 on any rank", "[every microbatch]")


def test_a_missing_optimizer_step_is_refused() -> None:
    bad = _without(PP, lambda rank, ins: rank == 0 and ins.kind is NodeKind.OPTIMIZER)
    _refused(bad, "rank 0 stream 'compute' instruction 15 B.s0.mb3 (s0:B3) computes gradients of segment s0's",
             "rank 0 never runs the optimizer step s0:OPT", "[optimizer after backward]")


def test_a_backward_run_twice_is_refused() -> None:
    plan = list(PP.ranks[0].instructions)
    i = _at(PP, 0, "B.s0.mb1")
    plan.insert(i + 1, attrs.evolve(plan[i], id="B.s0.mb1.again"))
    _refused(_plans(PP, 0, plan), "instruction 10 B.s0.mb1.again (s0:B1) runs s0:B1 a second time on rank 0",
             "instruction 9 (B.s0.mb1) runs it already", "[once]", "B.s0.mb1.again  <-- here")


def test_a_loss_backward_before_its_forward_is_refused() -> None:
    plan = list(PP.ranks[1].instructions)
    f, b = _at(PP, 1, "F.loss.mb0"), _at(PP, 1, "B.loss.mb0")
    plan[f], plan[b] = plan[b], plan[f]
    _refused(_plans(PP, 1, plan), "rank 1 stream 'compute' instruction 2 B.loss.mb0 (loss:B0) runs before "
             "instruction 3 (F.loss.mb0), its forward loss:F0", "[backward after forward]")


def test_a_relabelled_microbatch_is_refused() -> None:
    # A pass labelled with another microbatch runs that one twice.
    i = _at(PP, 0, "F.s0.mb1")
    plan = list(PP.ranks[0].instructions)
    plan[i] = attrs.evolve(plan[i], microbatch=2)
    _refused(_plans(PP, 0, plan), "F.s0.mb2 (s0:F2) runs s0:F2 a second time on rank 0",
             "instruction 2 (F.s0.mb1) runs it already", "[once]")
    # A message relabelled on both ends: its consumer reads microbatch 1, which never arrives.
    relabelled = PP
    for rank, id in ((0, "send.v:s0.mb1.0-1"), (1, "recv.v:s0.mb1.0-1")):
        plan = list(relabelled.ranks[rank].instructions)
        i = _at(relabelled, rank, id)
        plan[i] = attrs.evolve(plan[i], microbatch=2)
        relabelled = _plans(relabelled, rank, plan)
    _refused(relabelled, "rank 0 stream 'pp' instruction 3 send.v:s0.mb1.0-1 (SEND v:s0#2 ->1) runs before "
             "instruction 6 (F.s0.mb2), which yields the v:s0#2 it reads", "[dataflow]")


def test_a_message_of_another_shape_than_its_value_is_refused() -> None:
    other = TensorMeta((3, 8), "float32", batch_dim=0, requires_grad=True)
    reshaped = PP
    for rank, id in ((0, "send.v:s0.mb0.0-1"), (1, "recv.v:s0.mb0.0-1")):
        plan = list(reshaped.ranks[rank].instructions)
        i = _at(reshaped, rank, id)
        plan[i] = attrs.evolve(plan[i], meta=other)
        reshaped = _plans(reshaped, rank, plan)
    _refused(reshaped, "send.v:s0.mb0.0-1 (SEND v:s0#0 ->1) moves [3, 8]/float32 but value v:s0 is [2, 8]/float32",
             "[shape]")


def test_a_send_that_does_not_wait_for_its_producer_is_refused() -> None:
    """The sequential order is right, but a threaded runtime would send before the forward
    ends: the event was the only link between the two streams."""
    i = _at(PP, 0, "send.v:s0.mb0.0-1")
    plan = list(PP.ranks[0].instructions)
    plan[i] = attrs.evolve(plan[i], waits=())
    _refused(_plans(PP, 0, plan), "send.v:s0.mb0.0-1 (SEND v:s0#0 ->1) runs before instruction 0 (F.s0.mb0)",
             "[dataflow]")


def test_a_gradient_send_that_does_not_wait_for_its_backward_is_refused() -> None:
    i = _at(PP, 1, "send.grad:v:s0.mb0.1-0")
    plan = list(PP.ranks[1].instructions)
    plan[i] = attrs.evolve(plan[i], waits=())
    _refused(_plans(PP, 1, plan), "send.grad:v:s0.mb0.1-0 (SEND grad:v:s0#0 ->0) runs before instruction 4 "
             "(B.s1.mb0), which yields the grad:v:s0#0 it reads", "[dataflow]")


def test_a_forward_that_reads_nothing_is_refused() -> None:
    bad = _without(PP, lambda rank, ins: ins.id in ("send.v:s0.mb0.0-1", "recv.v:s0.mb0.0-1"))
    _refused(bad, "F.s1.mb0 (s1:F0) reads v:s0#0, which rank 1 neither computes nor receives", "[dataflow]")


def test_a_backward_before_its_gradient_arrives_is_refused() -> None:
    plan = list(PP.ranks[0].instructions)
    r, b = _at(PP, 0, "recv.grad:v:s0.mb0.1-0"), _at(PP, 0, "B.s0.mb0")
    plan[b] = attrs.evolve(plan[b], waits=())
    plan.insert(r, plan.pop(b))
    _refused(_plans(PP, 0, plan), "B.s0.mb0 (s0:B0) runs before instruction 5 (recv.grad:v:s0.mb0.1-0), which yields "
             "the grad:v:s0#0 it reads", "[dataflow]")


def test_a_forward_without_its_backward_is_refused() -> None:
    bad = _without(PP, lambda rank, ins: ins.id == "B.loss.mb2")
    _refused(bad, "F.loss.mb2 (loss:F2) has no backward on rank 1", "[backward after forward]")


def test_replicas_run_each_microbatch_once_and_all_of_them() -> None:
    dp = compile_program(plan_memory(build_schedule("1f1b", 2, 2, dp=2).apply(synthetic_graph(2, 2, 1, hidden=4, batch=2))))
    verify(dp)
    same_replica = attrs.evolve(dp, ranks=[attrs.evolve(p, replica=0) for p in dp.ranks])
    _refused(same_replica, "rank 2 stream 'compute' instruction", "(s0:F0) runs s0:F0, which rank 0 runs already "
             "(F.s0.mb0), both as replica 0", "[once]")
    bad = _without(dp, lambda rank, ins: rank in (2, 3) and ins.microbatch == 1 and ins.kind is not NodeKind.REDUCE_SCATTER)
    _refused(bad, "segment s0 runs its forward of microbatch 1 on ranks [0] but not as replica 1", "[every microbatch]")


def test_split_backward_halves_run_in_order() -> None:
    zb = compile_program(build_schedule("zb1p", 2, 4).apply(synthetic_graph(2, 4, 1, hidden=4, batch=2)))
    verify(zb)
    plan = list(zb.ranks[0].instructions)
    bi, bw = _at(zb, 0, "BI.s0.mb0"), _at(zb, 0, "BW.s0.mb0")
    plan[bi], plan[bw] = plan[bw], plan[bi]
    _refused(_plans(zb, 0, plan), "BW.s0.mb0 (s0:BW0) runs before instruction", "(BI.s0.mb0), the input half s0:BI0 "
             "it continues", "[backward after forward]")
    half = _without(zb, lambda rank, ins: ins.id == "BW.s0.mb1")
    _refused(half, "BI.s0.mb1 (s0:BI1) is half a split backward: rank 0 never runs s0:BW1", "[backward after forward]")


def test_steps_follow_reductions_and_the_gradient_norm() -> None:
    graph = plan_memory(build_schedule("1f1b", 2, 2, dp=2, zero=1).apply(synthetic_graph(2, 2, 1, hidden=4, batch=2)))
    program = compile_program(graph)
    plan = list(program.ranks[0].instructions)
    opt, rs = _at(program, 0, "OPT.s0"), next(i for i, ins in enumerate(plan) if ins.kind is NodeKind.REDUCE_SCATTER)
    plan[opt] = attrs.evolve(plan[opt], waits=())  # in the list after it, but not waiting for it
    _refused(_plans(program, 0, plan), "OPT.s0 (s0:OPT) runs before instruction", f"({plan[rs].id}), the reduction "
             "of bucket", "[optimizer after backward]")
    program = compile_program(add_grad_norm(graph))
    plan = list(program.ranks[0].instructions)
    opt, norm = _at(program, 0, "OPT.s0"), next(i for i, ins in enumerate(plan) if ins.kind is NodeKind.GRAD_NORM)
    plan.insert(norm, plan.pop(opt))  # still after the reductions it waits for
    _refused(_plans(program, 0, plan), "OPT.s0 (s0:OPT) runs before instruction", "(grad_norm), the gradient norm, "
             "which precedes every step", "[optimizer after backward]")
    no_norm = _without(program, lambda rank, ins: ins.kind is NodeKind.GRAD_NORM)
    _refused(no_norm, "rank 0 runs 0 gradient norms", "[optimizer after backward]")


def test_forward_only_programs_verify_without_backwards() -> None:
    graph = plan_memory(build_schedule("1f1b", 2, 4, dp=2, zero=3).apply(synthetic_graph(2, 4, 1, hidden=4, batch=2)))
    evaluation = compile_program(forward_only(graph))
    verify(evaluation)
    assert not [i for p in evaluation.ranks for i in p.instructions if i.phase not in (None, Phase.F)]


def _unwaited(program: Program, rank: int, id: str, event: str) -> Program:
    """``program`` with instruction ``id`` of ``rank`` no longer waiting for ``event``."""
    i = _at(program, rank, id)
    plan = list(program.ranks[rank].instructions)
    assert event in plan[i].waits
    plan[i] = attrs.evolve(plan[i], waits=[e for e in plan[i].waits if e != event])
    return _plans(program, rank, plan)


def test_zero_buckets_are_gathered_around_their_uses_and_reduced_before_the_next_gradients() -> None:
    zero3 = compile_program(plan_memory(build_schedule("1f1b", 2, 4, dp=2, zero=3).apply(
        synthetic_graph(2, 4, 1, hidden=4, batch=2))))
    _refused(_unwaited(zero3, 0, "F.s0.mb0", "ev.materialize.bucket:s0:0.0"), "F.s0.mb0 (s0:F0) runs before "
             "instruction 0 (materialize.bucket:s0:0.0), which gathers the parameters of bucket:s0:0",
             "[gathered parameters]")
    early = _unwaited(zero3, 0, "free.bucket:s0:0.0", "ev.B.s0.mb3")
    plan = list(early.ranks[0].instructions)
    plan.insert(_at(early, 0, "reducescatter.bucket:s0:0.mb3"), plan.pop(_at(early, 0, "free.bucket:s0:0.0")))
    _refused(_plans(early, 0, plan), "free.bucket:s0:0.0 (FREE bucket:s0:0) runs before instruction 19 (B.s0.mb3), "
             "a use of the parameters of bucket:s0:0", "[gathered parameters]")
    plan.insert(_at(early, 0, "B.s0.mb3"), plan.pop(_at(_plans(early, 0, plan), 0, "free.bucket:s0:0.0")))
    _refused(_plans(early, 0, plan), "B.s0.mb3 (s0:B3) uses the parameters of bucket:s0:0, which rank 0 has "
             "not materialized (or freed again) before it", "[gathered parameters]")
    _refused(_unwaited(zero3, 0, "B.s0.mb1", "ev.reducescatter.bucket:s0:0.mb0"), "B.s0.mb1 (s0:B1) runs before "
             "instruction", "(reducescatter.bucket:s0:0.mb0), the reduce-scatter that drops the gradients it adds to",
             "[gradients after reduce-scatter]")
    i = next(i for i, ins in enumerate(zero3.ranks[0].instructions) if ins.kind is NodeKind.REDUCE_SCATTER)
    plan = list(zero3.ranks[0].instructions)
    plan[i] = attrs.evolve(plan[i], meta=attrs.evolve(plan[i].meta, dtype="float16"))
    _refused(_plans(zero3, 0, plan), f"{plan[i].id} (REDUCE_SCATTER bucket:s0:0#0) moves float16 but bucket "
             "bucket:s0:0 holds float32", "[shape]")
