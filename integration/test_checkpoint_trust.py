"""A checkpoint is data: loading one runs no code from it. Each crafted variant of a real
checkpoint (a pickle where a file of tensors or the index should be, the earlier format's
pickled ``.metadata``, an index naming a file elsewhere or holding an object no writer
makes, a shard cut short) is refused by ``piper export`` and ``piper train --resume`` with
exit 2 naming the file, before any worker starts, and the payload never runs (its marker
never appears). A newer checkpoint passed over on resume is named with the reason."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from piper_train.cli import main

pytestmark = pytest.mark.usefixtures("ray_cluster")
BASE = ["train", "--model", "mlp", "--pp", "2", "--microbatches", "2", "--optimizer", "adam", "--json",
        "--no-progress-bar"]


class _Payload:
    """Unpickling this makes the directory ``marker``: what an attacker's code would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _pickled(marker: Path) -> bytes:
    return pickle.dumps(_Payload(marker))


def _torch_saved(marker: Path, tmp: Path) -> bytes:
    torch.save({"w": _Payload(marker)}, tmp)
    assert zipfile.is_zipfile(tmp)
    return tmp.read_bytes()


def _index(step: Path) -> dict:
    return json.loads((step / "index.json").read_text())


def _variants(step: Path, marker: Path, scratch: Path) -> dict[str, tuple[callable, str]]:
    """name -> (how to damage a copy of ``step``, the file the refusal must name)."""
    shard = "rank-00000.safetensors"

    def legacy(d: Path) -> None:  # the earlier format: DCP files, whose .metadata is a pickle
        for f in d.glob("rank-*.safetensors"):
            f.unlink()
        (d / "index.json").unlink()
        (d / ".metadata").write_bytes(_pickled(marker))
        (d / "__0_0.distcp").write_bytes(_pickled(marker))
        manifest = json.loads((d / "piper.json").read_text())
        (d / "piper.json").write_text(json.dumps({**manifest, "version": 1}))

    def pickled_shard(d: Path) -> None:
        (d / shard).write_bytes(_pickled(marker))

    def torch_saved_shard(d: Path) -> None:
        (d / shard).write_bytes(_torch_saved(marker, scratch / "payload.pt"))

    def object_no_writer_makes(d: Path) -> None:
        index = _index(d)
        index["objects"]["train_state"]["value"] = {"pickle": _pickled(marker).hex()}
        (d / "index.json").write_text(json.dumps(index))

    def file_elsewhere(d: Path) -> None:
        index = _index(d)
        (scratch / "elsewhere.safetensors").write_bytes((d / shard).read_bytes())
        first = next(iter(index["tensors"].values()))
        first["chunks"][0]["file"] = "../../elsewhere.safetensors"
        (d / "index.json").write_text(json.dumps(index))

    def truncated(d: Path) -> None:
        data = (d / shard).read_bytes()
        (d / shard).write_bytes(data[:100])

    def pickled_index(d: Path) -> None:
        (d / "index.json").write_bytes(_pickled(marker))

    return {
        "legacy": (legacy, ".metadata"),
        "pickled shard": (pickled_shard, shard),
        "torch.save shard": (torch_saved_shard, shard),
        "object no writer makes": (object_no_writer_makes, "index.json"),
        "file elsewhere": (file_elsewhere, "index.json"),
        "truncated shard": (truncated, shard),
        "pickled index": (pickled_index, "index.json"),
    }


def test_crafted_checkpoints_run_no_code_and_are_refused_by_name(tmp_path, capsys) -> None:
    good = tmp_path / "good"
    assert main([*BASE, "--steps", "1", "--checkpoint-dir", str(good)]) == 0
    capsys.readouterr()
    step = good / "step-00000001"
    assert sorted(p.name for p in step.iterdir()) == ["index.json", "piper.json", "rank-00000.safetensors",
                                                      "rank-00001.safetensors"]
    marker = tmp_path / "marker"
    for name, (damage, culprit) in _variants(step, marker, tmp_path).items():
        root = tmp_path / name.replace(" ", "-")
        shutil.copytree(good, root)
        damage(root / "step-00000001")
        assert main(["export", str(root), "--out", str(tmp_path / "model.pt")]) == 2, name
        err = capsys.readouterr().err
        assert culprit in err and "Traceback" not in err, (name, err)
        assert main([*BASE, "--steps", "2", "--checkpoint-dir", str(root), "--resume"]) == 2, name
        captured = capsys.readouterr()
        assert culprit in captured.err and "Traceback" not in captured.err, (name, captured.err)
        assert not marker.exists(), f"{name}: the checkpoint ran code"
        assert (root / "step-00000001").is_dir(), f"{name}: a refused checkpoint is never deleted"
    assert "Convert it once (read as data, through an allow-list): piper convert-checkpoint" in _refusal(
        tmp_path / "legacy", capsys)

    # A pickle anywhere a reader never looks stays unread: the checkpoint still exports.
    (step / ".metadata").write_bytes(_pickled(marker))
    assert main(["export", str(good), "--out", str(tmp_path / "model.pt")]) == 0
    assert not marker.exists()
    torch.load(tmp_path / "model.pt", weights_only=True)

    # The newest checkpoint lacks its manifest: resume says which one it uses and why.
    newer = good / "step-00000005"
    shutil.copytree(step, newer)
    (newer / "piper.json").unlink()
    assert main([*BASE, "--steps", "2", "--checkpoint-dir", str(good), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"resuming from {step}; not from the newer step-00000005: no piper.json" in err


def _refusal(root: Path, capsys) -> str:
    assert main(["export", str(root), "--out", str(root.parent / "model.pt")]) == 2
    return capsys.readouterr().err
