"""Capture through torch.export (piper_directives.exporting): models torch.fx cannot trace,
sizes that stay symbolic, and segments that run on other batch sizes and sequence lengths."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from piper_directives import annotate, capture
from piper_ir import CaptureError


class Rotary(nn.Module):
    """Slices a table by the sequence length, as LLaMA-family code does: fx cannot trace it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("table", torch.randn(64, d), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return x + torch.tanh(self.lin(x) * self.table[:t])


class Model(nn.Module):
    def __init__(self, annotated: bool = False) -> None:
        super().__init__()
        self.annotated = annotated
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(Rotary(8) for _ in range(3))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.annotated:
            return self._annotated(ids)
        h = self.embed(ids)
        b, t, _ = h.shape  # sizes read in the first region, used in the last
        for layer in self.layers:
            h = layer(h)
        return self.head(h).reshape(b * t, -1)

    def _annotated(self, ids: torch.Tensor) -> torch.Tensor:
        with annotate("PP"):
            h = self.layers[0](self.embed(ids))
            b, t, _ = h.shape
        with annotate("PP"):
            h = self.layers[1](h)
        with annotate("PP"):
            return self.head(self.layers[2](h)).reshape(b * t, -1)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, targets.reshape(-1))


def _batch(b: int = 4, t: int = 6):
    g = torch.Generator().manual_seed(b * 100 + t)
    return torch.randint(0, 16, (b, t), generator=g), torch.randint(0, 16, (b, t), generator=g)


def _run(captured, ids: torch.Tensor) -> torch.Tensor:
    """The captured stage segments run one after another, values passed by name."""
    values = {"input:0": ids}
    for seg in captured.graph.stage_segments():
        outs = captured.modules[seg.id](*(values[v] for v in seg.inputs))
        values.update(zip(seg.outputs, outs, strict=True))
    return values[captured.graph.loss_segment().inputs[0]]


def test_what_fx_cannot_trace_is_captured_by_export_and_says_so():
    model = Model()
    captured = capture(model, *_batch(), _loss)
    assert captured.method == "export"
    assert len(captured.graph.stage_segments()) == 3
    with pytest.raises(CaptureError, match=r"test_export_capture\.py:\d+"):
        capture(model, *_batch(), _loss, method="fx")


def test_sizes_are_recomputed_where_used_and_only_tensors_cross_segments():
    captured = capture(Model(), *_batch(), _loss)
    for seg in captured.graph.stage_segments():
        for name in seg.inputs:
            assert captured.graph.value_by_name[name].meta.shape  # a tensor, with a shape
    # The last segment reshapes by b * t read off its own input, not a value sent from the first.
    last = captured.graph.stage_segments()[-1]
    assert last.inputs == (captured.graph.stage_segments()[-2].outputs[0],)
    assert "sym_size" in captured.modules[last.id].code


@pytest.mark.parametrize("b, t", [(2, 6), (4, 11), (3, 40)])
def test_the_captured_segments_run_on_other_batch_sizes_and_lengths(b, t):
    model = Model()
    captured = capture(model, *_batch(), _loss)
    ids, _ = _batch(b, t)
    torch.testing.assert_close(_run(captured, ids), model(ids), rtol=0, atol=0)


def test_parameters_are_the_models_own_and_the_tie_is_found():
    model = Model()
    captured = capture(model, *_batch(), _loss)
    first, last = captured.graph.stage_segments()[0], captured.graph.stage_segments()[-1]
    assert dict(captured.modules[first.id].named_parameters())["embed.weight"] is model.embed.weight
    (tie,) = captured.graph.ties
    assert {h[0] for h in tie.holders} == {first.id, last.id}
    assert not any(n == "layers.0.table" for n, _ in first.params)  # buffers are not parameters


def test_annotate_works_under_export_too():
    captured = capture(Model(annotated=True), *_batch(), _loss)
    assert captured.method == "export" and captured.regions is None
    assert [s.tags.get("PP") for s in captured.graph.stage_segments()] == [0, 1, 2]
    assert "test_export_capture.py" in captured.graph.stage_segments()[0].source


def test_grad_mode_and_autocast_regions_survive_export():
    class Contexts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x):
            t = x.shape[-1]
            with torch.no_grad():
                frozen = self.layers[0](x)[..., :t]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                low = self.layers[1](x + frozen)
            return low.float()

    model = Contexts()
    x = torch.randn(4, 4)
    captured = capture(model, x, torch.randn(4, 4), nn.functional.mse_loss, method="export")
    out = _run(captured, x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    out.sum().backward()
    assert model.layers[0].weight.grad is None and model.layers[1].weight.grad is not None


def test_exported_segments_pickle_with_their_operators_by_name():
    """Workers receive segments pickled (Ray's cloudpickle): torch.export's operator objects
    travel by name and the rebuilt code computes the same."""
    import pickle

    model = Model()
    captured = capture(model, *_batch(), _loss)
    rebuilt = {k: pickle.loads(pickle.dumps(m)) for k, m in captured.modules.items()}
    ids, _ = _batch(3, 9)
    values = {"input:0": ids}
    for seg in captured.graph.stage_segments():
        values.update(zip(seg.outputs, rebuilt[seg.id](*(values[v] for v in seg.inputs)), strict=True))
    torch.testing.assert_close(values[captured.graph.loss_segment().inputs[0]], model(ids), rtol=0, atol=0)
