"""Tied parameters (``Program.ties``) on one rank and on the driver.

A tie is one logical parameter held by several segments (docs/ir-conventions.md, section 12).
Its sums are ordinary bucket instructions; what is left for a runtime:

- ``alias_tied``: the holders a rank runs share one tensor (the first holder's, in the tie's
  segment order), so their passes accumulate into one gradient and one optimizer steps it
  (``DataParallel.owner``: a parameter is stepped by its bucket's segment, else by the first
  segment holding it);
- ``untie``: the driver reports a tie once, under ``Tie.name`` (what single-device training
  calls it), after checking that every copy it received is the same (for a tie cut by
  tensor parallelism, that the copies hold no more different pieces than the degree):
  copies that drifted apart are an ``ExecutionError``, never a silently different model.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch
from torch import nn

from piper_ir import ExecutionError, Program


def alias_tied(program: Program, modules: Mapping[str, nn.Module]) -> None:
    """Make the holders of each tie on this rank (``modules``) share the first one's tensor."""
    for tie in program.ties:
        present = [(seg, qualname) for seg, qualname in tie.holders if seg in modules]
        if len(present) < 2:
            continue
        seg, qualname = present[0]
        shared = modules[seg].get_parameter(qualname)
        for seg, qualname in present[1:]:
            owner, _, leaf = qualname.rpartition(".")
            module = modules[seg].get_submodule(owner)
            if getattr(module, leaf) is not shared:
                setattr(module, leaf, shared)


def untie(
    program: Program,
    tensors: MutableMapping[str, torch.Tensor],
    copies: Mapping[str, Sequence[tuple[str, torch.Tensor]]] = {},
) -> None:
    """Report each tie under its name in ``tensors`` (the other holders' names removed);
    ``copies`` (tie name -> (where, tensor) of every copy received) must agree bitwise."""
    for tie in program.ties:
        found = copies.get(tie.name, ())
        pieces = _pieces(program, tie)
        if pieces > 1:  # cut alike by tensor parallelism: one piece per position, equal over replicas
            distinct: list[tuple[str, torch.Tensor]] = []
            for where, t in found:
                if not any(t.shape == d.shape and torch.equal(t, d) for _, d in distinct):
                    distinct.append((where, t))
            if len(distinct) > pieces:
                raise ExecutionError(
                    f"tied parameter {tie.name!r}: its copies differ ({', '.join(w for w, _ in distinct)} hold "
                    f"{len(distinct)} different pieces, not {pieces}); every holder must take the same update"
                )
            found = ()
        for where, t in found[1:]:
            if t.shape != found[0][1].shape or not torch.equal(t, found[0][1]):
                diff = (t.double() - found[0][1].double()).abs().max().item() if t.shape == found[0][1].shape else None
                raise ExecutionError(
                    f"tied parameter {tie.name!r}: its copies differ ({found[0][0]} vs {where}"
                    + (f", max |difference| {diff:.3e}" if diff is not None else ", shapes differ")
                    + "); every holder must take the same update"
                )
        names = [qualname for _, qualname in tie.holders if qualname in tensors]
        if not names:
            continue
        value = tensors[tie.name] if tie.name in tensors else tensors[names[0]]
        for name in names:
            tensors.pop(name, None)
        tensors[tie.name] = value


def _pieces(program: Program, tie) -> int:  # a Tie
    """How many different pieces the ranks hold of ``tie``: its tensor-parallel degree where
    its holders cut it (a vocabulary-parallel embedding and head), else 1."""
    held = set(tie.holders)
    return max((sh.degree for sh in program.sharding for spec in sh.params if (sh.segment, spec.name) in held),
               default=1)
