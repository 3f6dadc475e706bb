"""Checkpoint directories without workers: a write that fails leaves nothing that looks like a
checkpoint and touches nothing else, the latest complete checkpoint is found past partial
ones, pruning keeps the newest and removes what dead writers of this host left, and a
checkpoint of another model is refused by name."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from piper_ir import CheckpointError
from piper_train.checkpoints import (
    MANIFEST,
    abandoned,
    check_compatible,
    complete_checkpoints,
    latest_checkpoint,
    prune,
    read_manifest,
    resolve,
    save_atomically,
    write_atomically,
)


def _fake_dcp(tmp) -> None:
    (tmp / ".metadata").write_bytes(b"meta")
    (tmp / "__0_0.distcp").write_bytes(b"data")


def _write(root, step: int) -> None:
    write_atomically(root / f"step-{step:08d}", _fake_dcp, {"step": step, "parameters": {"w": [2, 3]}})


def test_a_failed_write_leaves_no_checkpoint_and_keeps_the_others(tmp_path) -> None:
    _write(tmp_path, 2)

    def crash(tmp) -> None:
        (tmp / "__0_0.distcp").write_bytes(b"half")
        raise RuntimeError("killed while writing")

    with pytest.raises(RuntimeError, match="killed"):
        write_atomically(tmp_path / "step-00000004", crash, {"step": 4})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    with pytest.raises(CheckpointError, match="never overwritten"):
        _write(tmp_path, 2)
    assert (tmp_path / "step-00000002" / "__0_0.distcp").read_bytes() == b"data"


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
    (tmp_path / "step-00000009").mkdir()  # no metadata: a partial copy, not a checkpoint
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
        (path / "__0_0.distcp").write_bytes(b"half")
    assert abandoned(tmp_path) == sorted(left)
    _write(tmp_path, 2)
    assert prune(tmp_path, 2) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in kept] + ["step-00000002"])


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
