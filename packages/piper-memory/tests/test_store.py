"""The flat-buffer shard store: padding, per-replica ranges, views and round trips."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from piper_ir import Bucket, TensorMeta  # noqa: E402
from piper_memory.store import BucketLayout, accumulate_grad  # noqa: E402

# 15 + 5 = 20 elements over 3 shards: shard_numel 7, padded to 21.
BUCKET = Bucket("bucket:s0:0", "s0", ("l.weight", "l.bias"), numel=20, shards=3)
SHAPES = ((5, 3), (5,))


def _tensors() -> list[torch.Tensor]:
    return [torch.arange(15.0).view(5, 3) + 1, torch.arange(5.0) + 100]


def test_padding_and_ranges() -> None:
    layout = BucketLayout(BUCKET, SHAPES)
    assert (BUCKET.shard_numel, BUCKET.padded_numel) == (7, 21)
    assert layout.offsets == (0, 15) and layout.numels == (15, 5)
    assert [layout.shard_range(j) for j in range(3)] == [(0, 7), (7, 14), (14, 21)]
    flat = layout.flatten(_tensors())
    assert flat.shape == (21,) and flat.dtype == torch.float32
    assert flat[20] == 0  # the padding is zero
    assert torch.equal(layout.shard(flat, 2), torch.tensor([15.0, 100, 101, 102, 103, 104, 0]))
    assert layout.shard(flat, 1).data_ptr() == flat[7:].data_ptr()  # a view, not a copy
    with pytest.raises(ValueError, match="replica 3 out of range"):
        layout.shard_range(3)


def test_round_trip_views_and_copies() -> None:
    layout = BucketLayout.from_metas(
        BUCKET, {"l.weight": TensorMeta((5, 3), "float32"), "l.bias": TensorMeta((5,), "float32")}
    )
    src = _tensors()
    flat = layout.flatten(src)
    views = layout.unflatten(flat)
    assert all(torch.equal(a, b) for a, b in zip(views, src, strict=True))
    flat[0] = -1.0
    assert views[0][0, 0] == -1.0  # unflatten gives views of the buffer
    dst = [torch.zeros(5, 3), torch.zeros(5)]
    layout.copy_into(flat, dst)
    assert dst[0][0, 0] == -1.0 and torch.equal(dst[1], src[1])
    # Shards from every replica reassemble the padded buffer.
    again = layout.assemble({j: layout.shard(flat, j).clone() for j in (2, 0, 1)})
    assert torch.equal(again, flat)
    with pytest.raises(ValueError, match=r"no shard from replicas \[1\]"):
        layout.assemble({0: flat[:7], 2: flat[14:]})


def test_flatten_none_is_zero_and_checks_shapes() -> None:
    layout = BucketLayout.from_tensors(BUCKET, {"l.weight": torch.ones(5, 3), "l.bias": torch.ones(5)})
    out = torch.full((21,), 7.0)
    flat = layout.flatten([torch.ones(5, 3), None], out=out)
    assert flat is out and flat[:15].eq(1).all() and flat[15:].eq(0).all()
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(5,\)"):
        layout.flatten([torch.ones(5, 3), torch.ones(4)])
    with pytest.raises(ValueError, match="hold 15 elements, the bucket says 20"):
        BucketLayout(BUCKET, ((5, 3), (0,)))


def test_accumulate_grad() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    accumulate_grad(p, torch.ones(3))
    accumulate_grad(p, torch.full((3,), 2.0))
    assert torch.equal(p.grad, torch.full((3,), 3.0))
