"""The runs ``shard_modules`` makes to learn shapes and check its code (``shard_code._probe``,
``shard_vocab``'s shapes on the segment's own nodes) leave the captured modules as they were:
their code, their nodes' metadata and their parameters; and the rewritten module keeps full
weights and no shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import Place, Shard, Strategy, annotate, capture, shard_modules

V, D = 16, 8


class Counted(nn.Module):
    """A tied embedding and head around a pre-norm MLP pair, dropout between them."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 16), nn.Linear(16, D)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        with annotate("PP"):
            h = self.emb(ids)
            h = h + self.fc2(self.drop(F.gelu(self.fc1(self.norm(h)))))
        with annotate("PP"):
            return self.head(h)


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _state(modules: dict[str, nn.Module]) -> dict:
    out = {}
    for seg, m in modules.items():
        out[seg, "tensors"] = {k: (tuple(t.shape), t.detach().clone()) for k, t in m.state_dict().items()}
        if isinstance(m, torch.fx.GraphModule):
            out[seg, "code"] = m.code
            out[seg, "meta"] = {n.name: sorted(n.meta) for n in m.graph.nodes}
            out[seg, "shapes"] = {n.name: repr(n.meta.get("tensor_meta")) for n in m.graph.nodes}
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key[1] == "tensors":
            assert a[key].keys() == b[key].keys()
            for name, (shape, t) in a[key].items():
                assert b[key][name][0] == shape, (key, name)
                assert torch.equal(b[key][name][1], t), (key, name)
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("sp, dropout", [(False, 0.0), (True, 0.0), (False, 0.1), (True, 0.1)])
def test_sharding_leaves_the_captured_modules_as_they_were(sp, dropout):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (4, 6))
    captured = capture(Counted(dropout), (ids,), (ids,), _loss, method="fx")
    before = _state(captured.modules)
    devices = (0, 1)
    strategy = Strategy([Place({"PP": 0}, devices), Place({"PP": 1}, devices),
                         Shard({}, devices, sequence_parallel=sp)])
    graph, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
    cut = {p.name for sh in graph.sharding for p in sh.params}
    assert {"fc1.weight", "fc2.weight", "emb.weight"} <= cut  # the pair and the tied vocabulary were cut
    assert modules["s0"] is not captured.modules["s0"]
    _same(before, _state(captured.modules))
    # The rewritten module holds the full weights (the runtime cuts them), the captured ones.
    assert modules["s0"].get_parameter("fc1.weight") is captured.modules["s0"].get_parameter("fc1.weight")
    # Its nodes carry no shapes: the checks' metadata does not travel with the module.
    assert all("tensor_meta" not in n.meta for n in modules["s0"].graph.nodes)
