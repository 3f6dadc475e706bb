"""What a torchrun job's processes tell each other (``piper_runtime.driver.outcomes``): data in,
the same values out, nothing else built, no pickle ever loaded."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import struct

import attrs
import pytest
import torch

from piper_ir import HangError
from piper_runtime.checkpoint import LocalPlan
from piper_runtime.driver.outcomes import Outcome, unpack
from piper_runtime.driver.ranks import RankFailure
from piper_runtime.rank.memory import RankMemory
from piper_runtime.results import InstructionTiming, StepOutput


def _output() -> StepOutput:
    return StepOutput(
        rank=1, losses=((0, 0.25), (1, float("nan"))), grads={"l0.weight": torch.randn(3, 2, dtype=torch.bfloat16)},
        timings=(InstructionTiming(1, "F.s1.mb0", 0.0, 0.01),), seconds=0.02,
        grad_shards={"b0": (1, torch.arange(5.0))}, memory=RankMemory(1, parameters=10, total=12),
        grad_norm=float("inf"), nonfinite=("s1:l0.weight",), started=12.5,
    )


def _equal(a: object, b: object) -> bool:
    """Equal as values: tensors by dtype and elements, NaN equal to NaN, records field by field."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if attrs.has(type(a)) or dataclasses.is_dataclass(a):
        return type(a) is type(b) and _equal(_fields(a), _fields(b))
    return a == b


def _fields(record: object) -> dict:
    names = [f.name for f in (attrs.fields(type(record)) if attrs.has(type(record)) else dataclasses.fields(record))]
    return {name: getattr(record, name) for name in names}


@pytest.mark.parametrize("value", [
    None, 7, ((0, 1, 2), 3), [_output(), _output()], {"w": torch.ones(2, 2)}, {"b": (0, torch.zeros(0))},
    LocalPlan({("w", (0, 0)): ((2, 2), (4, 2), "float32")}, {"train_state": {"tensor": "obj/0"}}),
], ids=["none", "int", "cores", "steps", "parameters", "shards", "plan"])
def test_what_a_rank_returns_comes_back_equal(value: object) -> None:
    assert _equal(unpack(Outcome("m", lambda: value).pack(), "m", 1), value)


def test_a_piper_error_comes_back_with_its_ranks_nodes_and_step() -> None:
    def hang() -> None:
        raise HangError("step 2: rank 1 is stuck", ranks=(1,), nodes=("F.s1.mb0",), step=2)

    with pytest.raises(RankFailure) as info:
        unpack(Outcome("run_steps", hang).pack(), "run_steps", 1)
    cause = info.value.cause
    assert isinstance(cause, HangError) and (cause.ranks, cause.nodes, cause.step) == ((1,), ("F.s1.mb0",), 2)
    assert "Traceback" in info.value.text and "rank 1 is stuck" in info.value.text


def test_another_exception_comes_back_as_its_text_and_an_oserror_with_its_errno() -> None:
    def boom() -> None:
        raise ValueError("boom in rank code")

    with pytest.raises(RankFailure) as info:
        unpack(Outcome("run_steps", boom).pack(), "run_steps", 0)
    assert info.value.cause is None and "ValueError: boom in rank code" in info.value.text

    def disk() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(RankFailure) as info:
        unpack(Outcome("checkpoint_write", disk).pack(), "checkpoint_write", 0)
    assert isinstance(info.value.cause, OSError) and info.value.cause.errno == 28


def test_a_value_that_is_not_data_is_sent_as_a_failure_naming_it() -> None:
    with pytest.raises(RankFailure, match="parameters returned what a launched job cannot send"):
        unpack(Outcome("parameters", lambda: object()).pack(), "parameters", 0)


def test_drivers_that_diverged_are_named() -> None:
    with pytest.raises(RankFailure, match="this one's call was run_steps, the process of rank 1 answered parameters"):
        unpack(Outcome("parameters", lambda: 1).pack(), "run_steps", 1)


def test_a_forged_answer_builds_nothing_and_runs_nothing(tmp_path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    header = json.dumps({"dict": [["method", "m"], ["ok", True], ["value", {"record": ["Payload", {"dict": []}]}]]})
    forged = [
        pickle.dumps(("m", True, Payload(), "")),  # what the processes used to send
        struct.pack("<Q", len(header)) + header.encode(),  # a record type no rank returns
        b"\x00" * 3,
    ]
    for blob in forged:
        with pytest.raises(RankFailure, match="is not one a rank sends"):
            unpack(blob, "m", 1)
    assert not marker.exists()
