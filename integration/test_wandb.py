"""``piper train --wandb PROJECT/RUN`` under ``WANDB_MODE=offline``: the run W&B writes locally
holds the run's options and, at each step, the loss the ``--json`` document reports.

W&B's offline run is one file of records (``run-<id>.wandb``: W&B's record log of
``wandb_internal_pb2.Record`` protobufs, blocks of 32 KiB, each record behind a 7-byte header:
checksum, length, kind); ``_records`` reads it back, so the test sees what W&B would upload.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")  # an optional dependency (piper-train[wandb])
from wandb.proto import wandb_internal_pb2  # noqa: E402

BLOCK = 32 * 1024
FULL, LAST = 1, 4


def _records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""  # the file's header: ":W&B", a magic number, a version
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _finished(path: Path, timeout_s: float = 60.0) -> list[wandb_internal_pb2.Record]:
    """The run's records once W&B's own process has written its last (``exit``): it goes on
    writing after ``finish`` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_an_offline_run_holds_the_options_and_each_steps_loss(piper, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    done = piper("train", "--model", "mlp", "--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--steps",
                 "3", "--wandb", "piper-test/gpipe-run", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)  # stdout is still the one document
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    runs, losses = [], {}
    for record in _finished(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            runs.append(record.run)
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if "train/loss" in items:
                losses[record.history.step.num] = items["train/loss"]
    (run,) = runs
    assert (run.project, run.display_name) == ("piper-test", "gpipe-run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["schedule"] == "gpipe" and config["pp"] == 2
    assert losses == {1: document["losses"][0], 2: document["losses"][1], 3: document["losses"][2]}


def test_a_malformed_target_is_refused_naming_the_flag(piper) -> None:
    done = piper("train", "--model", "mlp", "--wandb", "project/", "--steps", "1")
    assert done.returncode == 2
    assert "--wandb: expected PROJECT or PROJECT/RUN, got 'project/'" in done.stderr
