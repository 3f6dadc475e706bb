"""The CUDA backend's decisions, as pure functions (tested without a GPU).

- **Transport per group.** NCCL cannot connect two ranks on one GPU (it refuses a duplicate
  device in a communicator), which happens on a single-GPU machine running a multi-rank plan
  or with fractional Ray GPUs. Every rank learns every rank's GPU identity at connect time;
  a collective group in which two members share a GPU, and a point-to-point channel whose two
  ends share one, is *host-staged* (device -> host copy, gloo, host -> device); everything
  else uses NCCL. Every rank computes the same answer from the same identities, so all make
  the same groups in the same order.
- **Channels.** Point-to-point traffic gets one two-rank communicator per direction of each
  pair (``channels``), each with a stream of its own on both ends: an NCCL send blocks its
  stream until the peer's receive runs, so a shared stream or communicator would add waits
  the plan never proved safe (two ranks sending to each other at once would deadlock);
  one FIFO per direction is exactly the buffered, ordered channel the verifier assumes.
- **NCCL datatypes** (the values are NCCL's ABI, the same as ``cupy.cuda.nccl.NCCL_*``) and
  the row offsets of an uneven all-to-all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum

import torch

NCCL_SUM = 0
NCCL_DTYPES: dict[torch.dtype, int] = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}


class Transport(StrEnum):
    NCCL = "nccl"
    HOST = "host-staged"


def nccl_dtype(dtype: torch.dtype) -> int:
    """NCCL's datatype for ``dtype``; ``TypeError`` naming the ones NCCL carries otherwise."""
    try:
        return NCCL_DTYPES[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in NCCL_DTYPES)
        raise TypeError(f"NCCL cannot carry {dtype} tensors (it carries {known})") from None


def shares_a_gpu(ranks: Sequence[int], identities: Sequence[str]) -> bool:
    """Whether two of ``ranks`` run on one GPU (``identities[r]`` names rank r's GPU)."""
    seen = [identities[r] for r in ranks]
    return len(set(seen)) < len(seen)


def group_transport(ranks: Sequence[int], identities: Sequence[str]) -> Transport:
    """How a collective group communicates (module doc)."""
    return Transport.HOST if shares_a_gpu(ranks, identities) else Transport.NCCL


def channel_transports(
    channels: Sequence[tuple[int, int]], identities: Sequence[str]
) -> dict[tuple[int, int], Transport]:
    """How each (sender, receiver) channel communicates, in the given order."""
    return {(s, r): group_transport((s, r), identities) for s, r in channels}


def gpus_in_use(identities: Sequence[str]) -> Mapping[str, tuple[int, ...]]:
    """GPU identity -> the ranks on it (for messages and the backend's report)."""
    found: dict[str, list[int]] = {}
    for rank, ident in enumerate(identities):
        found.setdefault(ident, []).append(rank)
    return {ident: tuple(ranks) for ident, ranks in found.items()}


def split_offsets(splits: Sequence[int]) -> list[int]:
    """Where each piece of a split starts (rows)."""
    offsets, at = [], 0
    for n in splits:
        offsets.append(at)
        at += n
    return offsets


def even_splits(rows: int, members: int) -> list[int]:
    """Even splits of ``rows`` over ``members`` (all-to-all without split sizes)."""
    if rows % members:
        raise ValueError(f"{rows} rows cannot be split evenly over {members} members")
    return [rows // members] * members
