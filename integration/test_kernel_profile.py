"""``piper train --profile-step N``: each rank's torch.profiler trace of that step, merged into
one Chrome/Perfetto trace with every operator under the Piper instruction that ran it."""

from __future__ import annotations

import json

import pytest


def _profiled(piper, tmp_path) -> tuple[list[dict], dict]:
    done = piper("train", "--model", "mlp", "--pp", "2", "--steps", "2", "--profile-step", "2",
                 "--profile-dir", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    trace = json.loads((tmp_path / "step2.kernels.trace.json").read_text())
    return trace["traceEvents"], json.loads(done.stdout)


def _within_instructions(events: list[dict]) -> tuple[set[str], int, int]:
    """The instruction labels, and how many matrix products ran inside one of them (same
    process and thread, inside its span) out of how many there are."""
    spans = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("piper ")]
    lanes = {(s["pid"], s["tid"]) for s in spans}  # the ranks' threads (the local runtime's process has others)
    products = [e for e in events if e.get("ph") == "X" and e.get("name") in ("aten::addmm", "aten::mm")
                and (e["pid"], e["tid"]) in lanes]
    inside = sum(
        any(s["pid"] == p["pid"] and s["tid"] == p["tid"] and s["ts"] <= p["ts"] <= s["ts"] + s["dur"] for s in spans)
        for p in products
    )
    return {s["name"] for s in spans}, inside, len(products)


def _check(events: list[dict]) -> None:
    labels, inside, products = _within_instructions(events)
    # Both ranks' forwards and backwards of every microbatch (the mlp: s0 on rank 0, s1 on rank 1).
    assert {f"piper {p}.s{s}.mb{m}" for p in "FB" for s in (0, 1) for m in range(4)} <= labels
    assert products > 0 and inside == products  # every matrix product under the instruction that ran it


def test_local_ranks_share_one_trace_with_every_instruction(piper, tmp_path):
    events, _ = _profiled(piper, tmp_path)
    _check(events)
    # No forward of the model beside the step on another thread of the process: fit counts
    # the model's FLOPs (its linear layers' addmm, on the meta device) before it sends the
    # profiled step. (The driver drawing a batch meanwhile is the user's data: matmul, no addmm.)
    lanes = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("piper ")}
    assert not [e for e in events if e.get("ph") == "X" and e.get("name") == "aten::addmm"
                and (e["pid"], e["tid"]) not in lanes]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name" and isinstance(e.get("pid"), int)}
    assert names == {"piper ranks 0-1 (one process)"}


@pytest.mark.ray
def test_ray_ranks_each_send_their_trace(piper, tmp_path):
    events, _ = _profiled(piper, tmp_path)
    _check(events)
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name" and isinstance(e.get("pid"), int)}
    assert names == {"piper rank 0", "piper rank 1"}


def test_unprofiled_steps_record_no_trace(tmp_path):
    from piper_directives import build_schedule
    from piper_train import Trainer
    from piper_train.models import build_model

    spec = build_model("mlp", stages=2)
    with Trainer(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn,
                 build_schedule("1f1b", 2, 2, stages=2), runtime="local", profile_kernels=True) as trainer:
        assert trainer.step(*spec.batches(0)).kernel_traces == ()
        assert len(trainer.step(*spec.batches(1), profile=True).kernel_traces) == 1


def test_a_memory_snapshot_is_the_steps_accounting_over_time(tmp_path):
    """``--memory-snapshot`` keeps every sample of the profiled step: the peak of each rank's
    timeline is the peak the step reports (``RankMemory.total``), one sample before the first
    instruction and one after each."""
    from piper_directives import build_schedule
    from piper_runtime import MEMORY_CATEGORIES
    from piper_train import Trainer
    from piper_train.metrics import memory_counters
    from piper_train.models import build_model

    spec = build_model("mlp", stages=2)
    with Trainer(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn,
                 build_schedule("1f1b", 2, 2, stages=2), runtime="local", memory_snapshot=True) as trainer:
        trainer.step(*spec.batches(0))
        result = trainer.step(*spec.batches(1), profile=True)
        timelines = dict(result.memory_timelines)
        assert sorted(timelines) == [0, 1]
        for memory in result.memory:
            samples = timelines[memory.rank]
            assert len(samples) == len(trainer.program.ranks[memory.rank].instructions) + 1
            assert max(sum(sizes) for _, sizes in samples) == memory.total
            assert all(len(sizes) == len(MEMORY_CATEGORIES) for _, sizes in samples)
        counters = [e for e in memory_counters(result.memory_timelines)["traceEvents"] if e["ph"] == "C"]
        assert len(counters) == sum(len(s) for s in timelines.values())
        assert trainer.step(*spec.batches(2)).memory_timelines == ()  # only a profiled step keeps them
