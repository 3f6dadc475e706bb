"""The stdlib byte corpus and the deterministic next-byte batches."""

from __future__ import annotations

import pytest
import torch

from piper_train.data import ByteBatches, stdlib_corpus


def test_stdlib_corpus_is_python_source_and_deterministic() -> None:
    corpus = stdlib_corpus()
    assert isinstance(corpus, bytes) and len(corpus) == 2_000_000
    assert corpus.count(b"def ") > 1000 and corpus.count(b"import ") > 100
    stdlib_corpus.cache_clear()
    assert stdlib_corpus() == corpus
    small = stdlib_corpus(1000)
    assert len(small) == 1000 and corpus.startswith(small)


def test_stdlib_corpus_rejects_nonpositive_size() -> None:
    with pytest.raises(ValueError):
        stdlib_corpus(0)


def test_byte_batches_shapes_and_targets() -> None:
    corpus = stdlib_corpus(50_000)
    batches = ByteBatches(corpus, batch=4, seq_len=32, seed=0)
    x, y = batches(0)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < 256
    # Each row is a contiguous window of the corpus, targets shifted by one byte.
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        window = bytes(row_x) + bytes(row_y[-1:])
        assert window in corpus


def test_byte_batches_are_deterministic_per_step() -> None:
    corpus = stdlib_corpus(50_000)
    a, b = ByteBatches(corpus, 8, 16, seed=3), ByteBatches(corpus, 8, 16, seed=3)
    later = b(7)
    assert torch.equal(a(7)[0], later[0]) and torch.equal(a(7)[1], later[1])  # order does not matter
    assert not torch.equal(a(0)[0], a(1)[0])
    assert not torch.equal(a(0)[0], ByteBatches(corpus, 8, 16, seed=4)(0)[0])
    it = iter(a)
    assert torch.equal(next(it)[0], a(0)[0]) and torch.equal(next(it)[0], a(1)[0])


def test_byte_batches_cover_the_corpus_end() -> None:
    corpus = bytes(range(10))
    x, y = ByteBatches(corpus, batch=64, seq_len=9, seed=0)(0)
    assert torch.equal(x, torch.arange(9).expand(64, 9)) and torch.equal(y, torch.arange(1, 10).expand(64, 9))


@pytest.mark.parametrize(
    ("corpus", "batch", "seq_len"), [(b"abc", 1, 3), (b"abcdef", 0, 2), (b"abcdef", 1, 0)]
)
def test_byte_batches_reject_bad_sizes(corpus: bytes, batch: int, seq_len: int) -> None:
    with pytest.raises(ValueError):
        ByteBatches(corpus, batch, seq_len)
