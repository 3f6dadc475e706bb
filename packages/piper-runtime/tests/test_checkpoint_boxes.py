"""The boxes a rank writes for a flat range of a parameter (a ZeRO shard's piece of it) tile
exactly that range, each box one contiguous run of elements; a tensor-parallel rank's boxes
(``Cut``) land where its pieces lie in the full tensor; a checkpoint of pieces cut either
way reads back whole (no workers)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from piper_ir import ParamShard
from piper_memory.store import shard_tensor
from piper_runtime.checkpoint import (
    Cut,
    SaveSide,
    finish,
    flat_boxes,
    plan_globally,
    read_model,
    read_objects,
)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2), (1,), (5, 1)])
def test_boxes_tile_every_range(shape) -> None:
    n = math.prod(shape)
    index = torch.arange(n).reshape(shape)
    rng = random.Random(0)
    ranges = [(0, n), (0, 1), (n - 1, n)] + [tuple(sorted(rng.sample(range(n + 1), 2))) for _ in range(30)]
    for start, stop in ranges:
        covered: list[int] = []
        for off, size, first in flat_boxes(shape, start, stop):
            box = index[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1).tolist()
            assert box == list(range(first, first + len(box)))  # contiguous, starting where it says
            covered += box
        assert covered == list(range(start, stop)), (shape, start, stop)
        assert len(flat_boxes(shape, start, stop)) <= 2 * len(shape) - 1 or start == stop


def test_scalar_and_empty_ranges() -> None:
    assert flat_boxes((), 0, 1) == [((), (), 0)]
    assert flat_boxes((3, 4), 5, 5) == []


def test_pieces_of_two_ranks_read_back_whole(tmp_path) -> None:
    """Two "ranks" each hold half the flat elements of a 3x4 weight (as ZeRO-3 replicas do)
    and the same bias (replicated: written once); the driver's objects go with rank 0."""
    weight, bias = torch.arange(12.0).reshape(3, 4), torch.tensor([1.0, 2.0])

    def pieces(start: int, stop: int) -> dict:
        flat = weight.reshape(-1)
        out = {
            ("model.w", off): ((3, 4), flat[first : first + math.prod(size)].reshape(size).clone())
            for off, size, first in flat_boxes((3, 4), start, stop)
        }
        out[("model.b", (0,))] = ((2,), bias.clone())
        return out

    sides = [SaveSide(str(tmp_path), 0, pieces(0, 5), {"train_state": {"step": 7}}), SaveSide(str(tmp_path), 1,
                                                                                               pieces(5, 12), {})]
    plans, metadata = plan_globally(str(tmp_path), [s.plan() for s in sides])
    finish(str(tmp_path), metadata, [s.write(p) for s, p in zip(sides, plans, strict=True)])
    model = read_model(str(tmp_path))
    assert torch.equal(model["w"], weight) and torch.equal(model["b"], bias)
    assert read_objects(str(tmp_path), ["train_state"]) == {"train_state": {"step": 7}}
    # The replicated bias is written once, by the rank with fewer bytes so far.
    assert sum(1 for p in plans for k, _ in p if k == "model.b") == 1


def _cut(full: torch.Tensor, spec: ParamShard, degree: int, rank: int) -> Cut:
    return Cut(spec.dim, spec.pieces(full.shape[spec.dim], degree, rank), tuple(full.shape))


@pytest.mark.parametrize(("shape", "dim", "groups"), [((6, 4), 0, 3), ((4, 6), 1, 3), ((4, 2, 3), 0, 1),
                                                      ((3, 8), 1, 2)])
def test_a_cut_ranks_boxes_land_where_its_pieces_lie(shape, dim, groups) -> None:
    """Every flat range of a rank's piece (as a ZeRO shard of a tensor-parallel weight holds
    it), split at the pieces' edges, names the full tensor's elements the rank holds there."""
    full = torch.arange(math.prod(shape)).reshape(shape)
    spec, degree = ParamShard("w", dim, groups), 2
    rng = random.Random(1)
    for rank in range(degree):
        cut = _cut(full, spec, degree, rank)
        local = cut.local(full)
        assert torch.equal(local, shard_tensor(full, spec, degree, rank))
        n = local.numel()
        for start, stop in [(0, n)] + [tuple(sorted(rng.sample(range(n + 1), 2))) for _ in range(20)]:
            seen: list[int] = []
            for off, size, first in flat_boxes(tuple(local.shape), start, stop):
                chunk = local.reshape(-1)[first : first + math.prod(size)].reshape(size)
                for full_off, a, length in cut.boxes(off, size):
                    piece = chunk.narrow(dim, a, length)
                    where = tuple(slice(o, o + s) for o, s in zip(full_off, piece.shape, strict=True))
                    assert torch.equal(full[where], piece)
                    seen += piece.reshape(-1).tolist()
            assert sorted(seen) == sorted(local.reshape(-1)[start:stop].tolist())


def test_tensor_parallel_pieces_read_back_whole(tmp_path) -> None:
    """Two tensor-parallel "ranks" of a fused q/k/v weight (three blocks, each cut in two),
    each writing its boxes at their full offsets: the checkpoint holds the single-device
    weight."""
    weight, spec = torch.arange(48.0).reshape(12, 4), ParamShard("w", 0, 3)

    def pieces(rank: int) -> dict:
        cut = _cut(weight, spec, 2, rank)
        local = cut.local(weight)
        return {("model.w", off): (cut.full, local.narrow(0, a, n).clone())
                for off, a, n in cut.boxes((0, 0), tuple(local.shape))}

    sides = [SaveSide(str(tmp_path), r, pieces(r), {}) for r in range(2)]
    plans, metadata = plan_globally(str(tmp_path), [s.plan() for s in sides])
    finish(str(tmp_path), metadata, [s.write(p) for s, p in zip(sides, plans, strict=True)])
    assert torch.equal(read_model(str(tmp_path))["w"], weight)
