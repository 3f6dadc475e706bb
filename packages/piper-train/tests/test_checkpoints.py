"""Checkpoint directories without workers: a write that fails leaves nothing that looks like a
checkpoint and touches nothing else, the latest complete checkpoint is found past partial
ones, pruning keeps the newest and removes what dead writers of this host left, and a
checkpoint of another model is refused by name."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import warnings

import pytest
import torch

from piper_ir import CheckpointError
from piper_train.checkpoints import (
    MANIFEST,
    abandoned,
    begin_atomically,
    check_compatible,
    complete_checkpoints,
    latest_checkpoint,
    prune,
    read_manifest,
    resolve,
    save_atomically,
    skipped_newer,
    write_atomically,
)


def _fake_files(tmp) -> None:
    (tmp / "index.json").write_bytes(b"{}")
    (tmp / "rank-00000.safetensors").write_bytes(b"data")


def _write(root, step: int) -> None:
    write_atomically(root / f"step-{step:08d}", _fake_files, {"step": step, "parameters": {"w": [2, 3]}})


def test_a_failed_write_leaves_no_checkpoint_and_keeps_the_others(tmp_path) -> None:
    _write(tmp_path, 2)

    def crash(tmp) -> None:
        (tmp / "rank-00000.safetensors").write_bytes(b"half")
        raise RuntimeError("killed while writing")

    with pytest.raises(RuntimeError, match="killed"):
        write_atomically(tmp_path / "step-00000004", crash, {"step": 4})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    with pytest.raises(CheckpointError, match="never overwritten"):
        _write(tmp_path, 2)
    assert (tmp_path / "step-00000002" / "rank-00000.safetensors").read_bytes() == b"data"


def test_an_export_that_fails_leaves_the_file_before_it(tmp_path) -> None:
    out = tmp_path / "model.pt"
    save_atomically({"w": torch.ones(2)}, out)
    with pytest.raises(Exception, match="pickle"):
        save_atomically({"w": torch.zeros(2), "bad": lambda: None}, out)  # torch.save cannot write a lambda
    assert torch.equal(torch.load(out)["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_latest_skips_partial_checkpoints_and_prune_keeps_the_newest(tmp_path) -> None:
    for step in (1, 2, 3, 4):
        _write(tmp_path, step)
    (tmp_path / "step-00000009").mkdir()  # no index: a partial copy, not a checkpoint
    (tmp_path / ".tmp-step-00000010-1-abc").mkdir()  # a crashed writer's leftovers
    assert latest_checkpoint(tmp_path).name == "step-00000004"
    assert resolve(tmp_path).name == "step-00000004"
    assert [p.name for p in prune(tmp_path, 2)] == ["step-00000001", "step-00000002"]
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [3, 4]
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve(tmp_path / "step-00000009")
    assert read_manifest(tmp_path / "step-00000004")["step"] == 4


def test_prune_removes_what_dead_writers_of_this_host_left(tmp_path) -> None:
    """A writer SIGKILLed mid-write (or mid-delete) leaves its temporary directory; the next
    complete checkpoint's prune removes it, but never one of a live process, of another host
    (a shared filesystem) or of a name it does not know."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pid, host = int(dead.stdout), socket.gethostname()
    left = [tmp_path / f".tmp-step-00000005-{pid}@{host}-0123abcd",
            tmp_path / f".tmp-deleting-step-00000001-{pid}@{host}-89abcdef"]
    kept = [tmp_path / f".tmp-step-00000006-{os.getpid()}@{host}-0123abcd",  # alive: still writing
            tmp_path / f".tmp-step-00000007-{pid}@{host}x-0123abcd",  # another host
            tmp_path / ".tmp-step-00000008-1-abc", tmp_path / "notes"]
    for path in left + kept:
        path.mkdir()
        (path / "rank-00000.safetensors").write_bytes(b"half")
    assert abandoned(tmp_path) == sorted(left)
    _write(tmp_path, 2)
    assert prune(tmp_path, 2) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in kept] + ["step-00000002"])


def test_a_launched_jobs_processes_share_one_temporary_directory(tmp_path) -> None:
    """Under torchrun every process writes its rank's files into one temporary directory, which
    all name alike (``writer``: the coordinator's process); only the coordinator writes the
    manifest and renames, and what a dead coordinator left is the next prune's to remove."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    writer = f"{int(dead.stdout)}@{socket.gethostname()}-0123abcd"
    target = tmp_path / "step-00000003"

    def rank_file(rank: int):
        return lambda tmp: (tmp / f"rank-{rank:05d}.safetensors").write_bytes(b"data")

    assert write_atomically(target, rank_file(1), {"step": 3}, writer=writer, coordinator=False) == target
    assert not target.exists()  # a peer's part is written, nothing is renamed

    def coordinator_files(tmp) -> None:
        rank_file(0)(tmp)
        (tmp / "index.json").write_bytes(b"{}")

    write_atomically(target, coordinator_files, {"step": 3}, writer=writer)
    assert sorted(p.name for p in target.iterdir()) == [
        "index.json", MANIFEST, "rank-00000.safetensors", "rank-00001.safetensors"]
    assert latest_checkpoint(tmp_path) == target
    left = begin_atomically(tmp_path / "step-00000004", writer)  # its coordinator died while writing it
    assert left == begin_atomically(tmp_path / "step-00000004", writer)  # every process finds the same
    assert abandoned(tmp_path) == [left]


def test_nothing_to_resume_and_bad_manifests_are_named(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(tmp_path / "none")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        resolve(tmp_path)
    _write(tmp_path, 1)
    (tmp_path / "step-00000001" / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="piper.json: not a readable checkpoint manifest"):
        read_manifest(tmp_path / "step-00000001")


def test_another_model_is_refused_naming_the_parameters(tmp_path) -> None:
    manifest = {"parameters": {"a.weight": [4, 2], "b.bias": [3]}, "optimizer": "adamw"}
    check_compatible(tmp_path, manifest, {"a.weight": (4, 2), "b.bias": (3,)}, "adamw")
    with pytest.raises(CheckpointError, match=r"a.weight: \[4, 3\] here, \[4, 2\] saved"):
        check_compatible(tmp_path, manifest, {"a.weight": (4, 3), "b.bias": (3,)}, "adamw")
    with pytest.raises(CheckpointError, match="missing from the checkpoint: c.weight.*does not have: b.bias"):
        check_compatible(tmp_path, manifest, {"a.weight": (4, 2), "c.weight": (3,)}, "adamw")
    with pytest.raises(CheckpointError, match="holds adamw optimizer state; this run uses sgd"):
        check_compatible(tmp_path, manifest, {"a.weight": (4, 2), "b.bias": (3,)}, "sgd")


def _legacy_checkpoint(root, payload=None):
    """A checkpoint as Piper wrote them before: a torch distributed checkpoint (pickled
    ``.metadata``, objects through ``torch.save``) and a version-1 manifest."""
    import random

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    path = root / "step-00000003"
    state = {"model.w": torch.arange(6.0).reshape(2, 3), "optim.w.exp_avg": torch.ones(2, 3),
             "optim.w.step": torch.tensor(3.0),
             "train_state": {"step": 3, "samples": 12, "tokens": 0, "lr": {"lr": 0.1}, "data": None,
                             "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}},
             "rng.rank0": {"torch": torch.get_rng_state(), "cuda": None}}
    if payload is not None:  # an object whose unpickling runs code: what a crafted checkpoint holds
        state["train_state"]["data"] = payload
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True,
                 planner=DefaultSavePlanner(flatten_state_dict=False))  # objects whole, as Piper wrote them
    (path / MANIFEST).write_text(json.dumps({"format": "piper-checkpoint", "version": 1, "step": 3,
                                             "parameters": {"w": [2, 3]}, "optimizer": "adam", "untraced": []}))
    return path, state


def test_an_earlier_checkpoint_is_refused_then_converted_as_data(tmp_path, capsys) -> None:
    """The earlier format is never loaded on its own; ``piper convert-checkpoint`` reads its
    pickles as data and writes the same tensors and objects, which then export and read back."""
    from piper_runtime.checkpoint import read_model, read_objects
    from piper_train.cli import main

    source, state = _legacy_checkpoint(tmp_path / "old")
    assert main(["export", str(source.parent), "--out", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert str(source) in err and "pickle" in err and "Traceback" not in err
    with pytest.raises(CheckpointError, match="Convert it once"):
        resolve(source.parent)
    assert main(["convert-checkpoint", str(source), "--out", str(tmp_path / "new")]) == 0
    converted = tmp_path / "new" / "step-00000003"
    assert resolve(tmp_path / "new") == converted and read_manifest(converted)["step"] == 3
    assert torch.equal(read_model(str(converted))["w"], state["model.w"])
    train_state = read_objects(str(converted), ["train_state"])["train_state"]
    assert train_state["rng"]["python"] == state["train_state"]["rng"]["python"]
    assert torch.equal(train_state["rng"]["torch"], state["train_state"]["rng"]["torch"])
    assert {k: v for k, v in train_state.items() if k != "rng"} == {
        k: v for k, v in state["train_state"].items() if k != "rng"}
    assert main(["export", str(tmp_path / "new"), "--out", str(tmp_path / "m.safetensors")]) == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "m.safetensors")["w"], state["model.w"])
    assert sorted(p.name for p in source.iterdir()) == sorted([".metadata", "__0_0.distcp", MANIFEST])  # untouched


class _Payload:
    """Unpickling this makes the directory ``marker``: what a crafted checkpoint would do."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("where", [".metadata", "__0_0.distcp"])
def test_converting_a_crafted_earlier_checkpoint_runs_nothing(tmp_path, capsys, where) -> None:
    """A pickle payload as the metadata (a global outside the allow-list), or inside an object
    item (``torch.load(weights_only=True)`` refuses it): exit 2 naming the file, no marker."""
    import pickle

    from piper_train.cli import main

    marker = tmp_path / "marker"
    if where == ".metadata":
        source, _ = _legacy_checkpoint(tmp_path / "old")
        (source / where).write_bytes(pickle.dumps(_Payload(marker)))
    else:  # the train state's item, torch.save'd by DCP as it was written
        source, _ = _legacy_checkpoint(tmp_path / "old", payload=_Payload(marker))
    assert not marker.exists()
    assert main(["convert-checkpoint", str(source), "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert str(source / where) in err and "Traceback" not in err
    assert "posix.mkdir" in err  # the global it asked for, refused
    assert not marker.exists()
    assert not (tmp_path / "new" / source.name).exists()


def test_resume_names_the_newer_directories_it_passes_over(tmp_path) -> None:
    for step in (1, 2):
        _write(tmp_path, step)
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000003" / "index.json").write_text("{}")  # no manifest: cut short by hand
    assert skipped_newer(tmp_path) == [(tmp_path / "step-00000003", "no piper.json (damaged, or cut short by hand)")]
    assert resolve(tmp_path).name == "step-00000002"
    shutil.rmtree(tmp_path / "step-00000003")
    _legacy_checkpoint(tmp_path)  # the newest, of the earlier format: never passed over quietly
    with pytest.raises(CheckpointError, match="written by an earlier Piper"):
        resolve(tmp_path)
