"""The CUDA backend's own code, run on CPU: compiled programs against single-device training.

``CudaBackend`` is built with fakes (``piper_runtime.backends.fakes``): a device whose
streams log what is queued on them, NCCL among threads, a host world in memory. Everything
else is the real backend: lanes on device streams with fork/join and device-side event
waits, one NCCL communicator per (sender, receiver) channel with its own stream, collectives
on the instruction's stream, the early reduce-scatter on a side stream, the uneven
all-to-all as grouped sends and receives, host-staged communicators where ranks share a GPU,
communicator set-up through the store. Ranks are threads of this process (no Ray).

What this cannot show: real kernel timing and NCCL's own behaviour (the GPU tests and
benchmarks/gpu_check.sh do, where a GPU exists).
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from piper_directives import Place, Shard, Split, Strategy, build_schedule, capture, shard_modules
from piper_memory import plan_memory
from piper_runtime import ExecutionOptions, OptimizerSpec, RankSetup, RankWorker
from piper_runtime.backends.cuda import CudaBackend
from piper_runtime.backends.fakes import FakeDevice, FakeNccl, MemoryWorld
from piper_runtime.backends.gpu_plan import Transport
from piper_runtime.batch import batch_reads, check_batch, replica_slice
from piper_runtime.driver.merge import merge_outputs, merge_parameters
from piper_runtime.testing import on_every_rank
from piper_scheduler import compile_program
from piper_train.models import build_model
from piper_train.reference import ReferenceTrainer

TIMEOUT_S = 60.0
_WORLDS = itertools.count(1)


@pytest.fixture(autouse=True)
def _restore_process_settings() -> Iterator[None]:
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    yield
    torch.set_num_threads(threads)
    sys.setswitchinterval(interval)


def _run(workload, strategy: Strategy, gpus: list[str], steps: int = 2, **options: object) -> list[RankWorker]:
    """Train ``steps`` steps with rank r on fake GPU ``gpus[r]``; compare with one device.
    ``options``: ``ExecutionOptions``' fields."""
    captured = capture(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn)
    graph, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
    program = compile_program(plan_memory(graph))
    assert program.world_size == len(gpus)
    optimizer = OptimizerSpec("adamw", 1e-3)
    reference = ReferenceTrainer(workload.model, workload.loss_fn, optimizer, program.microbatches)
    workers = [RankWorker(own_process=False) for _ in range(program.world_size)]  # threads of this process
    world = MemoryWorld()
    key = next(_WORLDS)
    MemoryWorld._worlds[("fake-cuda", key)] = world

    def setup(rank: int) -> None:
        mine = {s: copy.deepcopy(modules[s]) for s in program.plan(rank).segments()}

        def factory() -> CudaBackend:
            return CudaBackend(FakeDevice(gpus[rank]), FakeNccl(world), join=lambda r, *_: world_host(r))

        setup = RankSetup(ExecutionOptions(**options), wait_s=TIMEOUT_S, seed=None)
        workers[rank].setup(rank, program.world_size, "in-process", key, program, mine, optimizer, factory, setup)

    def world_host(rank: int):
        from piper_runtime.backends.fakes import MemoryHost

        return MemoryHost(world, rank)

    on_every_rank(program.world_size, setup)
    for step in range(steps):
        inputs, targets = workload.batches(step)
        batch = check_batch(program, inputs, targets)

        def run_step(rank: int, batch=batch):
            replica = program.plan(rank).replica
            mine = {
                n: replica_slice(batch[n], program.value_by_name[n].meta, program.microbatches, program.replicas, replica)
                for n in batch_reads(program, rank)
            }
            return workers[rank].run_step(mine, keep_grads=True)

        got = merge_outputs(on_every_rank(program.world_size, run_step), program, keep_grads=True)
        want = reference.step(inputs, targets)
        assert got.losses == pytest.approx(want.losses, rel=1e-9, abs=1e-12)
        for name, g in want.grads.items():
            torch.testing.assert_close(got.grads[name], g, rtol=1e-9, atol=1e-12, msg=f"step {step} grad {name}")
    params = merge_parameters(program, [w.parameters() for w in workers], [w.parameter_shards() for w in workers])
    for name, p in reference.parameters().items():
        torch.testing.assert_close(params[name], p, rtol=1e-9, atol=1e-12, msg=f"parameter {name}")
    for w in workers:
        w.shutdown()
    return workers


CASES = {
    # name: (model, stages, strategy, fake GPU of each rank)
    "1f1b pp=2": ("mlp", 2, lambda: build_schedule("1f1b", 2, 4, stages=2), ["g0", "g1"]),
    "1f1b pp=2 dp=2 zero=3": ("mlp", 2, lambda: build_schedule("1f1b", 2, 4, stages=2, dp=2, zero=3),
                              ["g0", "g1", "g2", "g3"]),
    "gpipe dp=2 zero=2": ("mlp", 2, lambda: build_schedule("gpipe", 1, 2, stages=2, dp=2, zero=2), ["g0", "g1"]),
    "tp=2": ("transformer", 1, lambda: Strategy([Split(2), Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1))]),
             ["g0", "g1"]),
    "ep=2": ("moe", 1, lambda: Strategy([Split(2), Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1), kind="ep")]),
             ["g0", "g1"]),
    "dualpipev pp=2": ("mlp", 4, lambda: build_schedule("dualpipev", 2, 4, stages=4), ["g0", "g1"]),
    # Every rank on one GPU: everything host-staged.
    "1f1b pp=2 dp=2 zero=1, one GPU": ("mlp", 2, lambda: build_schedule("1f1b", 2, 4, stages=2, dp=2, zero=1),
                                       ["g0", "g0", "g0", "g0"]),
    # Two ranks per GPU: pipeline pairs share one (staged channels), replicas do not (NCCL groups).
    "1f1b pp=2 dp=2 zero=2, two GPUs": ("mlp", 2, lambda: build_schedule("1f1b", 2, 4, stages=2, dp=2, zero=2),
                                        ["g0", "g0", "g1", "g1"]),
    "ep=2, one GPU": ("moe", 1, lambda: Strategy([Split(2), Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1), kind="ep")]),
                      ["g0", "g0"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_cuda_backend_on_fakes_matches_single_device_training(case: str) -> None:
    model, stages, strategy, gpus = CASES[case]
    workload = build_model(model, stages=stages, seed=11, dtype=torch.float64)
    workers = _run(workload, strategy(), gpus)
    assert not dist.is_initialized()  # the fakes' host world, not torch.distributed
    backends = [w.backend for w in workers]
    assert all(isinstance(b, CudaBackend) for b in backends)
    assert all(w.threads for w in workers)  # one lane per stream
    shared = len(set(gpus)) < len(gpus)
    for rank, b in enumerate(backends):
        for ranks, how in b.transports:
            # Host-staged exactly where two ends or members share a GPU.
            share = len({gpus[r] for r in ranks}) < len(ranks)
            assert how is (Transport.HOST if share else Transport.NCCL), (rank, ranks, how)
    kinds = {how for b in backends for _, how in b.transports}
    assert (Transport.HOST in kinds) == shared
    # Lanes are device streams, linked by device-side waits on recorded events.
    log = [entry for b in backends for entry in b.gpu.log]
    lanes = {stream for stream, what in log if what[0] == "wait"}
    assert "compute" in lanes


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_weight_products_after_the_input_gradients_send_on_device_streams(schedule: str) -> None:
    """Every ``nn.Linear`` fused (``grad_fusion_min_bytes=0``): the last backward of each stage
    that sends a gradient leaves its weight products until the send is issued
    (``piper_runtime.rank.input_grads_first``), on the lanes' device streams; single-device results."""
    stages = 4 if schedule == "interleaved_1f1b" else 2
    workload = build_model("mlp", stages=stages, seed=11, dtype=torch.float64)
    workers = _run(workload, build_schedule(schedule, 2, 4, stages=stages), ["g0", "g1"], grad_fusion_min_bytes=0)
    # One window per stage that sends a gradient: rank 1's one stage (two when interleaved),
    # and rank 0's later stage when interleaved (stage 0 sends none).
    windows = [len(w._executor.windows) for w in workers]
    assert windows == ([1, 2] if stages == 4 else [0, 1])


def test_one_gpu_per_rank_uses_nccl_channels_per_direction() -> None:
    """DualPipeV sends both ways between two ranks: one channel (NCCL communicator and
    stream) per direction, so neither direction's sends wait behind the other's."""
    workload = build_model("mlp", stages=4, seed=3, dtype=torch.float64)
    workers = _run(workload, build_schedule("dualpipev", 2, 4, stages=4), ["g0", "g1"], steps=1)
    b0 = workers[0].backend
    channels = {ranks for ranks, how in b0.transports if len(ranks) == 2 and how is Transport.NCCL}
    assert {(0, 1), (1, 0)} <= channels
    streams = {stream for stream, what in b0.gpu.log if what[0] in ("nccl.send", "nccl.recv")}
    # each (communicator, direction) has a stream of its own; none is a lane's stream
    assert streams and not streams & {"compute", "pp", "dp", "default"}
    sends = {s for s, what in b0.gpu.log if what[0] == "nccl.send"}
    recvs = {s for s, what in b0.gpu.log if what[0] == "nccl.recv"}
    assert not sends & recvs
