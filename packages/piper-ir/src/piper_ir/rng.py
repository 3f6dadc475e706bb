"""Randomness is a function of (seed, segment, microbatch, step, shard): the seed each
segment's forward draws from, whoever runs it.

A runtime seeds its generator with ``rng_seed(...)`` around every forward of segment
``segment`` on microbatch ``microbatch`` of step ``step`` (counted from 0), data-parallel
shard ``shard`` (the replica's index; 0 without data parallelism), and around a recomputed
forward with the same key (``piper_semantics.randomness.seeded``); single-device training
reseeds with the same values where each segment starts (piper_directives.randomness). Then every strategy draws the dropout masks
single-device training draws. Pure Python, so every package computes the same number.
"""

from __future__ import annotations

import hashlib


def rng_seed(seed: int, segment: str, microbatch: int, step: int, shard: int = 0) -> int:
    """A 63-bit generator seed for one (segment, microbatch, step, shard) of a run seeded with
    ``seed``; distinct keys give unrelated seeds (a hash: neighbouring keys must not give
    related streams)."""
    key = f"piper-rng/{seed}/{segment}/{microbatch}/{step}/{shard}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
