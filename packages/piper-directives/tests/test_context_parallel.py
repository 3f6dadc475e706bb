"""Context parallelism (``ContextParallel``, ``context_parallel``, ``context_code``): the
directive and its JSON form, the layout it gives a strategy, what ``apply`` records, the
driver's batch layout, and the attention of two ranks (threads sharing a fake communicator)
against one device's causal attention, forward and backward."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import (
    ContextLayout,
    ContextParallel,
    Shard,
    Strategy,
    annotate,
    capture,
    context_parallel,
    data_parallel,
    one_f_one_b,
    tensor_parallel,
)
from piper_directives.context_code import ContextParallelComm
from piper_ir import DirectiveError, ShardKind, from_json, to_json


def test_directive_json_and_its_refusals():
    cp = ContextParallel({"PP": 0}, (0, 1))
    assert cp.to_json() == {"op": "context_parallel", "filter": {"PP": 0}, "devices": [0, 1]}
    assert Strategy.from_json(Strategy([cp]).to_json()) == Strategy([cp])
    with pytest.raises(DirectiveError, match="at least two devices"):
        ContextParallel({"PP": 0}, (0,))
    with pytest.raises(DirectiveError, match="degree must be an int >= 2 that divides the 4 devices"):
        ContextParallel({"PP": 0}, (0, 1, 2, 3), degree=3)


def test_context_parallel_widens_every_place_and_moves_the_replicates():
    strategy = context_parallel(data_parallel(one_f_one_b(2, 2), 2, zero=1), 2)
    places = {str(p.filter): p.devices for p in strategy.directives if type(p).__name__ == "Place"}
    assert places == {"{PP: 0}": (0, 1, 4, 5), "{PP: 1}": (2, 3, 6, 7)}
    cps = strategy.of(ContextParallel)
    assert [(c.devices, c.degree) for c in cps] == [((0, 1, 4, 5), 2), ((2, 3, 6, 7), 2)]
    assert {r.devices for r in strategy.directives if type(r).__name__ == "Replicate"} == {(0, 1, 4, 5), (2, 3, 6, 7)}
    assert context_parallel(one_f_one_b(2, 2), 1) == one_f_one_b(2, 2)
    with pytest.raises(DirectiveError, match="already has a Shard"):
        context_parallel(tensor_parallel(one_f_one_b(2, 2), 2), 2)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.out = nn.Linear(4, 8)

    def forward(self, x):
        with annotate("PP"):
            h = self.emb(x)
        with annotate("PP"):
            return self.out(h)


@pytest.fixture
def tiny():
    x = torch.zeros(8, 6, dtype=torch.long)
    return capture(Tiny(), (x,), (x,), lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()))


def test_apply_keeps_each_replica_its_sequences_and_records_cp_shardings(tiny):
    placed = context_parallel(data_parallel(one_f_one_b(2, 2), 2), 2).apply(tiny.graph)
    # 8 sequences, 2 microbatches, 2 data-parallel replicas: 2 sequences a piece, still whole
    # here (context_modules gives the inputs their chunk)
    assert placed.value_by_name["input:0"].meta.shape == (2, 6)
    assert {(s.segment, s.kind, s.degree) for s in placed.sharding} == {
        ("s0", ShardKind.CP, 2), ("s1", ShardKind.CP, 2), ("loss", ShardKind.CP, 2)}
    assert {r.segment: r.devices for r in placed.replication}["s0"] == (0, 1, 4, 5)
    assert from_json(to_json(placed)) == placed  # ShardKind.CP serialises like the others


def test_apply_refuses_cp_with_shards_and_shard_kind_cp(tiny):
    strategy = one_f_one_b(2, 2)
    with pytest.raises(DirectiveError, match="context parallelism with tp-parallelism"):
        Strategy([*tensor_parallel(strategy, 2).directives, ContextParallel({"PP": 0}, (0, 1))]).apply(tiny.graph)
    widened = context_parallel(strategy, 2)
    with pytest.raises(DirectiveError, match=r"Shard\(kind='cp'\) is not context parallelism"):
        Strategy([d for d in widened.directives if not isinstance(d, ContextParallel)]
                 + [Shard(c.filter, c.devices, kind="cp") for c in widened.of(ContextParallel)]).apply(tiny.graph)
    with pytest.raises(DirectiveError, match="is placed on"):
        Strategy([*widened.directives, ContextParallel({"PP": 0}, (2, 3))]).apply(tiny.graph)


def test_layout_gives_each_piece_its_chunk_and_whole_targets():
    """The runtime cuts a batch into microbatches, then each into replicas x degree pieces:
    piece ``j * degree + c`` must hold chunk ``c`` of replica ``j``'s sequences."""
    m, r, n, b, t = 2, 2, 2, 3, 8
    tokens = torch.arange(m * r * b * t).reshape(m * r * b, t)
    layout = ContextLayout(m, r, n, t)
    (inputs,), (targets,) = layout.arrange((tokens,), (tokens,))
    assert inputs.shape == (m * r * n * b, t // n) and targets.shape == (m * r * n * b, t)
    for mb, (chunk_in, chunk_t, whole) in enumerate(zip(inputs.tensor_split(m), targets.tensor_split(m),
                                                        tokens.tensor_split(m), strict=True)):
        shards = whole.tensor_split(r)
        for k, (piece_in, piece_t) in enumerate(zip(chunk_in.tensor_split(r * n), chunk_t.tensor_split(r * n),
                                                    strict=True)):
            j, c = divmod(k, n)
            assert torch.equal(piece_in, shards[j][:, c * t // n : (c + 1) * t // n]), (mb, k)
            assert torch.equal(piece_t, shards[j])
    with pytest.raises(ValueError, match=r"only \(sequences of 8 tokens\)"):
        layout.arrange((tokens[:, :4],), (tokens[:, :4],))
    with pytest.raises(ValueError, match="not divisible into 2 microbatches x 2"):
        layout.arrange((tokens[:6],), (tokens[:6],))
    with pytest.raises(ValueError, match="12 sequences of 8 tokens"):
        ContextLayout(m, r, n, t, 12).arrange((tokens[:8],), (tokens[:8],))


class _Group:
    """A fake communicator of ``size`` threads: all-gather and reduce-scatter through shared
    slots and a barrier (what a backend's collectives do, in one process)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)


class _Member:
    def __init__(self, group: _Group, rank: int) -> None:
        self.group, self.rank = group, rank

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.group.slots[self.rank] = t.clone()
        self.group.barrier.wait()
        seen = [s.clone() for s in self.group.slots]
        self.group.barrier.wait()
        return seen

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(torch.cat(self._exchange(input)))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        total = sum(self._exchange(input))
        output.copy_(total.chunk(self.group.size)[self.rank])


@pytest.mark.parametrize("causal", [True, False])
def test_two_ranks_attend_as_one_device(causal):
    """Each rank's queries over the gathered keys and values give one device's attention rows,
    and the reduce-scattered key/value gradients its gradient chunks (float64: exact up to
    summation order)."""
    torch.manual_seed(0)
    degree, t = 2, 8
    q, k, v = (torch.randn(2, 3, t, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    grad = torch.randn_like(out)
    out.backward(grad)
    group = _Group(degree)
    results: dict[int, tuple] = {}

    def rank(r: int) -> None:
        comm = ContextParallelComm(degree)
        comm.bind_communicator(group.member(r), position=r)
        chunk = slice(r * t // degree, (r + 1) * t // degree)
        lq, lk, lv = (x.detach()[:, :, chunk].clone().requires_grad_() for x in (q, k, v))
        local = comm(lq, lk, lv, op="scaled_dot_product_attention", is_causal=causal)
        local.backward(grad[:, :, chunk])
        results[r] = (chunk, local.detach(), lq.grad, lk.grad, lv.grad)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(degree)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for chunk, local, gq, gk, gv in results.values():
        torch.testing.assert_close(local, out.detach()[:, :, chunk], rtol=1e-12, atol=1e-13)
        for mine, whole in ((gq, q.grad), (gk, k.grad), (gv, v.grad)):
            torch.testing.assert_close(mine, whole[:, :, chunk], rtol=1e-12, atol=1e-13)
