"""Sequence parallelism (``shard_sequence``): a pre-norm residual block's rewritten code on two
ranks (threads with a shared-buffer communicator) against the block on one device, forward
and gradients; dropout's mask is one device's; what it refuses (named with module and line)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import Place, Shard, Strategy, annotate, capture, shard_modules
from piper_directives.shard_code import COMM, TensorParallelComm, shard_tensor
from piper_directives.shard_sequence import gathered_linears, sequence_dropout
from piper_ir import DirectiveError, ShardKind

D, T = 8, 6


class _Group:
    """Two ranks' collectives through a barrier (rows of dimension 0, in rank order)."""

    def __init__(self) -> None:
        self.barrier, self.parts = threading.Barrier(2), {}

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.parts[rank] = t.clone()
        self.barrier.wait()
        parts = [self.parts[0], self.parts[1]]
        self.barrier.wait()
        return parts

    def comm(self, rank: int):
        group = self

        class Comm:
            def all_reduce(self, t: torch.Tensor) -> None:
                a, b = group._exchange(rank, t)
                t.copy_(a + b)

            def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
                out.copy_(torch.cat(group._exchange(rank, t)))

            def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor) -> None:
                a, b = group._exchange(rank, t)
                out.copy_((a + b).chunk(2)[rank])

        return Comm()


class Block(nn.Module):
    """Pre-norm residual blocks: LayerNorm, an MLP pair, a residual add, twice; a final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.up1, self.down1 = nn.Linear(D, 16), nn.Linear(16, D)
        self.up2, self.down2 = nn.Linear(D, 16), nn.Linear(16, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with annotate("PP"):
            h = x + self.down1(F.gelu(self.up1(self.ln1(x))))
            h = h + self.down2(F.gelu(self.up2(self.ln2(h))))
            return self.ln_f(h)


class Mixing(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with annotate("PP"):
            h = x + self.down1(F.gelu(self.up1(self.ln1(x))))
            h = torch.cumsum(h, dim=1)  # mixes positions along the sequence
            return h + self.down2(F.gelu(self.up2(self.ln2(h))))


def _shard(model: nn.Module, t: int = T):
    torch.manual_seed(0)
    model = model.double()
    x = torch.randn(2, t, D, dtype=torch.float64)
    captured = capture(model, (x,), (torch.randn(2, t, D, dtype=torch.float64),), F.mse_loss, method="fx")
    devices = (0, 1)
    graph = Strategy([Place({"PP": 0}, devices), Shard({"PP": 0}, devices, sequence_parallel=True)]).apply(
        captured.graph)
    graph, modules = shard_modules(graph, captured.modules)
    return model, x, graph.sharding[0], modules["s0"]


def test_two_ranks_on_sequence_shards_match_one_device():
    model, x, sh, module = _shard(Block())
    assert sh.sequence_parallel
    ops = {n.args[1] for n in module.graph.nodes if n.op == "call_module" and n.target == COMM}
    assert {"sp_scatter", "sp_split", "sp_collect"} <= ops and "g" not in ops  # no all-reduce left
    gathers = [n for n in module.graph.nodes if n.target is gathered_linears]
    assert len(gathers) == 2  # each column's input all-gathered, only its slice kept
    want = model(x)
    want.square().sum().backward()
    group, out = _Group(), {}

    def rank(r: int) -> None:
        m = copy.deepcopy(module)
        with torch.no_grad():
            for spec in sh.params:
                p = m.get_parameter(spec.name)
                p.data = shard_tensor(p.data, spec, sh.degree, r)
        m.get_submodule(COMM).bind_communicator(group.comm(r), position=r)
        y = m(x)
        y = y[0] if isinstance(y, tuple) else y
        y.square().sum().backward()
        out[r] = (y.detach(), {n: p.grad for n, p in m.named_parameters()})

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(out) == {0, 1}
    cut = {spec.name: spec for spec in sh.params}
    for r in (0, 1):
        torch.testing.assert_close(out[r][0], want.detach(), rtol=1e-13, atol=1e-13)
    for name, p in model.named_parameters():
        if name in cut:
            got = torch.cat([out[0][1][name], out[1][1][name]], cut[name].dim)
        else:  # replicated (the norms, the rows' biases): summed over the group, equal on both
            got = out[0][1][name]
            torch.testing.assert_close(out[1][1][name], got, rtol=0, atol=0)
        torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-13, msg=name)


def test_dropout_on_a_slice_draws_one_devices_mask():
    x = torch.randn(2, 8, 4, dtype=torch.float64)
    torch.manual_seed(3)
    want = F.dropout(x, 0.3, True)
    for r in (0, 1):
        comm = TensorParallelComm(2)
        comm.bind_communicator(object(), position=r)
        torch.manual_seed(3)  # every rank of a group has the same generator state
        got = sequence_dropout(comm, x[:, 4 * r : 4 * r + 4], 0.3, 1)
        torch.testing.assert_close(got, want[:, 4 * r : 4 * r + 4], rtol=0, atol=0)


def test_a_cumulative_sum_along_the_sequence_is_refused_naming_its_line():
    with pytest.raises(DirectiveError, match=r"cumsum.*test_sequence_parallel.py.*mix positions") as err:
        _shard(Mixing())
    assert "sequence_parallel=True" in str(err.value)


def test_a_sequence_length_the_degree_does_not_divide_is_refused():
    with pytest.raises(DirectiveError, match=r"down1.*sequence length 5 does not divide by the tensor-parallel degree 2"):
        _shard(Block(), t=5)


def test_the_option_round_trips_and_is_for_tensor_parallelism_only():
    shard = Shard({"PP": 0}, (0, 1), sequence_parallel=True)
    assert Strategy.from_json(Strategy([shard]).to_json()).directives[0].sequence_parallel is True
    assert "sequence_parallel" not in Shard({"PP": 0}, (0, 1)).to_json()
    with pytest.raises(DirectiveError, match="only for kind='tp'"):
        Shard({"PP": 0}, (0, 1), kind=ShardKind.EP, sequence_parallel=True)
