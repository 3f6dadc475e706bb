"""``piper_train.tuning.calibrate``: this machine measured into a hardware file the planner
reads (docs/planning.md, "Calibration")."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch

from piper_scheduler.analytic import Link, Roofline
from piper_train.hardware import Hardware, load_hardware
from piper_train.tuning.calibrate import (
    Calibration,
    Measured,
    fit_link,
    fit_step,
    hardware_file,
    measure,
    model_matmuls,
)
from piper_train.tuning.census import hf_census, hf_config
from piper_train.tuning.planner import Planner, Setting
from piper_train.tuning.space import Candidate

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}


@pytest.fixture
def tiny(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return f"hf:{path}"


def test_fitted_link_reproduces_both_all_reduces():
    for ranks in (2, 4, 8):
        bandwidth, latency = fit_link(3e-4, 5e-2, 8 << 20, ranks)
        link = Link(bandwidth, latency)
        # the small message's bytes are negligible; the large one's time is reproduced exactly
        assert link.all_reduce(1e-9, ranks) == pytest.approx(3e-4)
        assert link.all_reduce(8 << 20, ranks) == pytest.approx(5e-2)


def test_roofline_charges_each_operator_its_overhead():
    ops = [(1e6, 1e3), (0.0, 4e6), (0.0, 0.0)]
    bare = Roofline(1e9, 1e9).seconds(ops)
    assert bare == pytest.approx(1e-3 + 4e-3)
    assert Roofline(1e9, 1e9, overhead=1e-5).seconds(ops) == pytest.approx(bare + 3e-5)


def test_model_matmuls_are_the_configs_projections(tiny):
    shapes = model_matmuls(hf_config(tiny), 16)
    # q (4 heads x 8), k and v (2 KV heads x 8), o, gate, up, down, LM head
    assert shapes == ((16, 32, 32), (16, 32, 16), (16, 32, 16), (16, 32, 32), (16, 32, 64), (16, 32, 64),
                      (16, 64, 32), (16, 32, 64))


def test_measure_writes_a_file_the_planner_reads(tmp_path, tiny):
    cal = Calibration(devices=2, matmuls=model_matmuls(hf_config(tiny), 8), elementwise_elements=4096,
                      peak_size=64, link_large=1 << 16, repeats=2, seconds=0.0)
    m = measure(cal)
    assert m.ranks == 2 and m.peak_flops >= m.model_flops > 0 and m.bandwidth > 0 and m.op_overhead > 0
    assert m.link_bandwidth and m.link_latency  # two ranks: the local runtime's gloo link was measured
    data = hardware_file(m, cal, name="here")
    path = tmp_path / "here.json"
    path.write_text(json.dumps(data))
    hw = load_hardware(str(path))  # the schema hardware.py reads: data only
    assert hw.peak("fp32") * 1e12 == pytest.approx(m.peak_flops)
    assert hw.flop_efficiency * hw.peak("fp32") * 1e12 == pytest.approx(m.model_flops)  # the model's products
    assert hw.memory_tb_per_s * 1e12 == pytest.approx(m.bandwidth)
    assert hw.op_overhead_us == pytest.approx(m.op_overhead * 1e6)
    assert hw.devices_per_node == 2 and hw.intra_node_gb_per_s == pytest.approx(m.link_bandwidth / 1e9)
    assert "piper tune --calibrate" in hw.source and "load average" in hw.source
    # the planner prices with it: each operator pays the measured overhead on top of its roofline
    census = hf_census(tiny, 8, dtype=torch.float32)
    planner = Planner(Setting(census, hw, 2, 4, dtype="fp32"))
    plan = planner.price(Candidate("1f1b", 1, 1, 2, 1, 1, 0, None, False))
    assert plan.fits and plan.step_seconds > 0
    ops = sum(len(census.layer.ops.get(p, ())) for p in ("F", "BI", "BW")) * census.layers \
        + sum(len(part.ops.get(p, ())) for part in (census.embed, census.head) for p in ("F", "BI", "BW"))
    bare = Planner(Setting(census, load_hardware(str(_without_overhead(path))), 2, 4, dtype="fp32"))
    compute = sum(plan.parts[p] for p in ("F", "BI", "BW"))
    compute_bare = sum(bare.price(plan.candidate).parts[p] for p in ("F", "BI", "BW"))
    assert compute - compute_bare == pytest.approx(ops * m.op_overhead)


def _without_overhead(path: Path) -> Path:
    data = json.loads(path.read_text())
    del data["op_overhead_us"]
    out = path.with_name("bare.json")
    out.write_text(json.dumps(data))
    return out


def test_fields_not_measured_come_from_the_base_file():
    m = Measured("GPU", 1, "bf16", 500e12, 400e12, 3e12, 4e-6, None, None, 1.0, 2.0, 80 * 2**30)
    data = hardware_file(m, Calibration(dtype="bf16"), load_hardware("h100"), name="mine")
    h100 = load_hardware("h100")
    assert data["intra_node_gb_per_s"] == h100.intra_node_gb_per_s  # the link was not measured
    assert data["peak_tflops"] == {"bf16": 500}  # the base's other peaks would be priced at bf16's efficiency
    assert data["flop_efficiency"] == pytest.approx(0.8) and "links not measured" in data["source"]


def test_calibration_options_are_checked():
    with pytest.raises(ValueError, match="--precision fp8"):
        Calibration(dtype="fp8")
    with pytest.raises(ValueError, match="--devices"):
        Calibration(devices=0)


#: A device for fitting: its peak and bandwidth stay, the efficiency and the overhead are fitted.
DEVICE = Hardware("cpu", {"fp32": 0.1}, memory_gib=8.0, memory_tb_per_s=0.02, intra_node_gb_per_s=1.0,
                  inter_node_gb_per_s=1.0)


def one_rank_step(census, hw: Hardware, sequences: int) -> float:
    """The planner's compute of a one-rank, one-microbatch step (pp=1, dp=1, tp=1, one microbatch)."""
    plan = Planner(Setting(census, hw, 1, sequences, dtype="fp32")).price(Candidate("1f1b", 1, 1, 1, 1, 1, 0, None,
                                                                                    False))
    return sum(plan.parts[p] for p in ("F", "BI", "BW"))


def whole_step(census, hw: Hardware, sequences: int, ranks: int, zero: int = 0) -> float:
    """The planner's whole step of what calibration runs: 1F1B, one microbatch of ``sequences``
    per rank, ``ranks`` data-parallel ranks, ZeRO 0 (or ``zero``)."""
    setting = Setting(census, hw, ranks, sequences * ranks, dtype="fp32", budget_bytes=1 << 62)
    return Planner(setting).price(Candidate("1f1b", 1, 1, dp=ranks, zero=zero)).step_seconds


def tp_step(census, hw: Hardware, sequences: int, ranks: int) -> float:
    """The planner's whole step of the same strategy on ``ranks`` tensor-parallel ranks."""
    setting = Setting(census, hw, ranks, sequences, dtype="fp32", budget_bytes=1 << 62)
    return Planner(setting).price(Candidate("1f1b", 1, 1, tp=ranks)).step_seconds


def fitted(hw: Hardware, fit) -> Hardware:
    return attrs.evolve(hw, flop_efficiency=fit.flop_efficiency, op_overhead_us=fit.op_overhead * 1e6)


def test_fitted_figures_reproduce_the_measured_steps_through_the_planner(tiny):
    census = hf_census(tiny, 8, dtype=torch.float32)
    steps = ((1, 0.012), (4, 0.02))  # seconds of the model's step at 1 and 4 sequences
    fit = fit_step(census, DEVICE, steps, "fp32")
    assert fit.exact and 0 < fit.flop_efficiency < 1 and fit.op_overhead > 0
    hw = fitted(DEVICE, fit)
    for sequences, seconds in steps:  # the planner's own cost function gives each measured time back
        assert one_rank_step(census, hw, sequences) == pytest.approx(seconds, rel=1e-9)
    # the overhead is charged once per operator of the census, the same at every size
    bare = one_rank_step(census, attrs.evolve(hw, op_overhead_us=None), 4)
    assert fit.operators * fit.op_overhead == pytest.approx(0.02 - bare, rel=1e-9)


def test_a_whole_data_parallel_step_is_fitted_through_the_planners_price(tiny):
    census = hf_census(tiny, 8, dtype=torch.float32)
    linked = attrs.evolve(DEVICE, intra_node_gb_per_s=0.5, inter_node_gb_per_s=0.5, intra_node_latency_us=100.0,
                          inter_node_latency_us=100.0, devices_per_node=2)
    truth = attrs.evolve(linked, flop_efficiency=0.3, op_overhead_us=12.0)
    steps = [(b, whole_step(census, truth, b, 2)) for b in (1, 8)]
    fit = fit_step(census, linked, steps, "fp32", ranks=2)
    assert fit.exact
    assert fit.flop_efficiency == pytest.approx(0.3, rel=1e-6) and fit.op_overhead == pytest.approx(12e-6, rel=1e-6)
    # More than the compute: the optimizer (and any traffic left exposed) is in the step fitted.
    assert whole_step(census, truth, 8, 2) > one_rank_step(census, truth, 8)
    # Measured steps no figures were priced with are given back by the planner all the same.
    steps = ((1, 0.03), (8, 0.09))
    fit = fit_step(census, linked, steps, "fp32", ranks=2)
    assert fit.exact
    for b, seconds in steps:
        assert whole_step(census, fitted(linked, fit), b, 2) == pytest.approx(seconds, rel=1e-6)


def test_a_tensor_parallel_step_fits_the_latency_a_collective_pays_inside_a_step(tiny):
    census = hf_census(tiny, 8, dtype=torch.float32)
    linked = attrs.evolve(DEVICE, intra_node_gb_per_s=0.5, inter_node_gb_per_s=0.5, intra_node_latency_us=100.0,
                          inter_node_latency_us=100.0, devices_per_node=2)
    truth = attrs.evolve(linked, flop_efficiency=0.3, op_overhead_us=12.0, intra_node_latency_us=900.0,
                         inter_node_latency_us=900.0)
    steps = [(b, whole_step(census, truth, b, 2)) for b in (1, 8)]
    fit = fit_step(census, linked, steps, "fp32", ranks=2, tensor_parallel=(8, tp_step(census, truth, 8, 2)))
    assert fit.exact and fit.link_latency == pytest.approx(900e-6, rel=1e-5)
    assert fit.flop_efficiency == pytest.approx(0.3, rel=1e-5) and fit.op_overhead == pytest.approx(12e-6, rel=1e-5)
    # A step faster than any latency allows leaves the file's latency as it is.
    fast = fit_step(census, linked, steps, "fp32", ranks=2, tensor_parallel=(8, 1e-6))
    assert fast.link_latency is None and fast.tensor_parallel is None


def test_a_zero_1_step_fits_what_its_reduce_scatter_and_all_gather_take(tiny):
    census = hf_census(tiny, 8, dtype=torch.float32)
    linked = attrs.evolve(DEVICE, intra_node_gb_per_s=0.5, inter_node_gb_per_s=0.5, intra_node_latency_us=100.0,
                          inter_node_latency_us=100.0, devices_per_node=2, comm_overlap=0.0)
    truth = attrs.evolve(linked, flop_efficiency=0.3, op_overhead_us=12.0, scatter_gather_factor=2.4)
    steps = [(b, whole_step(census, truth, b, 2)) for b in (1, 8)]
    sharded = (8, whole_step(census, truth, 8, 2, zero=1))
    assert sharded[1] > steps[1][1]  # gloo's halves cost more than its all-reduce
    fit = fit_step(census, linked, steps, "fp32", ranks=2, sharded=sharded)
    assert fit.exact and fit.sharded == sharded and fit.scatter_gather_factor == pytest.approx(2.4, rel=1e-5)
    assert fit.flop_efficiency == pytest.approx(0.3, rel=1e-5) and fit.op_overhead == pytest.approx(12e-6, rel=1e-5)
    # A ZeRO-1 step no slower than the ring's halves allow leaves the ring's time (no factor).
    fast = fit_step(census, linked, steps, "fp32", ranks=2, sharded=(8, steps[1][1] * 0.9))
    assert fast.scatter_gather_factor is None and fast.sharded is None


def test_fit_recovers_the_figures_a_step_was_priced_with(tiny):
    census = hf_census(tiny, 8, dtype=torch.float32)
    truth = attrs.evolve(DEVICE, flop_efficiency=0.3, op_overhead_us=12.0)
    steps = [(b, one_rank_step(census, truth, b)) for b in (1, 8)]
    fit = fit_step(census, DEVICE, steps, "fp32")
    assert fit.flop_efficiency == pytest.approx(0.3, rel=1e-6)
    assert fit.op_overhead == pytest.approx(12e-6, rel=1e-6)


def test_a_step_faster_than_the_measured_peak_raises_the_peak(tiny):
    census = hf_census(tiny, 8, dtype=torch.float32)
    device = attrs.evolve(DEVICE, memory_tb_per_s=100.0)  # the products bound every step: one rate fits
    truth = attrs.evolve(device, peak_tflops={"fp32": 0.3}, flop_efficiency=1.0, op_overhead_us=5.0)
    steps = [(b, one_rank_step(census, truth, b)) for b in (1, 4)]
    fit = fit_step(census, device, steps, "fp32")  # the file's peak is a third of the step's rate
    assert fit.exact and fit.flop_efficiency == 1.0 and fit.peak_flops == pytest.approx(0.3e12, rel=1e-6)
    hw = attrs.evolve(fitted(device, fit), peak_tflops={"fp32": fit.peak_flops / 1e12})
    assert [one_rank_step(census, hw, b) for b, _ in steps] == pytest.approx([t for _, t in steps], rel=1e-9)


def test_a_fit_out_of_range_reproduces_the_larger_microbatch(tiny):
    census = hf_census(tiny, 8, dtype=torch.float32)
    memory_only = one_rank_step(census, attrs.evolve(DEVICE, flop_efficiency=1.0, peak_tflops={"fp32": 1e9}), 4)
    # growing less than the memory-bound operators alone do: no overhead, the larger size reproduced
    fit = fit_step(census, DEVICE, ((1, memory_only), (4, 1.01 * memory_only)), "fp32")
    assert not fit.exact and fit.op_overhead == 0.0
    hw = attrs.evolve(fitted(DEVICE, fit), peak_tflops={"fp32": fit.peak_flops / 1e12})
    assert one_rank_step(census, hw, 4) == pytest.approx(1.01 * memory_only, rel=1e-9)
    # growing so fast that the overhead would be negative: no overhead, the larger size alone
    fit = fit_step(census, DEVICE, ((1, 1e-9), (4, 50 * memory_only)), "fp32")
    assert fit.op_overhead == 0.0 and not fit.exact and fit.flop_efficiency < 1
    assert one_rank_step(census, fitted(DEVICE, fit), 4) == pytest.approx(50 * memory_only, rel=1e-9)
    with pytest.raises(ValueError, match="two microbatch sizes"):
        fit_step(census, DEVICE, ((4, 0.1), (4, 0.2)), "fp32")


def test_measuring_the_models_step_fits_the_file_to_it(tmp_path, tiny):
    cal = Calibration(devices=2, matmuls=model_matmuls(hf_config(tiny), 8), elementwise_elements=4096,
                      peak_size=64, link_large=1 << 16, repeats=2, seconds=0.0, model=tiny, seq_len=8, sequences=2,
                      step_seconds=0.0)
    m = measure(cal)  # Piper's training step on 2 local ranks, at 1 and 2 sequences per rank
    assert [b for b, _ in m.steps] == [1, 2] and all(t > 0 for _, t in m.steps) and m.step_ranks == 2
    census = hf_census(tiny, 8, dtype=torch.float32)
    data = hardware_file(m, cal, name="here")
    fit = fit_step(census, load_hardware(_written(tmp_path, data)), m.steps, "fp32", m.step_ranks)
    data = hardware_file(m, cal, name="here", fit=fit)
    hw = load_hardware(_written(tmp_path, data))  # still data only, the schema hardware.py reads
    assert hw.flop_efficiency == pytest.approx(fit.flop_efficiency) and "training step" in hw.source
    assert hw.peak("fp32") * 1e12 == pytest.approx(fit.peak_flops)
    assert whole_step(census, hw, 2, 2) == pytest.approx(m.steps[1][1], rel=1e-6)
    # The same step on 2 tensor-parallel ranks was measured too; where a latency gives it
    # back, the file's links hold that latency and the planner prices the step as measured.
    assert m.tp_step is not None and m.tp_step[0] == 2 and m.tp_step[1] > 0
    fit = fit_step(census, load_hardware(_written(tmp_path, hardware_file(m, cal, name="here"))), m.steps, "fp32",
                   m.step_ranks, m.tp_step)
    if fit.link_latency is not None:
        hw = load_hardware(_written(tmp_path, hardware_file(m, cal, name="here", fit=fit)))
        assert hw.intra_node_latency_us == pytest.approx(fit.link_latency * 1e6)
        assert tp_step(census, hw, 2, 2) == pytest.approx(m.tp_step[1], rel=1e-5)
    # And with ZeRO-1; where a factor gives it back, the file holds it and the planner prices it.
    assert m.zero_step is not None and m.zero_step[0] == 2 and m.zero_step[1] > 0
    fit = fit_step(census, load_hardware(_written(tmp_path, hardware_file(m, cal, name="here"))), m.steps, "fp32",
                   m.step_ranks, m.tp_step, m.zero_step)
    if fit.scatter_gather_factor is not None:
        hw = load_hardware(_written(tmp_path, hardware_file(m, cal, name="here", fit=fit)))
        assert hw.scatter_gather_factor == pytest.approx(fit.scatter_gather_factor) and "ZeRO-1" in hw.source
        assert whole_step(census, hw, 2, 2, zero=1) == pytest.approx(m.zero_step[1], rel=1e-5)


def _written(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "file.json"
    path.write_text(json.dumps(data))
    return str(path)
