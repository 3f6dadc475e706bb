"""The runtime against single-device training, its failure behaviour, and reused workers
(``WorkerPool``) against fresh ones.

The Program is built by hand (no capture or scheduler here): a 2-rank GPipe pipeline,
s0 = Linear+tanh on rank 0, s1 = Linear and the MSE loss on rank 1, 4 microbatches, with
SEND/RECV pairs named and placed as docs/ir-conventions.md prescribes.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest
import ray
import torch
from ray import cloudpickle
from torch import nn

from piper_ir import (
    Communicator,
    ExecutionError,
    HangError,
    Instruction,
    NodeKind,
    NumericalError,
    Phase,
    Program,
    RankPlan,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
)
from piper_runtime import OptimizerSpec, Runtime, StepRequest, WorkerPool, shared_pool
from piper_runtime.driver.cluster import worker_env
from piper_runtime.driver.pool import WorkerSpec
from piper_runtime.rank.cores import claim, unclaimed
from piper_runtime.testing import MSE, tensor_meta, two_stage_values, with_stream_events

# The segment modules below live in this test module, which the workers cannot import.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

M, BATCH, D_IN, D_HID, D_OUT = 4, 8, 3, 5, 2
MB = BATCH // M


class Stage0(nn.Module):
    def __init__(self, l0: nn.Linear) -> None:
        super().__init__()
        self.l0 = l0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(self.l0(x)),)


class Stage1(nn.Module):
    def __init__(
        self, l1: nn.Linear, fail_on_call: int | None = None, sleep_s: float = 0.0, sleep_from_call: int = 0,
        sleep_once: bool = False,
    ) -> None:
        super().__init__()
        self.l1 = l1
        self.fail_on_call = fail_on_call
        self.sleep_s = sleep_s
        self.sleep_from_call = sleep_from_call
        self.sleep_once = sleep_once  # only call ``sleep_from_call`` sleeps, not every one after it
        self.calls = 0

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor]:
        if self.calls == self.fail_on_call:
            raise RuntimeError("boom in Stage1.forward")
        if self.calls == self.sleep_from_call or (self.calls > self.sleep_from_call and not self.sleep_once):
            time.sleep(self.sleep_s)
        self.calls += 1
        return (self.l1(h),)


def _params(prefix: str, d_in: int, d_out: int) -> tuple[tuple[str, TensorMeta], ...]:
    return (
        (f"{prefix}.weight", tensor_meta(d_out, d_in, batch_dim=None)),
        (f"{prefix}.bias", tensor_meta(d_out, batch_dim=None)),
    )


def gpipe_program() -> Program:
    """The hand-compiled 2-rank GPipe program (what piper_scheduler.compile would emit)."""
    h, y = "v:h", "v:y"
    values = two_stage_values(MB, D_IN, D_HID, D_OUT)
    segments = (
        Segment("s0", SegmentRole.STAGE, Tags.of(PP=0), ("input:0",), (h,), _params("l0", D_IN, D_HID)),
        Segment("s1", SegmentRole.STAGE, Tags.of(PP=1), (h,), (y,), _params("l1", D_HID, D_OUT)),
        Segment("loss", SegmentRole.LOSS, Tags.of(PP=1), (y, "target:0"), ("v:loss",)),
    )
    meta = {v.name: v.meta for v in values}

    def compute(seg: str, phase: Phase, mb: int | None = None) -> Instruction:
        kind = NodeKind.OPTIMIZER if phase is Phase.OPT else NodeKind.COMPUTE
        ident = f"{phase.value}.{seg}" + ("" if mb is None else f".mb{mb}")
        return Instruction(ident, kind, segment=seg, phase=phase, microbatch=mb)

    def p2p(kind: NodeKind, value: str, mb: int, src: int, dst: int) -> Instruction:
        comm = "pp.bwd" if value.startswith("grad:") else "pp.fwd"
        return Instruction(
            f"{kind.value}.{value}.mb{mb}.{src}-{dst}",
            kind,
            stream="pp",
            microbatch=mb,
            value=value,
            peer=dst if kind is NodeKind.SEND else src,
            communicator=comm,
            meta=meta[value],
        )

    r0, r1 = [], []
    for i in range(M):
        r0 += [compute("s0", Phase.F, i), p2p(NodeKind.SEND, h, i, 0, 1)]
        r1 += [p2p(NodeKind.RECV, h, i, 0, 1), compute("s1", Phase.F, i), compute("loss", Phase.F, i)]
    for i in range(M):
        r1 += [
            compute("loss", Phase.B, i),
            compute("s1", Phase.B, i),
            p2p(NodeKind.SEND, f"grad:{h}", i, 1, 0),
        ]
        r0 += [p2p(NodeKind.RECV, f"grad:{h}", i, 1, 0), compute("s0", Phase.B, i)]
    r0.append(compute("s0", Phase.OPT))
    r1.append(compute("s1", Phase.OPT))
    return Program(
        world_size=2,
        ranks=(RankPlan(0, with_stream_events(r0)), RankPlan(1, with_stream_events(r1))),
        communicators=(
            Communicator("pp.fwd", (0, 1), "activations"),
            Communicator("pp.bwd", (0, 1), "gradients"),
        ),
        segments=segments,
        values=values,
        inputs=("input:0",),
        targets=("target:0",),
        microbatches=M,
        placement=(("s0", (0,)), ("s1", (1,)), ("loss", (1,))),
    )


def _layers(seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    return nn.Linear(D_IN, D_HID), nn.Linear(D_HID, D_OUT)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_pipeline_matches_single_device(ray_cluster) -> None:
    l0, l1 = _layers()
    modules = {"s0": Stage0(l0), "s1": Stage1(l1), "loss": MSE()}
    ref = nn.ModuleDict({"l0": l0, "l1": l1})  # the oracle, trained on one device
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    spec = OptimizerSpec("sgd", lr=0.1, kwargs={"momentum": 0.9})

    with Runtime(gpipe_program(), modules, spec) as rt:  # modules are copied into the workers
        for step in range(3):
            x, t = _batch(step)
            result = rt.step((x,), (t,), keep_grads=True)

            ref_losses = [
                nn.functional.mse_loss(ref["l1"](torch.tanh(ref["l0"](xc))), tc).item()
                for xc, tc in zip(x.chunk(M), t.chunk(M), strict=True)
            ]
            ref_opt.zero_grad()
            full = nn.functional.mse_loss(ref["l1"](torch.tanh(ref["l0"](x))), t)
            full.backward()
            assert result.losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
            assert result.loss == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
            assert set(result.grads) == {n for n, _ in ref.named_parameters()}
            for name, p in ref.named_parameters():
                _close(result.grads[name], p.grad)
            ref_opt.step()

        params = rt.parameters()
        for name, p in ref.named_parameters():
            _close(params[name], p.detach())

        with pytest.raises(ValueError, match="no program for batch pieces of shapes input:0 .*add_variant"):
            rt.step((torch.randn(BATCH + 1, D_IN),), (torch.randn(BATCH + 1, D_OUT),))

        # A dead worker is reported by rank, and the runtime tears itself down.
        ray.kill(rt._workers[1])
        assert _dies(rt._workers[1])  # asynchronous: a step sent at once may still be served
        with pytest.raises(ExecutionError, match="rank 1 died"):
            rt.step(*((t,) for t in _batch(0)))
        assert rt.closed
    rt.shutdown()  # idempotent, also after __exit__


@pytest.mark.parametrize("runtime", ["ray", "local"])
@pytest.mark.parametrize("calls", ["one per step", "three steps in one"])
def test_submitted_steps_match_single_device(ray_cluster, calls: str, runtime: str) -> None:
    """Steps submitted ahead (``Runtime.submit``: all four queued before any result is read,
    results read last first; or the first three in one call per rank, ``submit_steps``)
    compute what single-device training does, step after step; memory is accounted only in
    the step that asks for it."""
    l0, l1 = _layers()
    modules = {"s0": Stage0(l0), "s1": Stage1(l1), "loss": MSE()}
    ref = nn.ModuleDict({"l0": l0, "l1": l1})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    spec = OptimizerSpec("sgd", lr=0.1, kwargs={"momentum": 0.9})

    def request(step: int) -> StepRequest:
        x, t = _batch(step)
        return StepRequest((x,), (t,), keep_grads=True, memory=step == 2)

    with Runtime(gpipe_program(), modules, spec, runtime=runtime) as rt:
        if calls == "one per step":
            pending = [rt.submit_steps([request(step)])[0] for step in range(4)]
        else:
            pending = [*rt.submit_steps([request(step) for step in range(3)]), *rt.submit_steps([request(3)])]
            assert pending[0].call is pending[2].call is not pending[3].call
        results = [p.result() for p in reversed(pending)][::-1]
        for step, result in enumerate(results):
            x, t = _batch(step)
            ref_opt.zero_grad()
            full = nn.functional.mse_loss(ref["l1"](torch.tanh(ref["l0"](x))), t)
            full.backward()
            assert result.loss == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
            for name, p in ref.named_parameters():
                _close(result.grads[name], p.grad)
            ref_opt.step()
            assert (len(result.memory) == 2 and all(m.total > 0 for m in result.memory)) if step == 2 else not result.memory
        params = rt.parameters()
        for name, p in ref.named_parameters():
            _close(params[name], p.detach())


@pytest.mark.parametrize("runtime", ["ray", "local"])
@pytest.mark.parametrize("calls", ["one per step", "three steps in one"])
def test_a_failed_submitted_step_fails_the_steps_after_it(ray_cluster, calls: str, runtime: str) -> None:
    """Also in one call of three steps, whose steps fail together: the error names the
    second step either way, and the third fails with the torn-down runtime."""
    l0, l1 = _layers()
    modules = {"s0": Stage0(l0), "s1": Stage1(l1, fail_on_call=M + 1), "loss": MSE()}  # fails in step 2
    rt = Runtime(gpipe_program(), modules, OptimizerSpec("sgd", lr=0.1), step_timeout_s=30, runtime=runtime)
    requests = [StepRequest(*((t,) for t in _batch(step))) for step in range(3)]
    if calls == "one per step":
        first, second, third = (rt.submit(r.inputs, r.targets) for r in requests)
    else:
        first, second, third = rt.submit_steps(requests)
    if calls == "one per step":
        assert first.result().loss > 0
        failing = second
    else:
        failing = first  # its result is lost with the call
    with pytest.raises(ExecutionError, match="boom in Stage1.forward") as info:
        failing.result()
    assert info.value.step == 2
    with pytest.raises(ExecutionError, match="shut down"):
        third.result()
    assert rt.closed


@pytest.mark.parametrize("runtime", ["ray", "local"])
def test_worker_exception_names_rank_and_instruction(ray_cluster, runtime: str) -> None:
    """On Ray, from the shared pool: the failed run's workers are killed, never given back
    (``test_workers_of_a_failed_run_are_never_reused``, for a run that raised)."""
    l0, l1 = _layers()
    modules = {"s0": Stage0(l0), "s1": Stage1(l1, fail_on_call=2), "loss": MSE()}
    rt = Runtime(gpipe_program(), modules, OptimizerSpec("sgd", lr=0.1), step_timeout_s=60, runtime=runtime,
                 reuse_workers=True)
    workers, idle = list(rt._workers), shared_pool().idle
    with pytest.raises(ExecutionError) as info:
        rt.step(*((t,) for t in _batch(0)))
    err = info.value
    assert err.ranks == (1,) and err.nodes == ("F.s1.mb2",)
    assert "rank 1, instruction F.s1.mb2 (s1:F2)" in str(err)
    assert "RuntimeError: boom in Stage1.forward" in str(err) and "Traceback" in str(err)
    assert rt.closed
    for w in workers if runtime == "ray" else ():  # torn down: nothing is left alive or blocked in a receive
        assert _dies(w)
    rt.shutdown()
    rt.shutdown()
    assert shared_pool().idle == idle  # none came back


def test_step_timeout_names_silent_ranks_and_the_step_they_are_in(ray_cluster) -> None:
    """A call of two steps, bounded at 1 s a step: the second step never ends (rank 1's first
    forward of it sleeps); the error names both ranks and step 2, not the call's first. The
    workers, from the shared pool, are killed, never given back
    (``test_workers_of_a_failed_run_are_never_reused``, for a run that timed out)."""
    l0, l1 = _layers()
    modules = {"s0": Stage0(l0), "s1": Stage1(l1, sleep_s=30.0, sleep_from_call=M), "loss": MSE()}
    with Runtime(gpipe_program(), modules, step_timeout_s=1.0, reuse_workers=True) as rt:
        workers, idle = list(rt._workers), shared_pool().idle
        with pytest.raises(ExecutionError, match=r"ranks \[0, 1\] did not answer within 2 s") as info:
            rt.submit_steps([StepRequest(*((t,) for t in _batch(step))) for step in range(2)])[0].result()
        assert info.value.ranks == (0, 1) and info.value.step == 2 and rt.closed
    assert shared_pool().idle == idle  # none came back
    assert all(_dies(w) for w in workers)


@pytest.mark.parametrize("runtime", ["ray", "local"])
def test_a_hung_rank_is_named_with_its_instruction_and_its_peers(ray_cluster, runtime: str) -> None:
    """Rank 1's first forward of step 2 never returns, in a call of two steps: the watchdog
    names step 2, rank 1 and that instruction (not every rank), says rank 0 waits for it, and
    kills both workers."""
    l0, l1 = _layers()
    # A local rank's thread cannot be killed: it sleeps on after the run (a daemon). It sleeps
    # once: sleeping in each of step 2's four forwards held the next local test up for 21 s.
    sleep_s = 3600.0 if runtime == "ray" else 6.0
    modules = {"s0": Stage0(l0), "s1": Stage1(l1, sleep_s=sleep_s, sleep_from_call=M, sleep_once=runtime == "local"),
               "loss": MSE()}
    rt = Runtime(gpipe_program(), modules, timeout_s=2.0, runtime=runtime)
    workers = list(rt._workers)
    with pytest.raises(HangError) as info:
        rt.submit_steps([StepRequest(*((t,) for t in _batch(step))) for step in range(2)])[0].result()
    err = info.value
    text = str(err)
    assert err.step == 2 and text.startswith("step 2: ")
    assert err.ranks == (1,) and err.nodes == ("F.s1.mb0",)
    assert "rank 1 is stuck: no progress for" in text and "in compute F.s1.mb0 (s1:F0), microbatch 0" in text
    # Rank 0 sent its activations and waits for the first gradient from rank 1 (on the local
    # runtime too: these forwards draw nothing, so rank 1's holds no lock rank 0 waits for).
    assert "rank 0: in recv recv.grad:v:h.mb0.1-0 (RECV grad:v:h#0 <-1), microbatch 0, from rank 1" in text
    assert rt.closed
    for w in workers if runtime == "ray" else ():  # a local rank's thread sleeps on, a daemon
        assert _dies(w)


def _poisoned(step: int, mb: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch with a NaN in microbatch ``mb``'s inputs."""
    x, y = _batch(step)
    x = x.clone()
    x[mb * MB, 0] = float("nan")
    return x, y


@pytest.mark.parametrize("runtime", ["ray", "local"])
def test_a_nan_stops_the_run_naming_step_microbatch_and_rank(ray_cluster, runtime: str) -> None:
    l0, l1 = _layers()
    with Runtime(gpipe_program(), {"s0": Stage0(l0), "s1": Stage1(l1), "loss": MSE()}, runtime=runtime) as rt:
        rt.step(*((t,) for t in _batch(0)))
        with pytest.raises(NumericalError, match=r"step 2: the loss of microbatch 1 is nan \(rank 1\)") as info:
            rt.step(*((t,) for t in _poisoned(1)))
        assert info.value.step == 2


@pytest.mark.parametrize("runtime", ["ray", "local"])
def test_skip_step_leaves_parameters_and_optimizer_state_exactly_as_before(ray_cluster, runtime: str) -> None:
    """A skipped step is as if it never ran: Adam (whose moments and step count a step would
    change) then trains to the same parameters, bit for bit, as a run without that batch."""
    spec = OptimizerSpec("adam", lr=0.01)

    def run(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, dict]:
        l0, l1 = _layers()
        with Runtime(gpipe_program(), {"s0": Stage0(l0), "s1": Stage1(l1), "loss": MSE()}, spec,
                     on_nan="skip-step", runtime=runtime) as rt:
            with pytest.raises(ValueError, match="not with on_nan='skip-step'"):  # refused, nothing sent
                rt.submit_steps([StepRequest((x,), (y,)) for x, y in batches[:2]])
            seen = []
            for x, y in batches:
                before = rt.parameters()
                result = rt.step((x,), (y,))
                after = rt.parameters()
                seen.append((result, all(torch.equal(before[n], after[n]) for n in before)))
            return seen, rt.parameters()

    with_bad, params = run([_batch(0), _poisoned(1), _batch(2), _batch(3)])
    without, want = run([_batch(0), _batch(2), _batch(3)])
    (r0, _), (bad, unchanged), *_ = with_bad
    assert bad.skipped and unchanged and bad.nonfinite == "the loss of microbatch 1 is nan (rank 1)"
    assert not r0.skipped and r0.nonfinite is None and not any(same for _, same in without)
    assert [r.losses for r, _ in with_bad[2:]] == [r.losses for r, _ in without[1:]]
    assert params.keys() == want.keys() and all(torch.equal(params[n], want[n]) for n in want)


# -- reusing workers (piper_runtime.driver.pool) --------------------------------------------------------


class Meddler(Stage1):
    """``Stage1`` that also changes the process-wide settings a reset must put back."""

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor]:
        torch.manual_seed(1234)
        sys.setswitchinterval(0.25)
        torch.set_num_threads(3)
        out = super().forward(h)
        torch.set_default_dtype(torch.float64)
        return out


def _settings(worker: object) -> tuple:
    """What a worker process says about the settings a run may change, and what it holds
    (the cores: of the thread that runs the worker's calls, bound during a run)."""
    return (sys.getswitchinterval(), torch.get_num_threads(), torch.get_default_dtype(), torch.initial_seed(),
            sorted(vars(worker)), sorted(os.sched_getaffinity(0)))


def test_cores_another_job_claims_are_left_to_it(ray_cluster) -> None:
    """This process plays another job that claimed every core of the host: the run binds
    none and says why; once the claims are gone, a run binds again (unless yet another job
    holds them)."""
    host = tuple(sorted(os.sched_getaffinity(0)))
    held = [claim((core,)) for core in host]  # a core another process holds stays held all the same
    assert unclaimed(host) == ()
    logged: list[str] = []
    try:
        with Runtime(gpipe_program(), _modules(), reuse_workers=True, log=logged.append) as rt:
            rt.step(*((t,) for t in _batch(0)))
            assert ray.get([w.cores.remote() for w in rt._workers], timeout=30) == [host] * 2
    finally:
        for c in held:
            if c is not None:
                c.release()
    (line,) = [m for m in logged if m.startswith("cores:")]
    assert line.startswith("cores: not bound (no host has a free core for each of its ranks; cores ")
    assert line.endswith(f" of {socket.gethostname()} held by another job)"), line
    if len(host) >= 2 and unclaimed(host) == host:
        logged.clear()
        with Runtime(gpipe_program(), _modules(), reuse_workers=True, log=logged.append) as rt:
            width = len(host) // 2
            bound = ray.get([w.cores.remote() for w in rt._workers], timeout=30)
            assert bound == [host[:width], host[width : 2 * width]]
            assert unclaimed(host) == host[2 * width :]  # the run's own claims, while it runs
        assert unclaimed(host) == host  # given back with the workers


def _modules() -> dict[str, nn.Module]:
    l0, l1 = _layers()
    return {"s0": Stage0(l0), "s1": Stage1(l1), "loss": MSE()}


def _train(rt: Runtime) -> tuple[list, list, dict]:
    """Three steps on ``rt``: every step's losses and gradients, then the parameters."""
    losses, grads = [], []
    for step in range(3):
        result = rt.step(*((t,) for t in _batch(step)), keep_grads=True)
        losses.append(result.losses)
        grads.append(result.grads)
    return losses, grads, rt.parameters()


def test_reused_workers_give_a_fresh_workers_results_forget_their_run_and_spares_follow_a_failed_run(
    ray_cluster,
) -> None:
    """A pool's two workers, new, then reused (bit for bit what they computed new, with a new
    worker's settings); then, with two spares asked for, the same pool's workers run a run that
    fails (``_spares_serve_the_runtime_after_a_failed_run``). One pool for both: every worker
    start costs seconds."""
    spec = OptimizerSpec("sgd", lr=0.1, kwargs={"momentum": 0.9})
    pool, workers = WorkerPool(), WorkerSpec.of("cpu", 0.0, worker_env())

    def modules(stage1: type[Stage1] = Stage1, seed: int = 0) -> dict[str, nn.Module]:
        l0, l1 = _layers(seed)
        return {"s0": Stage0(l0), "s1": stage1(l1), "loss": MSE()}

    def settings() -> list[tuple]:
        """What the pool's idle workers say about themselves (taken out and put back)."""
        taken = pool.acquire(2, workers)
        try:
            return ray.get([w.__ray_call__.remote(_settings) for w in taken], timeout=30)
        finally:
            pool.release(taken, workers)

    new = settings()  # two new workers, never set up
    assert pool.started == 2
    logged: list[str] = []
    with Runtime(gpipe_program(), modules(), spec, reuse_workers=pool, log=logged.append) as rt:
        pids = ray.get([w.ping.remote() for w in rt._workers], timeout=30)
        fresh = _train(rt)  # on workers that ran nothing before
        # Two ranks on one host: each bound to a free core of its own where the host has two
        # (a test process beside this one may hold some: the log then says so).
        host = tuple(sorted(os.sched_getaffinity(0)))
        bound = ray.get([w.cores.remote() for w in rt._workers], timeout=30)
        (line,) = [m for m in logged if m.startswith("cores:")]
        if "meanwhile" in line:  # a parallel session's job claimed a core between our look and our claims
            assert "another job claimed" in line and list(host) in [list(b) for b in bound], (line, bound)
        elif bound == [host] * 2:
            assert "not bound" in line and (len(host) < 2 or "held by another job" in line), line
        else:  # halves of the free cores
            assert len(bound[0]) == len(bound[1]) >= 1 and not set(bound[0]) & set(bound[1]), bound
            assert set(bound[0] + bound[1]) <= set(host) and "rank 0: " in line and "rank 1: " in line, line
    with Runtime(gpipe_program(), modules(Meddler, seed=5), OptimizerSpec("adam", 0.01), reuse_workers=pool,
                 threads=False) as rt:
        rt.step(*((t,) for t in _batch(0)))
    # A reset worker holds what a new one holds, with a new worker's settings, and torch's
    # generators were reseeded (not left at the meddler's seed).
    after = settings()
    assert [s[:3] for s in after] == [s[:3] for s in new] == [(0.005, 1, torch.float32)] * 2
    assert [s[4] for s in after] == [s[4] for s in new]
    assert [s[5] for s in after] == [s[5] for s in new] == [sorted(os.sched_getaffinity(0))] * 2  # unbound
    assert all(s[3] != 1234 for s in after)

    with Runtime(gpipe_program(), modules(), spec, reuse_workers=pool) as rt:
        assert ray.get([w.ping.remote() for w in rt._workers], timeout=30) == pids  # the same processes
        reused = _train(rt)
    assert pool.started == 2 and pool.idle == 2
    # Bit for bit: the same computation in the same order.
    (losses, grads, params), (want_losses, want_grads, want_params) = reused, fresh
    assert losses == want_losses
    for got, want in [*zip(grads, want_grads, strict=True), (params, want_params)]:
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    _spares_serve_the_runtime_after_a_failed_run(pool)
    pool.clear()
    assert pool.idle == 0
    with pytest.raises(ValueError, match="spares must be between 0 and max_idle"):
        WorkerPool(max_idle=1, spares=2)


def _spares_serve_the_runtime_after_a_failed_run(pool: WorkerPool) -> None:
    """``pool``, holding two idle workers (the only two it started), asked for two spares,
    starts them once a runtime's two workers (its idle ones) are set up. That run
    fails (its workers are killed, never reused): the next runtime takes the spares, and
    computes what the local runtime computes (whether the spares had started by then, or were
    handed out still starting, as new workers are). Two worker starts more in all: the second
    runtime starts no spares of its own (``spares`` set to 0 first)."""
    reused = pool.reused
    assert (pool.started, pool.idle) == (2, 2)
    pool.spares = 2
    l0, l1 = _layers()
    rt = Runtime(gpipe_program(), {"s0": Stage0(l0), "s1": Stage1(l1, fail_on_call=0), "loss": MSE()},
                 reuse_workers=pool)
    failed = list(rt._workers)
    assert (pool.started, pool.reused, pool.idle) == (4, reused + 2, 2)
    with pytest.raises(ExecutionError):
        rt.step(*((t,) for t in _batch(0)))
    rt.shutdown()
    assert pool.idle == 2 and all(_dies(w) for w in failed)
    pool.spares = 0
    with Runtime(gpipe_program(), _modules(), reuse_workers=pool) as again:
        assert (pool.started, pool.reused, pool.idle) == (4, reused + 4, 0)
        assert not set(again._workers) & set(failed)
        got = _train(again)
    with Runtime(gpipe_program(), _modules(), runtime="local") as local:
        want = _train(local)
    assert got[0] == want[0]
    for a, b in [*zip(got[1], want[1], strict=True), (got[2], want[2])]:
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in b)


def test_workers_of_a_failed_run_are_never_reused(ray_cluster) -> None:
    """A worker that dies between calls: the reset at shutdown gets no answer, and neither
    worker goes back to the pool. (A run that raised, or timed out:
    ``test_worker_exception_names_rank_and_instruction[ray]``,
    ``test_step_timeout_names_silent_ranks_and_the_step_they_are_in``.)"""
    pool = shared_pool()
    rt = Runtime(gpipe_program(), _modules(), reuse_workers=True)
    workers, idle = list(rt._workers), pool.idle
    ray.kill(workers[1])
    rt.shutdown()
    assert pool.idle == idle  # none came back
    assert all(_dies(w) for w in workers)


def _dies(worker: object, tries: int = 60) -> bool:
    """Whether ``worker`` stops answering: ``ray.kill`` takes effect asynchronously, so a call
    made just after it may still be served."""
    for _ in range(tries):
        try:
            ray.get(worker.ping.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.5)
    return False
