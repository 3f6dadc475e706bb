"""Deterministic example data: a byte corpus read from the Python standard library's own source.

The corpus is real text that ships with every Python, so byte-level language-model examples
and tests need no download. It is deterministic for a given Python installation (files are
read in sorted path order); different Python versions give different corpora.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

# Third-party code installed under the stdlib directory is not part of the corpus.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 2_000_000) -> bytes:
    """The first ``max_bytes`` bytes of the standard library's ``.py`` files, in sorted path order.

    Files are concatenated as they are (each ends with a newline in practice). Walking stops
    as soon as enough bytes are read, so small corpora are cheap.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place makes os.walk visit directories in a deterministic order.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                data = (Path(dirpath) / name).read_bytes()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    if not chunks:
        raise FileNotFoundError(f"no .py files under {root}")
    return b"".join(chunks)


class ByteBatches:
    """Next-byte prediction batches drawn from a byte corpus.

    ``batches(step)`` returns ``(inputs, targets)``, both int64 tensors of shape
    ``(batch, seq_len)`` with ``targets[:, t] == inputs[:, t + 1]`` inside the corpus. Each
    row starts at a random offset drawn from a generator seeded by ``(seed, step)``, so a step
    always gives the same batch, whatever order steps are requested in.
    """

    def __init__(self, corpus: bytes, batch: int, seq_len: int, seed: int = 0) -> None:
        if batch < 1 or seq_len < 1:
            raise ValueError(f"batch and seq_len must be positive, got {batch} and {seq_len}")
        if len(corpus) < seq_len + 1:
            raise ValueError(f"corpus of {len(corpus)} bytes is too short for seq_len {seq_len}")
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(torch.int64)
        self.batch = batch
        self.seq_len = seq_len
        self.seed = seed

    def __call__(self, step: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(_mix(self.seed, step))
        starts = torch.randint(0, len(self.data) - self.seq_len, (self.batch,), generator=gen)
        index = starts[:, None] + torch.arange(self.seq_len + 1)
        window = self.data[index]
        return window[:, :-1], window[:, 1:]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        step = 0
        while True:
            yield self(step)
            step += 1


def _mix(seed: int, step: int) -> int:
    """One generator seed per (seed, step) pair; distinct pairs give distinct seeds."""
    return (seed * 1_000_003 + step) % (2**63 - 1)
