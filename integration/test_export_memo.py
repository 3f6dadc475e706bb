"""The test session's export memo (integration/conftest.py, ``export_memo``): a hit gives
exactly the graph a fresh ``torch.export`` capture of the new model gives, reading the new
model's own tensors; a model that differs in anything export could see is exported afresh;
errors are never stored."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from piper_directives.exporting import BatchDependence
from piper_directives.regions import ModuleRegions

VOCAB, D = 16, 8


class Block(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        with torch.no_grad():  # a higher-order operation with a sub-graph under export
            scale = h.abs().mean(-1, keepdim=True) + self.eps
        return x + h / scale


class TiedNet(nn.Module):
    """Regions by module path, a tie (head = embedding), a buffer, a plain tensor attribute,
    sizes read from the input."""

    def __init__(self, eps: float = 1e-5, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(eps) for _ in range(2))
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("pos", torch.randn(8, D))
        self.gain = torch.full((D,), 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.gain).view(ids.shape[0], -1)


class FixedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[0] >= 4)  # holds for some batch sizes only: exported_graph refuses it
        return self.fc(x)


def _model(seed: int, **kwargs: object) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet(**kwargs)


IDS = (torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0)),)
REGIONS = "embed | blocks.* | head"


def _export(export, model: nn.Module) -> tuple[torch.fx.GraphModule, set[int]]:
    with ModuleRegions.parse(model, REGIONS).installed(model) as switch:
        gm = export(model, IDS)
    return gm, set(switch.scope_uids)


def _shapes(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(str(s) for s in value.shape), value.dtype, value.requires_grad)
    return str(value) if value is not None else None


def _modules(gm: torch.fx.GraphModule) -> list[tuple]:
    """Each module's path, kind, and the names of its parameters, buffers and tensor constants."""
    return [(name, isinstance(m, torch.fx.GraphModule), tuple(m._parameters), tuple(m._buffers),
             sorted(k for k, v in vars(m).items() if isinstance(v, torch.Tensor)))
            for name, m in gm.named_modules(remove_duplicate=False)]


def _meta(gm: torch.fx.GraphModule) -> list[tuple]:
    """What capture reads off each node, and the node itself."""
    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs), n.meta.get("piper_run"),
             n.meta.get("piper_scopes"), n.meta.get("piper_checkpoint"), n.meta.get("piper_context"),
             _shapes(n.meta.get("val")), n.meta.get("stack_trace"),
             [path for path, _ in (n.meta.get("nn_module_stack") or {}).values()])
            for n in gm.graph.nodes]


def test_a_hit_is_the_graph_a_fresh_export_gives_reading_the_new_models_tensors(export_memo) -> None:
    memo = type(export_memo)(export_memo.original)  # this test's own: it counts hits from zero
    first, second = _model(0), _model(1)
    _export(memo, first)
    rng = torch.get_rng_state()
    fresh, fresh_uids = _export(export_memo.original, second)
    assert torch.equal(torch.get_rng_state(), rng), "export drew random numbers: a hit would not"
    hit, hit_uids = _export(memo, second)
    assert (memo.misses, memo.hits) == (1, 1)
    assert hit.code == fresh.code
    assert _meta(hit) == _meta(fresh)
    assert _modules(hit) == _modules(fresh)
    assert [(n, type(v)) for n, v in vars(hit).items()] == [(n, type(v)) for n, v in vars(fresh).items()]
    for name, sub in hit.named_modules():
        if name and isinstance(sub, torch.fx.GraphModule):  # a sub-graph (the no_grad block)
            assert sub.code == fresh.get_submodule(name).code
            assert _meta(sub) == _meta(fresh.get_submodule(name))
    assert hit_uids == fresh_uids and fresh_uids  # the regions' scopes: not taken for the model's own
    for got, want in ((hit.named_parameters(remove_duplicate=False), fresh.named_parameters(remove_duplicate=False)),
                      (hit.named_buffers(remove_duplicate=False), fresh.named_buffers(remove_duplicate=False))):
        got, want = dict(got), dict(want)
        assert got.keys() == want.keys()
        assert all(got[name] is want[name] for name in want)  # the second model's own tensors
    torch.manual_seed(0)
    want_out = fresh(*IDS)
    torch.manual_seed(0)
    assert torch.equal(hit(*IDS), want_out)
    with torch.no_grad():
        torch.testing.assert_close(hit(*IDS), second(*IDS))  # the second model's function ...
        assert not torch.allclose(hit(*IDS), first(*IDS))  # ... not the first's
    # What a hit hands out is its own: changing it leaves the next hit as export gave it.
    hit.graph.erase_node(next(n for n in reversed(hit.graph.nodes) if n.op == "output"))
    again, _ = _export(memo, _model(2))
    assert again.code == fresh.code and memo.hits == 2


@pytest.mark.parametrize("other", [
    pytest.param(lambda: _model(0, eps=1e-3), id="an-attribute"),
    pytest.param(lambda: _model(0, tied=False), id="no-tie"),
    pytest.param(lambda: _model(0).eval(), id="eval"),
    pytest.param(lambda: _model(0).double(), id="dtype"),
    pytest.param(lambda: _model(0).requires_grad_(False), id="requires-grad"),
])
def test_a_model_that_differs_in_what_export_sees_has_another_key(export_memo, other) -> None:
    assert export_memo.key(_model(1), IDS) == export_memo.key(_model(2), IDS)  # the weights' values do not count
    assert export_memo.key(other(), IDS) != export_memo.key(_model(1), IDS)


def test_other_inputs_a_tensor_attributes_values_and_other_regions_give_another_key(export_memo) -> None:
    model = _model(0)
    assert export_memo.key(model, (IDS[0][:, :5],)) != export_memo.key(model, IDS)
    changed = _model(0)
    changed.gain = torch.full((D,), 0.25)
    assert export_memo.key(changed, IDS) != export_memo.key(model, IDS)
    with ModuleRegions.parse(model, REGIONS).installed(model):
        with_regions = export_memo.key(model, IDS)
    with ModuleRegions.parse(model, "embed, blocks.0 | blocks.1, head").installed(model):
        assert export_memo.key(model, IDS) != with_regions


def test_errors_are_raised_every_time_and_never_stored(export_memo) -> None:
    memo = type(export_memo)(export_memo.original)
    for _ in range(2):
        with pytest.raises(BatchDependence):
            memo(FixedBatch(), (torch.randn(4, D),))
    assert memo.entries == {} and memo.hits == 0


def test_a_graph_whose_shapes_learnt_a_guard_is_exported_again(export_memo) -> None:
    """The ``val``s of every copy share the first export's symbolic shapes: once code that reads
    them has guarded on a size (fixing it), the stored graph is no longer what export gives."""
    memo = type(export_memo)(export_memo.original)
    gm, _ = _export(memo, _model(0))
    batch = next(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder").shape[0]
    assert isinstance(batch, torch.SymInt)
    assert bool(batch == 4)  # a guard: the batch size is now 4 in these shapes
    again, _ = _export(memo, _model(1))
    assert (memo.stale, memo.misses, memo.hits) == (1, 2, 0)
    assert isinstance(next(n.meta["val"] for n in again.graph.nodes if n.op == "placeholder").shape[0], torch.SymInt)
