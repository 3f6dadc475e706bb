"""Vocabulary parallelism (``shard_vocab``): the parallel cross-entropy against ``F.cross_entropy``
on two ranks (threads summing through a shared buffer), and what the automatic rule and a plan
do with losses and ties they cannot cut (refusals name the module, its line and the rule)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import Place, Shard, Strategy, annotate, capture, shard_modules
from piper_directives.shard_code import TensorParallelComm
from piper_directives.shard_vocab import VocabParallelLoss
from piper_ir import DirectiveError

V, D = 16, 8


class _Pair:
    """Two ranks' all-reduce (a sum) through a barrier."""

    def __init__(self) -> None:
        self.barrier, self.parts = threading.Barrier(2), {}

    def comm(self, rank: int):
        pair = self

        class Comm:
            def all_reduce(self, t: torch.Tensor) -> None:
                pair.parts[rank] = t.clone()
                pair.barrier.wait()
                total = pair.parts[0] + pair.parts[1]
                pair.barrier.wait()
                t.copy_(total)

        return Comm()


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), ignore_index=-100)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_parallel_cross_entropy_matches_one_device(reduction):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, V, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (3, 5))
    targets[0, 1] = -100  # ignored
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
    (grad,) = torch.autograd.grad(want.sum(), logits)
    pair, out = _Pair(), {}

    def fn(x, t):
        return F.cross_entropy(x.reshape(-1, x.shape[-1]), t.reshape(-1), reduction=reduction)

    def rank(r: int) -> None:
        comm = TensorParallelComm(2)
        comm.bind_communicator(pair.comm(r), position=r)
        piece = logits.detach()[..., r * V // 2 : (r + 1) * V // 2].clone().requires_grad_()
        loss = VocabParallelLoss(_Fn(fn), comm, (0,))(piece, targets)
        loss.sum().backward()
        out[r] = (loss.detach(), piece.grad)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in (0, 1):
        torch.testing.assert_close(out[r][0], want.detach(), rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(torch.cat([out[0][1], out[1][1]], -1), grad, rtol=1e-13, atol=1e-14)


class _Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class Tied(nn.Module):
    """Embedding, an MLP pair, a head tied to the embedding; two regions."""

    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx)
        self.fc1, self.fc2 = nn.Linear(D, 16), nn.Linear(16, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        with annotate("PP"):
            h = self.emb(ids)
            h = h + self.fc2(torch.relu(self.fc1(h)))
        with annotate("PP"):
            return self.head(h)


def _shard(loss_fn, plan=None, padding_idx=None):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (4, 3))
    captured = capture(Tied(padding_idx), (ids,), (ids,), loss_fn, method="fx")
    devices = (0, 1)
    strategy = Strategy([Place({"PP": 0}, devices), Place({"PP": 1}, devices), Shard({}, devices, plan=plan)])
    graph, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
    return {p.name for sh in graph.sharding for p in sh.params}, graph


def test_the_automatic_rule_cuts_the_tied_pair_where_the_loss_takes_slices():
    cut, graph = _shard(_loss)
    assert {"emb.weight", "head.weight", "fc1.weight"} <= cut
    assert {sh.segment: sh.collectives for sh in graph.sharding}["loss"] == 1


def test_a_loss_that_needs_the_whole_logits_leaves_the_tied_pair_whole():
    def softmax_loss(logits, targets):  # log_softmax over the vocabulary: not on a slice
        return F.nll_loss(F.log_softmax(logits, -1).flatten(0, 1), targets.flatten())

    cut, _ = _shard(softmax_loss)
    assert "fc1.weight" in cut and not {"emb.weight", "head.weight"} & cut
    with pytest.raises(DirectiveError, match=r"log_softmax.*softmax_loss at .*test_shard_vocab.py:\d+"):
        _shard(softmax_loss, plan={"fc1": "colwise", "fc2": "rowwise", "emb": "embedding_vocab",
                                   "head": "colwise_vocab"})


def test_a_plan_that_cuts_one_holder_of_a_tie_is_refused_with_both_uses():
    with pytest.raises(DirectiveError, match=r"'emb.weight' is tied.*head.*test_shard_vocab.py\", line \d+.*embedding_vocab"):
        _shard(_loss, plan={"fc1": "colwise", "fc2": "rowwise", "head": "colwise_vocab"})


def test_a_plan_naming_an_embedding_it_cannot_cut_names_its_line():
    with pytest.raises(DirectiveError, match=r"emb embedding_vocab \(.*test_shard_vocab.py\", line \d+.*padding_idx"):
        _shard(_loss, plan={"emb": "embedding_vocab", "head": "colwise_vocab"}, padding_idx=0)


class OneRegion(nn.Module):
    """The tied embedding and head in one region: one tensor under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc1, self.fc2 = nn.Linear(D, 16), nn.Linear(16, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        with annotate("PP"):
            h = self.emb(ids)
            return self.head(h + self.fc2(torch.relu(self.fc1(h))))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_one_tensor_under_two_names_is_cut_under_both_or_refused(method):
    ids = torch.randint(0, V, (4, 3))
    captured = capture(OneRegion(), (ids,), (ids,), _loss, method=method)

    def shard(plan):
        strategy = Strategy([Place({"PP": 0}, (0, 1)), Shard({}, (0, 1), plan=plan)])
        graph, _ = shard_modules(strategy.apply(captured.graph), captured.modules)
        return {p.name for sh in graph.sharding for p in sh.params}

    assert "emb.weight" in shard(None) and "head.weight" not in shard(None)  # listed once, by the region's name
    with pytest.raises(DirectiveError, match=r"'emb.weight', 'head.weight' are one tensor.*but not as 'emb.weight'"):
        shard({"fc1": "colwise", "fc2": "rowwise", "head": "colwise_vocab"})
