"""Regions named by module path (piper_directives.regions): what a spec names, the default
for a model without annotations, and the boundaries the hooks cross, captured and eager alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from piper_directives import annotate, capture
from piper_directives.annotate import on_boundaries
from piper_directives.regions import ModuleRegions
from piper_ir import CaptureError


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(x)))


class Net(nn.Module):
    """Plain torch, no annotate: an embedding, a list of blocks, a norm and a head."""

    def __init__(self, d: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.extra = nn.ModuleList([nn.Identity()])  # a smaller list: not the default's
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * 2.0  # between the embedding and the first block: the embedding's region
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _capture(model: nn.Module, **kwargs):
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    return capture(model, x, y, nn.functional.mse_loss, **kwargs)


def test_a_spec_names_regions_by_path_with_wildcards_and_commas():
    regions = ModuleRegions.parse(Net(), "embed | blocks.* | norm, head")
    assert regions.regions == (("embed",), ("blocks.0",), ("blocks.1",), ("blocks.2",), ("norm", "head"))
    assert ModuleRegions.parse(Net(), ["embed, blocks.0", "blocks.1", "blocks.2, norm, head"]).regions == (
        ("embed", "blocks.0"), ("blocks.1",), ("blocks.2", "norm", "head"))
    assert ModuleRegions.parse(Net(), regions.describe()).regions == regions.regions


@pytest.mark.parametrize("spec, message", [
    ("embed | layers.*", "'layers.*' matches no module of Net; its modules there are: embed, blocks"),
    ("embed | blocks.* | blocks.1.lin", "overlap"),
    ("embed || head", "every region between '|'"),
    ("embed, | head", "empty module path"),
])
def test_a_bad_spec_is_refused_naming_the_pattern(spec, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("'", "'")):
        ModuleRegions.parse(Net(), spec)


def test_the_default_is_one_region_per_entry_of_the_largest_module_list():
    assert ModuleRegions.default(Net(layers=3)).regions == (("blocks.0",), ("blocks.1",), ("blocks.2",))
    assert ModuleRegions.default(nn.Linear(2, 2)) is None


def test_capture_by_module_path_puts_what_runs_between_regions_in_the_earlier_one():
    captured = _capture(Net(), regions="embed | blocks.* | norm, head")
    stages = captured.graph.stage_segments()
    assert [s.tags.get("PP") for s in stages] == [0, 1, 2, 3, 4]
    params = [sorted({p.split(".")[0] + (f".{p.split('.')[1]}" if p.startswith("blocks") else "") for p, _ in s.params})
              for s in stages]
    assert params == [["embed"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["head", "norm"]]
    # The doubling after the embedding ran in the embedding's region: segment 1 reads its result.
    assert "mul" in captured.modules[stages[0].id].code
    assert captured.regions is not None and captured.method == "fx"


def test_a_model_without_annotations_gets_the_default_regions():
    captured = _capture(Net(layers=3))
    stages = captured.graph.stage_segments()
    assert len(stages) == 3 and captured.regions.spec == "blocks.*"
    assert {p for p, _ in stages[0].params} >= {"embed.weight", "blocks.0.lin.weight"}
    assert {p for p, _ in stages[-1].params} >= {"blocks.2.lin.weight", "head.weight", "norm.weight"}


def test_naming_regions_of_a_model_that_annotates_itself_is_refused_naming_both():
    class Annotated(Net):
        def forward(self, x):
            with annotate("PP"):
                return super().forward(x)

    with pytest.raises(CaptureError, match=r"regions were given by module path \('blocks\.\*'\).*annotate\(\.\.\.\) at .*test_regions\.py"):
        _capture(Annotated(), regions="blocks.*")


def test_a_model_with_neither_regions_nor_a_module_list_is_refused():
    with pytest.raises(CaptureError, match="has no region.*annotate.*regions="):
        _capture(nn.Sequential(nn.Linear(4, 2)))


def test_eager_runs_cross_the_boundaries_capture_recorded():
    """The hooks make eager boundaries where capture made them: what lets single-device
    training reseed where each segment starts (piper_directives.randomness)."""
    model = Net()
    captured = _capture(model, regions="embed | blocks.* | norm, head")
    crossed = []
    with captured.regions.installed(model), on_boundaries(lambda: crossed.append(len(crossed) + 1)):
        model(torch.randn(2, 4))
    assert set(captured.runs) <= set(crossed)
    assert len(crossed) == 2 * len(captured.graph.stage_segments())  # enter and leave each region once
    assert not model._forward_pre_hooks and not model.blocks[0]._forward_pre_hooks  # removed again
