"""Tensor- and expert-parallel segments on one rank: cutting their parameters, binding their
collectives to communicators, reading back the time spent in them.

``Program.sharding`` says how each sharded segment's parameters are cut over its group
(docs/ir-conventions.md, sections 8 and 9). At setup a rank replaces each listed parameter
by its own piece (before buckets and optimizers see it), and hands every submodule that has a
``bind_communicator`` method (piper-directives' ``TensorParallelComm``/``ExpertParallelComm``)
the communicators of its own shard group: the forward one and the one for backward passes
(``piper_runtime.rank.comms``). Those modules call the communicator's ``all_reduce`` /
``all_to_all`` and never ``torch.distributed``; they record the seconds each call took in
``collective_times``, which ``collective_seconds`` sums per step.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

from piper_ir import ExecutionError, Program, ShardKind
from piper_memory.store import shard_tensor
from piper_runtime.rank.comms import Communicators


def cut_parameters(program: Program, rank: int, modules: Mapping[str, nn.Module]) -> None:
    """Cut the parameters of this rank's sharded segments to its shard (``Sharding.params``)."""
    cut: dict[int, nn.Parameter] = {}  # by id, each tensor once
    for sh in program.sharding:
        if sh.segment not in modules:
            continue
        if rank not in sh.devices:
            raise ExecutionError(
                f"rank {rank}: segment {sh.segment} is sharded over {list(sh.devices)}, not on this rank",
                ranks=(rank,),
            )
        module = modules[sh.segment]
        with torch.no_grad():
            for spec in sh.params:
                try:
                    p = module.get_parameter(spec.name)
                except AttributeError:
                    raise ExecutionError(
                        f"rank {rank}: sharded parameter {spec.name!r} is not in segment {sh.segment}'s module",
                        ranks=(rank,),
                    ) from None
                if id(p) in cut:  # a tied parameter the holders share (alias_tied), cut alike by each
                    continue
                cut[id(p)] = p
                degree = sh.degree_of(spec)
                p.data = shard_tensor(p.data, spec, degree, sh.position(rank, degree))


def unbucketed_experts(program: Program, rank: int) -> dict[str, tuple[str, ...]]:
    """Per expert-parallel segment (or tensor- and expert-parallel one), its expert parameters
    that no bucket on this rank covers (each expert on one rank of its group, no data-parallel
    replicas of the group): they are trained where they live, without any reduction."""
    bucketed = {(b.segment, n) for b in program.buckets if not b.devices or rank in b.devices for n in b.params}
    return {
        sh.segment: tuple(spec.name for spec in sh.params
                          if (sh.kind is ShardKind.EP or spec.experts) and (sh.segment, spec.name) not in bucketed)
        for sh in program.sharding
        if sh.kind is ShardKind.EP or sh.expert_degree > 1
    }


def bind_collectives(program: Program, rank: int, modules: Mapping[str, nn.Module], comms: Communicators) -> None:
    """Give each sharded segment's modules the communicators of this rank's shard group: the
    ``traffic`` a module declares (``"ep"`` for the all-to-alls of a tensor- and
    expert-parallel segment, whose group is its ``expert_degree`` ranks), else the segment's
    kind."""
    for sh in program.sharding:
        if sh.segment not in modules or not sh.collectives:
            continue
        bound = 0
        for m in modules[sh.segment].modules():
            bind = getattr(m, "bind_communicator", None)
            if callable(bind):
                traffic = getattr(m, "traffic", None) or sh.kind
                # this rank's shard group (data x tensor: one of several)
                group = sh.group_of(rank, sh.expert_degree if traffic != sh.kind else None)
                comm = next(
                    (c for c in program.communicators if c.traffic == traffic and tuple(c.ranks) == group),
                    None,
                )
                if comm is None:
                    raise ExecutionError(
                        f"rank {rank}: no {traffic} communicator over {list(group)} for segment {sh.segment}",
                        ranks=(rank,),
                    )
                accepts = inspect.signature(bind).parameters
                extra = {"position": group.index(rank)} if "position" in accepts else {}
                if "backward_comm" in accepts:
                    bind(comms.forward[comm.id], backward_comm=comms.backward[comm.id], **extra)
                else:
                    bind(comms.forward[comm.id], **extra)
                bound += 1
        if not bound:
            raise ExecutionError(
                f"rank {rank}: segment {sh.segment} issues {sh.collectives} tensor-parallel collectives "
                "but its module has nothing to bind the communicator to",
                ranks=(rank,),
            )


def collective_seconds(modules: Mapping[str, nn.Module]) -> float:
    """Seconds spent in the collectives that compute issued since the last call (modules
    that keep ``collective_times``, as the tensor- and expert-parallel rewrites do); resets
    them."""
    total = 0.0
    for module in modules.values():
        for m in module.modules():
            times = getattr(m, "collective_times", None)
            if isinstance(times, list):
                total += sum(times)
                times.clear()
    return total
