"""Planning for hardware that is not here (docs/planning.md): the pipeline closed forms against
the simulator on the compiled schedules, the census on fake tensors against the FLOPs of the
real model, and the planner's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch

from piper_directives import build_schedule, synthetic_graph
from piper_scheduler import CostModel, compile_program, simulate
from piper_scheduler.analytic import CHUNKS, Link, Roofline, Topology, pipeline_step
from piper_train.flops import step_flops
from piper_train.hardware import load_hardware
from piper_train.hf import build_hf, causal_lm_loss, logits_only
from piper_train.tuning.census import hf_census
from piper_train.tuning.planner import Planner, Setting, candidates, rank
from piper_train.tuning.space import Candidate

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128}


def simulated(schedule: str, pp: int, m: int, f: float, bi: float, bw: float) -> float:
    """The makespan of the compiled library schedule, each rank's work split over its chunks."""
    v = CHUNKS[schedule]
    program = compile_program(build_schedule(schedule, pp, m, stages=pp * v).apply(synthetic_graph(pp * v, m, 1)))
    zero = dict.fromkeys(("F", "B", "BI", "BW"), 0.0)
    return simulate(program, CostModel(F=f / v, B=(bi + bw) / v, BI=bi / v, BW=bw / v, overrides={"loss": zero})).makespan


@pytest.mark.parametrize("schedule", sorted(CHUNKS))
@pytest.mark.parametrize(("pp", "m"), [(2, 8), (4, 8), (4, 16)])
def test_pipeline_closed_form_is_the_simulated_schedule(schedule, pp, m):
    """Exact for every schedule when the backward's halves equal the forward (DeepSeek's
    B = F + W case for DualPipe), and for the others at any costs; DualPipe(V) within 3%
    when BI > F > BW."""
    for f, bi, bw in ((1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.5, 0.5)):
        step, bubble = pipeline_step(schedule, pp, m, f, bi, bw)
        sim = simulated(schedule, pp, m, f, bi, bw)
        exact = not schedule.startswith("dualpipe") or bi == f
        assert step == pytest.approx(sim, rel=1e-9 if exact else 0.03), (f, bi, bw)
        assert bubble == pytest.approx(1 - m * (f + bi + bw) / step)


def test_ring_collectives_and_roofline():
    link = Link(bandwidth=100.0, latency=1.0)
    assert link.all_gather(400.0, 4) == pytest.approx(3 * (1.0 + 1.0))  # 3 steps of 100 bytes
    assert link.all_reduce(400.0, 4) == pytest.approx(2 * link.all_gather(400.0, 4))
    assert link.all_reduce(400.0, 1) == 0.0
    assert link.reduce_scatter(400.0, 4) == link.all_gather(400.0, 4)  # the ring's two halves
    # A backend whose reduce-scatter and all-gather are slower than the ring's (gloo): those two
    # scale, the all-reduce does not.
    slow = Link(bandwidth=100.0, latency=1.0, scatter_gather_factor=2.5)
    assert slow.all_gather(400.0, 4) == slow.reduce_scatter(400.0, 4) == pytest.approx(2.5 * link.all_gather(400.0, 4))
    assert slow.all_reduce(400.0, 4) == link.all_reduce(400.0, 4)
    topo = Topology(8, Link(10.0), Link(1.0))
    assert topo.link(8) is topo.intra and topo.link(4, stride=4) is topo.inter
    roof = Roofline(peak_flops=100.0, memory_bandwidth=10.0, flop_efficiency=0.5)
    assert roof.seconds([(100.0, 10.0), (0.0, 50.0)]) == pytest.approx(2.0 + 5.0)  # compute-, then memory-bound


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def real_flops(path: Path, seq_len: int) -> int:
    model, _ = build_hf(f"hf:{path}")
    tokens = torch.randint(0, 96, (1, seq_len + 1))
    return step_flops(logits_only(model), (tokens[:, :-1],), (tokens[:, 1:],), causal_lm_loss)


#: Three families: GQA with RMSNorm (Llama), q/k norms (Qwen3), Conv1D, tied embeddings and n_layer (GPT-2).
FAMILIES = {
    "llama": {**TINY, "vocab_size": 96},
    "qwen3": {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 96},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 3, "n_positions": 64, "vocab_size": 96},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_census_replicates_one_layer_as_the_real_model_counts(family, tmp_path):
    """The census builds copies with 0 and 1 layers on fake tensors; its FLOPs for the
    config's 3 layers equal the count of the real 3-layer model (one real step), and so does
    its parameter count."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FAMILIES[family]))
    census = hf_census(f"hf:{path}", 16)
    assert census.layers == 3
    assert census.model_flops() == real_flops(path, 16)
    model, _ = build_hf(f"hf:{path}")
    assert census.params == sum(p.numel() for p in model.parameters())
    assert census.tied == (family == "gpt2")  # GPT-2's head reads the embedding's weight
    assert census.layer.flops("BI") > census.layer.flops("BW") > 0
    assert census.layer.saved_bytes > census.layer.output_bytes > 0


def test_the_weight_half_of_a_layers_backward_is_one_product_per_linear(tiny):
    census = hf_census(f"hf:{tiny}", 16)
    norms = 2 * TINY["hidden_size"]  # a layer's two RMSNorm weights; the rest are its Linears'
    # As many FLOPs as the forward's products; attention's backward belongs to the input half.
    assert census.layer.flops("BW") == 2 * 16 * (census.layer.params - norms)


def test_the_cpus_fused_attention_is_counted_as_torchs_formula_says():
    """torch's registry has no formula for the CPU's flash attention; op_flops gives it the
    CUDA kernels' (forward 4 b h s^2 d, backward 2.5x that)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from piper_train.flops import _Counting

    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    with _Counting() as counter:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert counter.total == sdpa_flop_count(q.shape, k.shape, v.shape) > 0
    with _Counting() as counter:
        out.sum().backward()
    assert counter.total == sdpa_backward_flop_count(out.shape, q.shape, k.shape, v.shape)


def test_census_refuses_a_mixture_of_experts(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}))
    with pytest.raises(ValueError, match="num_local_experts = 4.*dense decoders only"):
        hf_census(f"hf:{path}", 16)


def test_census_of_a_70b_config_allocates_nothing(tmp_path):
    """Llama-3-70B's public sizes: 70.6 B parameters counted in seconds, on fake tensors."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
                                "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                                "vocab_size": 128256, "max_position_embeddings": 8192}))
    census = hf_census(f"hf:{path}", 1024)
    assert census.params == 70_553_706_496
    # 6 N T for the matrix products, plus attention: within 5% at 1024 tokens
    assert census.model_flops() == pytest.approx(6 * census.params * 1024, rel=0.05)


def planner(tiny, devices=8, batch=64, **kwargs) -> Planner:
    census = hf_census(f"hf:{tiny}", 32)
    return Planner(Setting(census, load_hardware("h100"), devices, batch, **kwargs))


def test_planner_memory_follows_zero_and_recompute(tiny):
    p = planner(tiny)
    plans = {z: p.price(Candidate("1f1b", 1, 4, 8, 1, 1, z)) for z in (0, 1, 2, 3)}
    peaks = [plans[z].peak_bytes for z in (0, 1, 2, 3)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    params = p.setting.census.params
    # ZeRO 0 keeps 16 bytes per parameter (fp32 weights, gradients, two Adam moments); ZeRO 3 2 of them
    # per rank of 8: the difference is 14/8 of 16 bytes' worth
    assert peaks[0] - peaks[3] == pytest.approx(params * 16 * 7 / 8, rel=1e-9)
    recomputed = p.price(Candidate("gpipe", 2, 8, 4, recompute=True))
    kept = p.price(Candidate("gpipe", 2, 8, 4))
    assert recomputed.peak_bytes < kept.peak_bytes
    assert recomputed.step_seconds > kept.step_seconds


def test_dualpipe_holds_two_stages_parameters(tmp_path):
    """DualPipe's ranks hold their stage and its mirror (DeepSeek's table: parameters 2x):
    on two ranks each holds the whole model's state; 1F1B's fuller rank, its own stage's."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "num_hidden_layers": 4}))
    p = Planner(Setting(hf_census(f"hf:{path}", 32), load_hardware("h100"), 2, 8))
    c = p.setting.census
    per_param = 16  # fp32 weights, gradients and two Adam moments
    assert p.price(Candidate("dualpipe", 2, 4)).parts["state_bytes"] == c.params * per_param
    stage = 2 * c.layer.params + max(c.embed.params, c.head.params)
    assert p.price(Candidate("1f1b", 2, 4)).parts["state_bytes"] == stage * per_param


def test_planner_mfu_is_model_flops_over_time_and_peak(tiny):
    p = planner(tiny)
    plan = p.price(Candidate("1f1b", 2, 4, 2, 2))
    census = p.setting.census
    flops = 64 * census.model_flops()
    assert plan.tflops_per_device == pytest.approx(flops / plan.step_seconds / 8 / 1e12)
    assert plan.mfu == pytest.approx(plan.tflops_per_device / 989.4)
    assert plan.tokens_per_second == pytest.approx(64 * 32 / plan.step_seconds)
    assert plan.step_seconds == pytest.approx(plan.parts["pipeline"] + plan.parts["dp_exposed"]
                                              + plan.parts["optimizer"])


def test_planner_refuses_what_cannot_run_and_ranks_the_rest(tiny):
    p = planner(tiny)
    assert "attention heads" in p.price(Candidate("1f1b", 1, 1, 1, 8)).reason  # 4 heads
    assert "does not divide" in p.price(Candidate("1f1b", 1, 3, 8)).reason
    assert "cannot fill" in p.price(Candidate("1f1b", 8, 8)).reason  # 3 layers, 8 stages
    ranked = rank(p.price(c) for c in candidates(8, microbatches=(1, 2, 4, 8)))
    fitting = [x for x in ranked if x.fits]
    assert fitting and all(a.step_seconds <= b.step_seconds for a, b in zip(fitting, fitting[1:], strict=False))
    small = planner(tiny, budget_bytes=1)
    assert not any(small.price(c).fits for c in candidates(8, microbatches=(1, 2)))


def test_hardware_planning_fields_are_checked(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"name": "x", "peak_tflops": {"bf16": 10}, "flop_efficiency": 1.5}))
    with pytest.raises(ValueError, match="flop_efficiency must be a number in"):
        load_hardware(str(path))
    path.write_text(json.dumps({"name": "x", "peak_tflops": {"bf16": 10}, "devices_per_node": 2.5}))
    with pytest.raises(ValueError, match="devices_per_node must be a positive integer"):
        load_hardware(str(path))
    for bad in (1.5, -0.1, True, "all"):
        path.write_text(json.dumps({"name": "x", "peak_tflops": {"bf16": 10}, "comm_overlap": bad}))
        with pytest.raises(ValueError, match=r"comm_overlap must be a number in \[0, 1\]"):
            load_hardware(str(path))
    path.write_text(json.dumps({"name": "x", "peak_tflops": {"bf16": 10}, "comm_overlap": 0}))
    assert load_hardware(str(path)).planning("comm_overlap") == 0.0
    for bad in (0, -1.0, True, "2"):
        path.write_text(json.dumps({"name": "x", "peak_tflops": {"bf16": 10}, "scatter_gather_factor": bad}))
        with pytest.raises(ValueError, match="scatter_gather_factor must be a positive number"):
            load_hardware(str(path))
    h100 = load_hardware("h100")
    assert h100.planning("intra_node_gb_per_s") == 450 and h100.planning("flop_efficiency") == 0.6
    assert h100.planning("comm_overlap") == 1.0 and h100.planning("scatter_gather_factor") == 1.0


def test_traffic_the_compute_cannot_hide_is_exposed_whole(tiny):
    """``comm_overlap`` 0 (a CPU whose collectives take the cores that compute): the gradient
    reduction and ZeRO-3's gathers add to the step in full; 1: hidden behind the backward."""
    census = hf_census(f"hf:{tiny}", 32)
    slow = attrs.evolve(load_hardware("h100"), inter_node_gb_per_s=0.05, intra_node_gb_per_s=0.05)
    hidden, shared = (Planner(Setting(census, attrs.evolve(slow, comm_overlap=c), 8, 64)) for c in (1.0, 0.0))
    for zero in (1, 3):
        cand = Candidate("1f1b", 1, 8, 8, zero=zero)
        a, b = hidden.price(cand), shared.price(cand)
        assert b.parts["dp_exposed"] > a.parts["dp_exposed"]
        assert b.step_seconds - a.step_seconds == pytest.approx(b.parts["dp_exposed"] - a.parts["dp_exposed"])
    # With nothing hidden, ZeRO-3's per-microbatch gathers cost more than ZeRO-1's one reduction.
    assert shared.price(Candidate("1f1b", 1, 8, 8, zero=3)).step_seconds > \
        shared.price(Candidate("1f1b", 1, 8, 8, zero=1)).step_seconds


def test_zero_1_and_2_gather_the_updated_shards_after_the_optimizer_where_nothing_hides_them(tiny):
    """Piper's runtime all-gathers ZeRO 1-2's updated parameter shards after the optimizer, the
    step's last work: exposed whatever ``comm_overlap``, while the reduce-scatter before it
    hides behind the last backward as ZeRO 0's all-reduce does. A slower reduce-scatter and
    all-gather (``scatter_gather_factor``, gloo's) cost ZeRO 1-2 more, never ZeRO 0."""
    census = hf_census(f"hf:{tiny}", 32)
    params = census.layers * census.layer.params + census.embed.params + census.head.params
    # links fast enough that the last backward hides a reduction whole
    hidden = attrs.evolve(load_hardware("h100"), comm_overlap=1.0, intra_node_gb_per_s=1e5, intra_node_latency_us=1e-3)
    p = Planner(Setting(census, hidden, 8, 64))
    zero0, zero1, zero2 = (p.price(Candidate("1f1b", 1, 8, 8, zero=z)).parts for z in (0, 1, 2))
    assert zero0["BI"] + zero0["BW"] > p.topology.link(8).all_reduce(params * 4, 8)  # so ZeRO 0's is hidden
    assert zero0["dp_exposed"] == 0.0
    assert zero1["dp_exposed"] == zero2["dp_exposed"] == pytest.approx(p.topology.link(8).all_gather(params * 4, 8))
    # Nothing hidden (a CPU): the ring's halves add up to ZeRO 0's all-reduce; gloo's slower
    # halves (twice the ring's) cost ZeRO 1 that all-reduce once more, ZeRO 0 nothing.
    ring, gloo = (Planner(Setting(census, attrs.evolve(hidden, comm_overlap=0.0, scatter_gather_factor=f), 8, 64))
                  for f in (1.0, 2.0))
    reduction = ring.topology.link(8).all_reduce(params * 4, 8)
    for planner_, zero1_exposed in ((ring, reduction), (gloo, 2 * reduction)):
        assert planner_.price(Candidate("1f1b", 1, 8, 8)).parts["dp_exposed"] == pytest.approx(reduction)
        assert planner_.price(Candidate("1f1b", 1, 8, 8, zero=1)).parts["dp_exposed"] == pytest.approx(zero1_exposed)


def test_sequence_parallelism_keeps_the_step_and_cuts_the_hidden_sized_activations(tiny):
    """SP turns each of TP's all-reduces into a reduce-scatter and an all-gather of the same
    tensor (the same ring time), and cuts the activations TP leaves whole (those of the hidden
    size) by tp; without SP a TP rank keeps them whole (Part.kept_per_rank)."""
    p = planner(tiny, devices=4, batch=8)
    layer = p.setting.census.layer
    assert 0 < layer.hidden_saved_bytes < layer.saved_bytes
    assert layer.kept_per_rank(1) == layer.saved_bytes
    tp, sp = p.price(Candidate("1f1b", 1, 2, 1, 4)), p.price(Candidate("1f1b", 1, 2, 1, 4, sp=True))
    assert tp.fits and sp.fits and sp.candidate.label == "1f1b pp=1 tp=4 sp mb=2"
    assert sp.step_seconds == tp.step_seconds and sp.parts["tp_comm_per_layer"] == tp.parts["tp_comm_per_layer"] > 0
    # where a reduce-scatter and an all-gather are slower than the ring's halves (gloo), SP costs more
    slow = Planner(attrs.evolve(p.setting, hardware=attrs.evolve(p.setting.hardware, scatter_gather_factor=2.0)))
    assert slow.price(Candidate("1f1b", 1, 2, 1, 4, sp=True)).parts["tp_comm_per_layer"] == \
        pytest.approx(2 * tp.parts["tp_comm_per_layer"])
    assert slow.price(Candidate("1f1b", 1, 2, 1, 4)).parts["tp_comm_per_layer"] == tp.parts["tp_comm_per_layer"]
    # 1F1B on one rank holds one microbatch (4 sequences) of every layer: the hidden-sized part, 3/4 of it
    layers, sequences = p.setting.census.layers, 8 // 2
    assert tp.peak_bytes - sp.peak_bytes == pytest.approx(layers * sequences * layer.hidden_saved_bytes * 3 / 4, abs=1)
    assert layer.kept_per_rank(4) == pytest.approx(layer.hidden_saved_bytes + (layer.saved_bytes
                                                                               - layer.hidden_saved_bytes) / 4)


def test_context_parallelism_prices_the_key_value_gathers_and_reduces_over_dp_x_cp(tiny):
    p = planner(tiny, devices=4, batch=8)
    c = p.setting.census
    plan = p.price(Candidate("1f1b", 1, 2, 2, 1, 1, 1, cp=2))
    assert plan.fits and plan.candidate.label == "1f1b pp=1 dp=2 cp=2 zero=1 mb=2"
    sequences = 8 // (2 * 2)
    kv = 2 * c.kv_heads * (c.hidden // c.heads) * c.seq_len * c.dtype_bytes  # one layer, one whole sequence
    gather = 2 * p.topology.link(2).all_gather(kv * sequences, 2)  # keys and values, over the node's link
    assert plan.parts["cp_comm_per_layer"] == pytest.approx(gather) and gather > 0
    # each rank computes half of every sequence, plus the gathers in each direction
    lt, et, ht = (p.phase_times(k, sequences, 2) for k in range(3))
    assert plan.parts["F"] == pytest.approx(c.layers * (lt["F"] + gather) + et["F"] + ht["F"])
    assert plan.parts["BI"] == pytest.approx(c.layers * (lt["BI"] + gather) + et["BI"] + ht["BI"])
    # ZeRO-1 shards the optimizer state over the dp x cp = 4 replicas
    whole = p.price(Candidate("1f1b", 1, 2, 2, 1, 1, 0, cp=2))
    assert whole.parts["state_bytes"] - plan.parts["state_bytes"] == pytest.approx(c.params * 8 * 3 / 4)


def test_planner_refuses_sp_and_cp_where_the_library_does(tiny):
    p = planner(tiny, devices=4, batch=8)
    assert "tp >= 2" in p.price(Candidate("1f1b", 1, 2, 4, sp=True)).reason
    assert "tensor parallelism" in p.price(Candidate("1f1b", 1, 2, 1, 2, cp=2)).reason
    assert "does not divide the sequence" in planner(tiny, devices=3, batch=3).price(
        Candidate("1f1b", 1, 1, 1, cp=3)).reason  # 32 tokens
    assert "recomputed" in p.price(Candidate("1f1b", 1, 2, 2, recompute=True, cp=2)).reason
    space = candidates(4, schedules=("1f1b",), microbatches=(2,), zeros=(0,), pps=(1,), sp=(False, True), cps=(1, 2))
    assert sorted(c.label for c in space) == sorted([
        "1f1b pp=1 dp=4 mb=2", "1f1b pp=1 dp=4 mb=2 recompute", "1f1b pp=1 dp=2 tp=2 mb=2",
        "1f1b pp=1 dp=2 tp=2 mb=2 recompute", "1f1b pp=1 dp=2 tp=2 sp mb=2", "1f1b pp=1 dp=2 tp=2 sp mb=2 recompute",
        "1f1b pp=1 tp=4 mb=2", "1f1b pp=1 tp=4 mb=2 recompute", "1f1b pp=1 tp=4 sp mb=2",
        "1f1b pp=1 tp=4 sp mb=2 recompute", "1f1b pp=1 dp=2 cp=2 mb=2"])
