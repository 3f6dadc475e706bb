"""Batches of other shapes than the program's (another sequence length, an epoch's partial last
batch): how a batch is cut into pieces, each piece's loss weight, the losses merged, and the
check that a program compiled for other shapes differs from the runtime's in shapes only."""

from __future__ import annotations

import attrs
import pytest
import torch

from piper_ir import Instruction, NodeKind, Program, RankPlan, TensorMeta, Value
from piper_runtime.batch import (
    cut_batch,
    describe_signature,
    loss_divisors,
    piece_sizes,
    program_signature,
    replica_slice,
    split_microbatches,
    weighted_losses,
)
from piper_runtime.driver.runtime import structure_difference


def _program(microbatches: int = 2, replicas: int = 2, seq: int = 16) -> Program:
    """Tokens and targets ``(2, seq)`` per piece, a mask without a batch dimension."""
    return Program(
        world_size=1, ranks=(), communicators=(), segments=(),
        values=(Value("input:0", TensorMeta((2, seq), "int64", batch_dim=0)),
                Value("input:1", TensorMeta((seq, seq), "bool", batch_dim=None)),
                Value("target:0", TensorMeta((2, seq), "int64", batch_dim=0))),
        inputs=("input:0", "input:1"), targets=("target:0",), microbatches=microbatches, replicas=replicas,
    )


def test_pieces_are_tensor_splits_cut_and_their_loss_divisors_make_the_batch_mean() -> None:
    assert piece_sizes(8, 2, 2) == ((2, 2), (2, 2))
    assert piece_sizes(11, 2, 2) == ((3, 3), (3, 2))  # chunks 6 and 5, each cut into shards
    assert piece_sizes(10, 4) == ((3,), (3,), (2,), (2,))
    x = torch.arange(11)
    assert [c.tolist() for c in torch.tensor_split(x, 2)] == [list(range(6)), list(range(6, 11))]
    assert loss_divisors(((2, 2), (2, 2))) == ((4.0, 4.0), (4.0, 4.0))  # equal pieces: M x N exactly
    divisors = loss_divisors(piece_sizes(11, 2, 2))
    assert sum(1 / d for row in divisors for d in row) == pytest.approx(1.0)
    # Each piece's mean loss, weighted by its samples: the batch's mean.
    samples = torch.randn(11, dtype=torch.float64)
    sizes = piece_sizes(11, 2, 2)
    pieces = torch.split(samples, [n for row in sizes for n in row])
    losses = [[float(pieces[2 * m + j].mean()) for j in range(2)] for m in range(2)]
    per_mb, loss = weighted_losses(losses, sizes)
    assert loss == pytest.approx(float(samples.mean()), rel=1e-12)
    assert per_mb == pytest.approx((float(samples[:6].mean()), float(samples[6:].mean())), rel=1e-12)
    assert weighted_losses([[1.0, 2.0], [3.0, 5.0]], ((2, 2), (2, 2))) == ((1.5, 4.0), 2.75)  # plain means


def test_a_batch_is_cut_by_its_own_shapes_and_a_replica_gets_its_pieces() -> None:
    program = _program()
    assert program_signature(program) == ((2, 16), (16, 16), (2, 16))
    own = cut_batch(program, (torch.zeros(8, 16, dtype=torch.long), torch.zeros(16, 16, dtype=torch.bool)),
                    (torch.zeros(8, 16, dtype=torch.long),))
    assert own.even(program) and own.total == 8
    tokens = torch.arange(11 * 24).view(11, 24)
    cut = cut_batch(program, (tokens, torch.zeros(24, 24, dtype=torch.bool)), (tokens,))
    assert not cut.even(program) and cut.sizes == ((3, 3), (3, 2))
    assert cut.distinct() == [((3, 24), (24, 24), (3, 24)), ((2, 24), (24, 24), (2, 24))]
    assert describe_signature(program, cut.distinct()[1]) == "input:0 2x24, input:1 24x24, target:0 2x24"
    meta = program.value_by_name["input:0"].meta
    for j in range(2):
        mine = replica_slice(tokens, meta, 2, 2, j, cut.sizes)  # what the driver ships replica j
        chunks = split_microbatches(mine, meta, 2, [row[j] for row in cut.sizes])  # what the rank cuts
        for m, chunk in enumerate(chunks):
            assert torch.equal(chunk, cut.piece(tokens, meta, m, j))
    assert torch.equal(cut.piece(tokens, meta, 1, 1), tokens[9:11])
    with pytest.raises(ValueError, match="cannot give each of 2 microbatches x 2 replicas a sample"):
        cut_batch(program, (tokens[:3], torch.zeros(24, 24, dtype=torch.bool)), (tokens[:3],))
    with pytest.raises(ValueError, match="target:0: a batch of 10 samples along dim 0, the batch's other values have 11"):
        cut_batch(program, (tokens, torch.zeros(24, 24, dtype=torch.bool)), (tokens[:10],))
    with pytest.raises(ValueError, match="input:1: expected 2 dimensions"):
        cut_batch(program, (tokens, torch.zeros(24, dtype=torch.bool)), (tokens,))


def test_a_program_for_other_shapes_must_differ_in_shapes_only() -> None:
    def plan(seq: int, peer: int = 1) -> RankPlan:
        meta = TensorMeta((2, seq, 8), "float32", batch_dim=0, requires_grad=True)
        return RankPlan(0, (Instruction("send.h.mb0", NodeKind.SEND, value="h", microbatch=0, peer=peer,
                                        communicator="c", meta=meta),))

    base = attrs.evolve(_program(replicas=1), world_size=1, ranks=(plan(16),))
    assert structure_difference(base, attrs.evolve(_program(replicas=1, seq=24), ranks=(plan(24),))) == ""
    assert "instruction" in structure_difference(base, attrs.evolve(base, ranks=(plan(24, peer=2),)))
    assert "microbatches" in structure_difference(base, attrs.evolve(base, microbatches=4))
