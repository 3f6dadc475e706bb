"""``--init-from``: initial weights by name from safetensors files (piper_train.weights)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from piper_train.weights import INDEX, load_weights


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _trained() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    state = {k: v.clone() for k, v in Tied().state_dict().items()}
    del state["head.weight"]  # as Hugging Face writes a tied model: one name of the tie
    return state


def test_a_single_file_loads_every_weight_ties_included(tmp_path):
    state = _trained()
    save_file(state, str(tmp_path / "w.safetensors"))
    model = Tied()
    loaded = load_weights(model, tmp_path / "w.safetensors")
    assert (loaded.tensors, loaded.files) == (3, 1)
    for name, value in state.items():
        assert torch.equal(model.state_dict()[name], value)
    assert model.head.weight is model.embed.weight and torch.equal(model.head.weight, state["embed.weight"])


def test_a_sharded_folder_with_its_index_loads(tmp_path):
    state = _trained()
    save_file({"embed.weight": state["embed.weight"]}, str(tmp_path / "a.safetensors"))
    save_file({k: state[k] for k in ("mid.weight", "mid.bias")}, str(tmp_path / "b.safetensors"))
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"embed.weight": "a.safetensors", "mid.weight": "b.safetensors",
                                                             "mid.bias": "b.safetensors"}}))
    model = Tied()
    assert load_weights(model, tmp_path).files == 2
    assert torch.equal(model.mid.bias, state["mid.bias"])


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("mid.bias"), "no tensor for 1 of the model's weights: mid.bias"),
    (lambda s: s.update(extra=torch.zeros(1)), "1 tensor\\(s\\) the model has no name for: extra"),
    (lambda s: s.update({"mid.weight": torch.zeros(4, 5)}), "mid.weight has shape \\(4, 5\\), the model's \\(4, 4\\)"),
])
def test_a_mismatch_is_refused_by_name(tmp_path, change, message):
    state = _trained()
    change(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        load_weights(Tied(), tmp_path)


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x80\x04 not safetensors")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_weights(Tied(), tmp_path)
