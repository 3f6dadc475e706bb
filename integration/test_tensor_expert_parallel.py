"""TP with EP in one strategy (issue 37, item 6). Two forms:

- experts split over the tensor-parallel group (``--tp`` alone): attention cut by heads, each rank
  holding E/tp of the experts and running them on the tokens routed to them (every rank of the
  group sees the same tokens, so no all-to-all: zeros for the others' tokens, one all-reduce), the
  embedding, head and loss cut by vocabulary;
- an expert-parallel group beside the tensor-parallel ones (``--tp 2 --ep 2``): ep tensor-parallel
  groups that are data-parallel replicas, each rank of a group routing its share of the group's
  tokens with all-to-alls over all tp * ep ranks, each holding E/(tp * ep) experts.

The oracle is ``run_check`` in float64 against one device, 2 AdamW steps, on
integration/fixtures/llama_moe.py (GQA attention, top-2 MoE over 4 experts, tied head) and the
built-in ``moe`` model (whose routers, reaching only the head, are no column group)."""

from __future__ import annotations

from pathlib import Path

import pytest

from piper_directives import build_schedule, parallelize, tensor_parallel
from piper_runtime import OptimizerSpec
from piper_train.check import TOLERANCES, run_check
from piper_train.models import build_model
from piper_train.workload import load_workload

FIXTURE = f"{Path(__file__).resolve().parent / 'fixtures' / 'llama_moe.py'}:factory"
pytestmark = pytest.mark.usefixtures("ray_cluster")
EXPERTS = {f"layers.{i}.feed_forward.experts.{w}" for i in (0, 1) for w in ("w1", "w2", "w3")}


def _check(runtime: str, workload, strategy) -> set[str]:
    rtol, atol = TOLERANCES["fp64"]
    report = run_check(workload, strategy, steps=2, optimizer=OptimizerSpec("adamw", 1e-3), rtol=rtol, atol=atol,
                       precision="fp64", runtime=runtime)
    assert report.ok, report.failures()
    assert max(report.worst(w).rel for w in ("grad", "param", "loss")) < 1e-12
    return {p.name for sh in report.program.sharding for p in sh.params}


@pytest.mark.parametrize("pp, dp", [(1, 1), (2, 1), (1, 2)])
def test_attention_over_tp_experts_split_over_the_group(runtime, pp, dp):
    strategy = parallelize(build_schedule("1f1b", pp, 2, stages=2), dp=dp, zero=1 if dp > 1 else 0, tp=2)
    cut = _check(runtime, load_workload(FIXTURE, stages=2), strategy)
    assert EXPERTS <= cut and "layers.1.attention.wq.weight" in cut and "tok_embeddings.weight" in cut
    assert "layers.0.feed_forward.router.weight" not in cut  # the router stays whole: every rank routes alike


def test_a_plan_names_the_experts(runtime):
    plan = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise",
            "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.experts": "experts"}
    cut = _check(runtime, load_workload(FIXTURE, stages=2), tensor_parallel(build_schedule("1f1b", 1, 2, stages=2), 2,
                                                                             plan=plan))
    assert EXPERTS <= cut and "tok_embeddings.weight" not in cut


def test_the_built_in_moe_model_under_tp2(runtime):
    cut = _check(runtime, build_model("moe", stages=2), tensor_parallel(build_schedule("1f1b", 2, 2, stages=2), 2))
    assert "blocks.1.moe.experts.w1" in cut and "blocks.1.moe.router.weight" not in cut


@pytest.mark.parametrize("schedule, pp, dp", [("1f1b", 1, 1), ("1f1b", 2, 1), ("1f1b", 1, 2)])
def test_tp2_x_ep2_experts_over_the_expert_parallel_group(runtime, schedule, pp, dp):
    """4 experts over tp 2 x ep 2: one expert per rank, routed by all-to-all; attention, embedding
    and head tensor-parallel; ZeRO-1 over the replicas (the ep groups' and dp's); gradients
    clipped by the global norm (each expert's gradient counted once, on the rank holding it)."""
    strategy = parallelize(build_schedule(schedule, pp, 2 // dp, stages=2), dp=dp, zero=1, tp=2, ep=2)
    workload = load_workload(FIXTURE, stages=2)
    rtol, atol = TOLERANCES["fp64"]
    report = run_check(workload, strategy, steps=2, optimizer=OptimizerSpec("adamw", 1e-3), rtol=rtol, atol=atol,
                       precision="fp64", runtime=runtime, clip_grad_norm=0.05)
    assert report.ok, report.failures()
    assert max(report.worst(w).rel for w in ("grad", "param", "loss")) < 1e-12
    experts = {p.name: sh for sh in report.program.sharding for p in sh.params if p.experts}
    assert set(experts) == EXPERTS and {sh.expert_degree for sh in experts.values()} == {4}
    assert {c.ranks for c in report.program.communicators if c.traffic == "ep"} == {
        sh.devices[i:i + 4] for sh in experts.values() for i in range(0, len(sh.devices), 4)
    }
    cut = {p.name for sh in report.program.sharding for p in sh.params}
    assert "layers.1.attention.wq.weight" in cut and "layers.0.feed_forward.router.weight" not in cut


def test_built_in_moe_under_dualpipev_tp2_x_ep2(runtime):
    strategy = parallelize(build_schedule("dualpipev", 2, 4, stages=4), tp=2, ep=2)
    _check(runtime, build_model("moe", stages=4), strategy)
