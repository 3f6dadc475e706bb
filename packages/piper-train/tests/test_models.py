"""The example models: shapes, forward/backward, fx tracing, annotated regions, stage splits."""

from __future__ import annotations

import contextlib
import math
import sys
import types
from collections.abc import Iterator

import pytest
import torch

from piper_train.models import MLP, ModelSpec, TinyTransformer, build_model, lm_loss

NAMES = ["mlp", "transformer", "lm"]


class _CountingAnnotate:
    """A stand-in for ``piper_directives.annotate`` that records how deep the code is nested."""

    def __init__(self) -> None:
        self.depth = 0
        self.regions: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.regions.append(name)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


def _install(monkeypatch: pytest.MonkeyPatch, annotate: object) -> None:
    try:
        import piper_directives
    except ImportError:
        fake = types.ModuleType("piper_directives")
        fake.annotate = annotate  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "piper_directives", fake)
    else:
        monkeypatch.setattr(piper_directives, "annotate", annotate, raising=False)


@pytest.fixture(autouse=True)
def annotate_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Use the real ``annotate`` when piper-directives has one, else a no-op stub."""
    try:
        from piper_directives import annotate  # noqa: F401
    except ImportError:
        _install(monkeypatch, lambda name: contextlib.nullcontext())


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> _CountingAnnotate:
    stub = _CountingAnnotate()
    _install(monkeypatch, stub)
    return stub


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_reaches_every_parameter(name: str) -> None:
    spec = build_model(name, stages=2)
    out = spec.model(*spec.example_inputs)
    loss = spec.loss_fn(out, *spec.example_targets)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in spec.model.parameters())


def test_spec_shapes_and_dtypes() -> None:
    mlp = build_model("mlp", stages=3)
    (x,), (y,) = mlp.example_inputs, mlp.example_targets
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((16, 32), torch.float32, (16, 8), torch.float32)
    assert isinstance(mlp.model, MLP) and len(mlp.model.blocks) == 3
    assert mlp.model(x).shape == (16, 8)

    tr = build_model("transformer", stages=2)
    (tok,), (tgt,) = tr.example_inputs, tr.example_targets
    assert (tok.shape, tok.dtype, tgt.shape) == ((8, 16), torch.int64, (8, 16))
    assert int(tok.max()) < 64 and tr.model(tok).shape == (8, 16, 64)
    assert isinstance(tr.model, TinyTransformer) and len(tr.model.blocks) == 2

    lm = build_model("lm", stages=1)
    (tok,), (tgt,) = lm.example_inputs, lm.example_targets
    assert (tok.shape, tok.dtype) == ((16, 64), torch.int64)
    assert torch.equal(tok[:, 1:], tgt[:, :-1])  # next-byte targets
    assert lm.model(tok).shape == (16, 64, 256)
    assert isinstance(lm, ModelSpec) and (lm.name, lm.stages, lm.seed) == ("lm", 1, 0)


@pytest.mark.parametrize("name", NAMES)
def test_seed_fixes_weights_and_data(name: str) -> None:
    rng_before = torch.random.get_rng_state()
    a, b, c = (
        build_model(name, stages=2, seed=1),
        build_model(name, stages=2, seed=1),
        build_model(name, stages=2, seed=2),
    )
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG is untouched
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    for step in (0, 5):
        (xa,), (ya,) = a.batches(step)
        (xb,), (yb,) = b.batches(step)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.batches(0)[0][0], a.batches(1)[0][0])
    assert torch.equal(a.example_inputs[0], a.batches(0)[0][0])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("stages", [1, 3])
def test_symbolic_trace(name: str, stages: int) -> None:
    spec = build_model(name, stages=stages)
    traced = torch.fx.symbolic_trace(spec.model)
    assert torch.equal(traced(*spec.example_inputs), spec.model(*spec.example_inputs))


class _RegionTracer(torch.fx.Tracer):
    """Records every operation traced while no ``annotate`` region is open."""

    def __init__(self, annotate: _CountingAnnotate) -> None:
        super().__init__()
        self.annotate = annotate
        self.outside: list[str] = []

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        if kind.startswith("call_") and self.annotate.depth == 0:
            self.outside.append(f"{kind} {target}")
        return super().create_node(kind, target, args, kwargs, name, type_expr)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("stages", [1, 4])
def test_every_operation_is_inside_one_region_per_stage(
    name: str, stages: int, counting: _CountingAnnotate
) -> None:
    spec = build_model(name, stages=stages)
    tracer = _RegionTracer(counting)
    graph = tracer.trace(spec.model)
    assert tracer.outside == []
    assert counting.regions == ["PP"] * stages
    assert sum(node.op.startswith("call_") for node in graph.nodes) > stages


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("stages", "pp"), [(1, 1), (4, 2), (4, 4), (3, 2), (5, 3)])
def test_stage_modules_compose_to_the_model(name: str, stages: int, pp: int) -> None:
    spec = build_model(name, stages=stages)
    parts = spec.model.stage_modules(pp)
    assert len(parts) == pp
    x = spec.example_inputs[0]
    for part in parts:
        x = part(x)
    assert torch.equal(x, spec.model(*spec.example_inputs))
    # The stages share the model's parameters, each parameter owned by exactly one stage.
    owned = [id(p) for part in parts for p in part.parameters()]
    assert len(owned) == len(set(owned)) and set(owned) == {id(p) for p in spec.model.parameters()}
    sizes = [sum(1 for _ in part.children()) for part in parts]
    assert max(sizes) - min(sizes) <= 1  # regions are spread evenly


@pytest.mark.parametrize("pp", [0, 3])
def test_stage_modules_rejects_bad_counts(pp: int) -> None:
    with pytest.raises(ValueError, match="cannot split 2 annotated regions"):
        build_model("mlp", stages=2).model.stage_modules(pp)


def test_build_model_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        build_model("gpt", stages=1)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        build_model("mlp", stages=0)


def test_transformer_is_causal() -> None:
    model = build_model("transformer", stages=2).model
    tokens = build_model("transformer", stages=2).example_inputs[0]
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 64
    before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_lm_loss_matches_cross_entropy() -> None:
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[0, 1, 2], [3, 4, 0]])
    expected = sum(-logits[b, s].log_softmax(-1)[targets[b, s]] for b in range(2) for s in range(3)) / 6
    assert torch.allclose(lm_loss(logits, targets), expected)


def test_lm_learns_the_stdlib_corpus() -> None:
    spec = build_model("lm", stages=2, seed=0)
    opt = torch.optim.Adam(spec.model.parameters(), lr=3e-3)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared and the model is tiny
    try:
        for step in range(30):
            (x,), (y,) = spec.batches(step)
            loss = spec.loss_fn(spec.model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert abs(losses[0] - math.log(256)) < 0.1
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
