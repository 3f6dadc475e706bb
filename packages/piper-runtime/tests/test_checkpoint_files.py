"""A checkpoint's files are data: tensors of every dtype a run holds round-trip through the
safetensors writer (the library itself reads them), objects round-trip through JSON trees,
and whatever is not what a writer makes (another type on saving; a damaged index, file or
tree on loading) is refused by name, never unpickled and never a traceback (no workers)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from piper_ir import CheckpointError
from piper_runtime.checkpoint import SaveSide, check, finish, plan_globally, read_model, read_objects
from piper_runtime.checkpoint_files import DTYPES, INDEX, Reader, decode, encode, write_safetensors


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_dtype_round_trips_through_the_library(tmp_path, dtype) -> None:
    from safetensors.torch import load_file

    tensors = {"a": torch.arange(12, dtype=torch.float64).reshape(3, 4).to(dtype), "scalar": torch.tensor(3).to(dtype),
               "empty": torch.zeros(0, 2, dtype=dtype)}
    n = write_safetensors(tmp_path / "x.safetensors", tensors)
    assert n == (tmp_path / "x.safetensors").stat().st_size
    back = load_file(tmp_path / "x.safetensors")
    for name, t in tensors.items():
        assert back[name].dtype == dtype and back[name].shape == t.shape
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))  # bit for bit


def test_objects_round_trip_exactly() -> None:
    value = {"step": 3, "lr": {"base_lrs": [0.1, 0.2], "last_epoch": -1, "f": None}, "inf": -math.inf,
             "big": 2**70, "rng": (3, tuple(range(5)), None), "t": torch.arange(4, dtype=torch.uint8), 7: "int key",
             "flag": True, "nested": [[{"x": (1.5,)}]]}
    tree, tensors = encode(value, "object/s/")
    assert json.loads(json.dumps(tree)) == tree  # plain JSON
    back = decode(json.loads(json.dumps(tree)), tensors.__getitem__, "here")
    assert torch.equal(back.pop("t"), value["t"])
    assert back == {k: v for k, v in value.items() if k != "t"}
    assert isinstance(back["rng"], tuple) and isinstance(back["rng"][1], tuple)
    nan = decode(encode(float("nan"), "p/")[0], None, "here")
    assert math.isnan(nan)


def test_an_object_of_another_type_is_refused_where_it_sits() -> None:
    import numpy as np

    with pytest.raises(TypeError, match=r"train_state\['data'\]\['gen'\] is a ndarray"):
        encode({"data": {"gen": np.zeros(2)}}, "train_state/")
    for tree in ({"pickle": "80049531"}, {"list": "abc"}, {"tensor": 3}, {"a": 1, "b": 2}, [1, 2],
                 {"float": "1e999x"}, {"dict": [[{"list": []}, 1]]}):
        with pytest.raises(CheckpointError, match="here"):
            decode(tree, lambda name: torch.zeros(1), "here")
    deep: object = 1
    for _ in range(100):
        deep = {"list": [deep]}
    with pytest.raises(CheckpointError, match="nested deeper"):
        decode(deep, None, "here")


def _checkpoint(path) -> dict[str, torch.Tensor]:
    """Two ranks, each half of a weight's rows, one bias both hold; a train state on rank 0."""
    weight, bias = torch.randn(4, 3), torch.randn(3).to(torch.bfloat16)
    sides = [SaveSide(str(path), r, {("model.w", (2 * r, 0)): ((4, 3), weight[2 * r:2 * r + 2].clone()),
                                      ("model.b", (0,)): ((3,), bias.clone())},
                      {"train_state": {"step": 1, "rng": torch.get_rng_state()}} if r == 0 else {})
             for r in range(2)]
    assigned, index = plan_globally(str(path), [s.plan() for s in sides])
    finish(str(path), index, [s.write(a) for s, a in zip(sides, assigned, strict=True)])
    return {"w": weight, "b": bias}


def test_a_checkpoint_reads_back_and_damage_is_named(tmp_path) -> None:
    good = tmp_path / "good"
    good.mkdir()
    want = _checkpoint(good)
    check(good)
    model = read_model(str(good))
    assert torch.equal(model["w"], want["w"]) and torch.equal(model["b"], want["b"])
    assert read_objects(str(good), ["train_state"])["train_state"]["step"] == 1

    def damaged(name, change) -> str:
        import shutil

        d = tmp_path / name
        shutil.copytree(good, d)
        change(d)
        with pytest.raises(CheckpointError) as info:
            check(d)
            read_model(str(d))
        return str(info.value)

    def edit_index(edit):
        def change(d):
            index = json.loads((d / INDEX).read_text())
            edit(index)
            (d / INDEX).write_text(json.dumps(index))
        return change

    def overlap(index):  # rank 1's rows moved onto rank 0's: the same element count, a hole
        index["tensors"]["model.w"]["chunks"][1]["offsets"] = [1, 0]

    assert "rank-00000.safetensors: not a readable safetensors file" in damaged(
        "cut", lambda d: (d / "rank-00000.safetensors").write_bytes((d / "rank-00000.safetensors").read_bytes()[:-3]))
    assert "rank-00001.safetensors is missing" in damaged("gone", lambda d: (d / "rank-00001.safetensors").unlink())
    assert "index.json is missing" in damaged("no-index", lambda d: (d / INDEX).unlink())
    assert "nested too deeply" in damaged("deep", lambda d: (d / INDEX).write_text("[" * 100_000 + "]" * 100_000))
    assert "is BF16 [3], the index says F32" in damaged(
        "dtype", edit_index(lambda i: i["tensors"]["model.b"].update(dtype="F32")))
    assert "lies outside its shape" in damaged(
        "outside", edit_index(lambda i: i["tensors"]["model.w"]["chunks"][0].update(offsets=[3, 0])))
    assert "model.w: its chunks leave part of it unwritten (they overlap" in damaged("overlap", edit_index(overlap))
    assert "not a Piper checkpoint file" in damaged(
        "foreign", lambda d: __import__("safetensors.torch").torch.save_file(
            {"x": torch.zeros(1)}, str(d / "rank-00001.safetensors")))
    with Reader(good) as reader:
        assert sorted(reader.keys()) == ["model.b", "model.w"]


def test_replicated_chunks_are_written_once_and_the_bytes_evened_out(tmp_path) -> None:
    """Four replicas hold the same eight chunks: each is written once, two per rank."""
    chunks = {(f"model.p{i}", (0,)): ((4,), torch.full((4,), float(i))) for i in range(8)}
    sides = [SaveSide(str(tmp_path), r, chunks, {}) for r in range(4)]
    assigned, index = plan_globally(str(tmp_path), [s.plan() for s in sides])
    assert sorted(len(a) for a in assigned) == [2, 2, 2, 2]
    assert sum(len(e.chunks) for e in index.tensors.values()) == 8
