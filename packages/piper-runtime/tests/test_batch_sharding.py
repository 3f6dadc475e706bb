"""Batch sharding for data parallelism (docs/ir-conventions.md, section 7), without Ray."""

from __future__ import annotations

import pickle

import attrs
import numpy as np
import pytest
import torch

from piper_ir import Program, TensorMeta, Value
from piper_runtime.batch import (
    check_batch,
    from_wire,
    full_batch_shape,
    replica_slice,
    split_microbatches,
    to_wire,
)


def test_replica_slice_is_shard_j_of_each_microbatch() -> None:
    meta = TensorMeta((2, 3), "float32", batch_dim=0)  # one shard of one microbatch
    x = torch.arange(12 * 3, dtype=torch.float32).view(12, 3)  # M=3 microbatches x N=2 replicas
    assert full_batch_shape(meta, 3, 2) == (12, 3)
    for j in range(2):
        mine = replica_slice(x, meta, 3, 2, j)
        chunks = split_microbatches(mine, meta, 3)  # what the worker does with what it gets
        for i, chunk in enumerate(chunks):
            assert torch.equal(chunk, x[4 * i + 2 * j : 4 * i + 2 * j + 2])
    assert replica_slice(x, meta, 3, 1, 0) is x  # no copy without data parallelism
    scalar = TensorMeta((), "float32", batch_dim=None)
    assert replica_slice(torch.ones(()), scalar, 3, 2, 1).shape == ()


def test_check_batch_counts_replicas() -> None:
    program = Program(
        world_size=2,
        ranks=(),
        communicators=(),
        segments=(),
        values=(Value("input:0", TensorMeta((2, 3), "float32", batch_dim=0)),),
        inputs=("input:0",),
        targets=(),
        microbatches=2,
        replicas=2,
    )
    assert check_batch(program, (torch.zeros(8, 3),), ())["input:0"].shape == (8, 3)
    with pytest.raises(ValueError, match=r"expected shape \(8, 3\) .* x 2 microbatches x 2 replicas"):
        check_batch(program, (torch.zeros(4, 3),), ())
    single = attrs.evolve(program, replicas=1)
    assert check_batch(single, (torch.zeros(4, 3),), ())["input:0"].shape == (4, 3)


def test_batches_travel_as_numpy_where_numpy_can_hold_them_and_arrive_equal_and_writable() -> None:
    cases = [
        torch.randn(4, 3),
        torch.arange(6).reshape(2, 3).t(),  # not contiguous
        torch.tensor([True, False]),
        torch.randn(3, requires_grad=True),
        torch.randn(2, 2).to(torch.bfloat16),  # NumPy has no bfloat16: travels as a tensor
    ]
    for t in cases:
        wire = to_wire(t)
        assert isinstance(wire, torch.Tensor if t.dtype is torch.bfloat16 else np.ndarray)
        back = from_wire(pickle.loads(pickle.dumps(wire, protocol=5)))
        assert back.dtype == t.dtype and torch.equal(back, t.detach())
    frozen = np.arange(3.0)
    frozen.flags.writeable = False  # as Ray hands over a buffer from its object store
    arrived = from_wire(frozen)
    arrived += 1  # a writable copy, the store's buffer untouched
    assert frozen.tolist() == [0.0, 1.0, 2.0] and arrived.tolist() == [1.0, 2.0, 3.0]
