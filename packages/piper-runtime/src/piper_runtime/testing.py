"""Helpers for tests that build ``Program``s by hand, and run ranks as threads of one process
or as processes of their own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

import attrs
import torch
from torch import nn

from piper_ir import (
    Instruction,
    NodeKind,
    Phase,
    Program,
    RankPlan,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
    Value,
    compute_id,
    event_id,
)


def with_stream_events(instructions: Sequence[Instruction]) -> list[Instruction]:
    """``instructions`` with the events a compiler would add, taken conservatively from the
    list order: each instruction waits for the latest earlier instruction of every other
    stream, so a threaded runtime runs them as the sequential order says."""
    latest: dict[str, str] = {}  # stream -> id of its latest instruction so far
    waits: dict[str, list[str]] = {}
    recorded: set[str] = set()
    for ins in instructions:
        for stream, nid in latest.items():
            if stream != ins.stream:
                waits.setdefault(ins.id, []).append(event_id(nid))
                recorded.add(nid)
        latest[ins.stream] = ins.id
    return [
        attrs.evolve(ins, waits=tuple(waits.get(ins.id, ())), record=event_id(ins.id) if ins.id in recorded else None)
        for ins in instructions
    ]


def tensor_meta(*shape: int, grad: bool = True, batch_dim: int | None = 0) -> TensorMeta:
    """A float32 ``TensorMeta`` (batch on dimension 0 unless told otherwise)."""
    return TensorMeta(shape, "float32", batch_dim=batch_dim, requires_grad=grad)


def compute(segment: str, phase: Phase, microbatch: int | None = None) -> Instruction:
    """A compute (or, for ``Phase.OPT``, optimizer) instruction with the compiler's id style,
    ``<phase>.<segment>[.mb<i>]``."""
    kind = NodeKind.OPTIMIZER if phase is Phase.OPT else NodeKind.COMPUTE
    return Instruction(compute_id(phase, segment, microbatch), kind, segment=segment, phase=phase, microbatch=microbatch)


class TanhLinear(nn.Module):
    """A stage segment's module: ``tanh(linear(x))``, the linear layer registered as ``name``
    (so that qualified parameter names are unique across segments)."""

    def __init__(self, name: str, lin: nn.Linear) -> None:
        super().__init__()
        self.name = name
        self.add_module(name, lin)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(getattr(self, self.name)(x)),)


class MSE(nn.Module):
    """A loss segment's module: the mean squared error of a prediction and its target."""

    def forward(self, y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(y, target)


def two_stage_values(rows: int, d_in: int, d_hidden: int, d_out: int) -> tuple[Value, ...]:
    """The values of a two-stage MLP program on ``rows`` samples per microbatch (shard):
    ``input:0``, ``target:0``, ``v:h`` (stage 0's output), ``v:y`` (stage 1's), ``v:loss`` and
    the gradients ``grad:v:h``, ``grad:v:y``."""
    return (
        Value("input:0", tensor_meta(rows, d_in, grad=False)),
        Value("target:0", tensor_meta(rows, d_out, grad=False)),
        Value("v:h", tensor_meta(rows, d_hidden)),
        Value("v:y", tensor_meta(rows, d_out)),
        Value("v:loss", tensor_meta(batch_dim=None)),
        Value("grad:v:h", tensor_meta(rows, d_hidden)),
        Value("grad:v:y", tensor_meta(rows, d_out)),
    )


def linear_params(name: str, fan_in: int, fan_out: int) -> tuple[tuple[str, TensorMeta], ...]:
    """A segment's parameter metas for an ``nn.Linear`` registered as ``name``."""
    return ((f"{name}.weight", tensor_meta(fan_out, fan_in, batch_dim=None)),
            (f"{name}.bias", tensor_meta(fan_out, batch_dim=None)))


def two_stage_segments(d_in: int, d_hidden: int, d_out: int) -> tuple[Segment, ...]:
    """Stage ``s0`` (``l0.*``, ``d_in -> d_hidden``), stage ``s1`` (``l1.*``,
    ``d_hidden -> d_out``) and ``loss``, over ``two_stage_values``' names (modules:
    ``TanhLinear("l0", ...)``, ``TanhLinear("l1", ...)``, ``MSE()``)."""
    return (
        Segment("s0", SegmentRole.STAGE, Tags.of(PP=0), ("input:0",), ("v:h",), linear_params("l0", d_in, d_hidden)),
        Segment("s1", SegmentRole.STAGE, Tags.of(PP=1), ("v:h",), ("v:y",), linear_params("l1", d_hidden, d_out)),
        Segment("loss", SegmentRole.LOSS, Tags.of(PP=1), ("v:y", "target:0"), ("v:loss",)),
    )


def one_rank_two_stages(
    instructions: Sequence[Instruction], microbatches: int, rows: int, d_in: int, d_hidden: int, d_out: int,
    segments: Sequence[Segment] | None = None,
) -> Program:
    """A one-rank program running ``instructions`` over ``segments`` (default:
    ``two_stage_segments``) on ``rows`` samples per microbatch."""
    segments = tuple(segments) if segments is not None else two_stage_segments(d_in, d_hidden, d_out)
    return Program(
        world_size=1, ranks=(RankPlan(0, tuple(instructions)),), communicators=(), segments=segments,
        values=two_stage_values(rows, d_in, d_hidden, d_out), inputs=("input:0",), targets=("target:0",),
        microbatches=microbatches, placement=tuple((s.id, (0,)) for s in segments),
    )


def on_every_rank(world_size: int, work: Callable[[int], object], timeout_s: float = 120.0) -> list[object]:
    """``work(rank)`` on one thread per rank (ranks as threads of this process, as the
    in-process backends run them); the results in rank order, or the first error. A rank
    still running after ``timeout_s`` is an error, not a hang."""
    results: list[object] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a rank did not finish within {timeout_s:g} s")
    if errors:
        raise errors[0]
    return results


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous the test's ranks make)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_as_processes(
    code: str, world_size: int, env: dict[str, str] | None = None, timeout_s: float = 120.0
) -> list[object]:
    """Run ``python -c code RANK PORT`` once per rank (``PORT``: one free loopback port for
    them all to meet on), with ``env`` over this process's environment; each rank's last
    line of output, read as JSON, in rank order. A rank that fails is an ``AssertionError``
    with its error output; one still running after ``timeout_s`` is killed and an error."""
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(rank), port], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        for rank in range(world_size)
    ]
    try:
        outputs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, (_out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{err[-4000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _err in outputs]


def listening(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on (/proc/net/tcp*: Linux)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(path).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                hexaddr, hexport = fields[1].split(":")
                raw = bytes.fromhex(hexaddr)
                # /proc prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                addr = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)
                found.append((addr, int(hexport, 16)))
    return found
