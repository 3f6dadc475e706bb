"""Batch streams: every kind of source, epochs, the last partial batch kept (or dropped with
``drop_last``), sizes that vary kept and dtypes or ranks that vary refused, the position saved and
restored, prefetching ahead without changing a batch; the factory forms of ``--model file.py:factory``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from piper_train.batches import BatchStream, Prefetcher, as_batch
from piper_train.loop import _batch_iterator
from piper_train.workload import load_factory, load_workload

N, D = 10, 3  # 10 samples: 3 full batches of 3 per epoch and one partial batch of 1


def _dataset() -> TensorDataset:
    x = torch.arange(N * D, dtype=torch.float32).view(N, D)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _firsts(batches: list) -> list[list[float]]:
    """Each batch's first-column values: which samples it holds, in order."""
    return [b[0][0][:, 0].tolist() for b in batches]


def _take(stream, n: int) -> list:
    return [next(stream) for _ in range(n)]


def test_a_dataset_is_batched_reshuffled_each_epoch_and_its_partial_batch_dropped() -> None:
    stream = BatchStream(_dataset(), batch_size=3, seed=5, drop_last=True)
    assert stream.batches_per_epoch == 3
    batches = _take(stream, 6)
    assert [stream.epoch, stream.index] == [1, 3]
    epochs = [sorted(v for b in _firsts(batches[i : i + 3]) for v in b) for i in (0, 3)]
    assert all(len(e) == 9 for e in epochs)  # 9 of the 10 samples per epoch, every batch full
    assert _firsts(batches[:3]) != _firsts(batches[3:])  # reshuffled
    again = _take(BatchStream(_dataset(), batch_size=3, seed=5, drop_last=True), 6)
    assert _firsts(again) == _firsts(batches)  # a function of (seed, epoch)
    in_order = _take(BatchStream(_dataset(), batch_size=3, shuffle=False, drop_last=True), 3)
    assert _firsts(in_order) == [[0.0, 3.0, 6.0], [9.0, 12.0, 15.0], [18.0, 21.0, 24.0]]


def test_a_dataloader_and_a_list_of_batches_drop_their_partial_last_batch() -> None:
    loader = DataLoader(_dataset(), batch_size=3, shuffle=True)
    stream = BatchStream(loader, seed=1, drop_last=True)
    assert stream.batches_per_epoch == 3  # not len(loader) == 4: the partial batch is dropped
    first_epoch = _take(stream, 3)
    assert [stream.epoch, stream.dropped] == [0, 0]
    next(stream)
    assert [stream.epoch, stream.index, stream.dropped] == [1, 1, 1]  # 4 batches, the partial dropped
    assert _firsts(_take(BatchStream(loader, seed=1, drop_last=True), 3)) == _firsts(first_epoch)  # seeded
    batches = [(x, y) for x, y in DataLoader(_dataset(), batch_size=4)]  # 4, 4, 2
    listed = BatchStream(batches, drop_last=True)
    assert listed.batches_per_epoch == 2
    assert [b[0][0].shape[0] for b in _take(listed, 4)] == [4, 4, 4, 4]
    assert (listed.epoch, listed.dropped) == (1, 1)


def test_a_one_shot_generator_is_one_epoch_and_a_function_is_endless() -> None:
    stream = BatchStream((torch.ones(2, D) * k, torch.zeros(2, 1)) for k in range(3))
    assert stream.batches_per_epoch is None
    assert len(list(stream)) == 3
    calls = BatchStream(lambda step: ((torch.full((2, D), float(step)),), (torch.zeros(2, 1),)))
    assert calls.batches_per_epoch is None and calls.kind == "function"
    assert [b[0][0][0, 0].item() for b in _take(calls, 4)] == [0, 1, 2, 3]


def test_by_default_every_batch_trains_the_partial_last_one_and_batches_of_other_sizes_too() -> None:
    stream = BatchStream(_dataset(), batch_size=3, seed=5)
    assert stream.batches_per_epoch == 4  # 3, 3, 3 and the partial 1
    epoch = _take(stream, 4)
    assert [b[0][0].shape[0] for b in epoch] == [3, 3, 3, 1] and stream.dropped == 0
    assert sorted(v for b in _firsts(epoch) for v in b) == [3.0 * k for k in range(N)]  # every sample once
    state = stream.state_dict()
    assert state == {"epoch": 0, "index": 4, "seed": 5}
    rest = _take(stream, 5)  # the next epoch, and into the one after
    resumed = BatchStream(_dataset(), batch_size=3, seed=5)
    resumed.load_state_dict(state)
    assert _firsts(_take(resumed, 5)) == _firsts(rest)  # the position stays exact with the partial batch
    loader = BatchStream(DataLoader(_dataset(), batch_size=4))
    assert loader.batches_per_epoch == 3 and [b[0][0].shape[0] for b in _take(loader, 3)] == [4, 4, 2]
    varying = [(torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long)),
               (torch.zeros(4, 24, dtype=torch.long), torch.zeros(4, 24, dtype=torch.long)),
               (torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long)),
               (torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))]
    listed = BatchStream(varying)
    assert listed.batches_per_epoch == 4
    assert [tuple(b[0][0].shape) for b in _take(listed, 4)] == [(4, 16), (4, 24), (2, 32), (4, 16)]


def test_dtypes_or_numbers_of_dimensions_that_vary_are_refused() -> None:
    varying = [(torch.zeros(4, D), torch.zeros(4, 1)), (torch.zeros(4, D, 1), torch.zeros(4, 1))]
    stream = BatchStream(varying, name="my data")
    next(stream)
    with pytest.raises(ValueError, match=r"my data, epoch 0, batch 1: input 0 has shape \(4, 3, 1\).*\(4, 3\)"):
        next(stream)
    other_dtype = [(torch.zeros(4, D), torch.zeros(4, 1)), (torch.zeros(4, D, dtype=torch.float64), torch.zeros(4, 1))]
    stream = BatchStream(other_dtype)
    next(stream)
    with pytest.raises(ValueError, match="first's dtypes and numbers of dimensions"):
        next(stream)
    with pytest.raises(ValueError, match="no full batch"):
        next(BatchStream([]))
    with pytest.raises(ValueError, match="needs a batch size"):
        BatchStream(_dataset())
    with pytest.raises(ValueError, match=r"expected an \(inputs, targets\) pair"):
        next(BatchStream([torch.zeros(2)]))
    with pytest.raises(ValueError, match="targets must be a tensor or a tuple of tensors"):
        as_batch((torch.zeros(2), "y"), "here")


@pytest.mark.parametrize("source", ["dataset", "loader", "function"])
def test_a_restored_position_continues_with_the_same_batches(source: str) -> None:
    def make() -> BatchStream:
        if source == "dataset":
            return BatchStream(_dataset(), batch_size=3, seed=2)
        if source == "loader":
            return BatchStream(DataLoader(_dataset(), batch_size=3, shuffle=True), seed=2)
        return BatchStream(lambda k: ((torch.full((3, D), float(k)),), (torch.zeros(3, 1),)))

    stream = make()
    _take(stream, 4)  # into the second epoch
    state = stream.state_dict()
    rest = _take(stream, 4)
    resumed = make()
    resumed.load_state_dict(state)
    assert _firsts(_take(resumed, 4)) == _firsts(rest)


def test_the_prefetcher_hands_out_the_streams_batches_and_its_own_position() -> None:
    plain = _take(BatchStream(_dataset(), batch_size=3, seed=3, drop_last=True), 7)
    ahead = Prefetcher(BatchStream(_dataset(), batch_size=3, seed=3, drop_last=True), depth=2)
    try:
        got = _take(ahead, 5)
        assert ahead.state_dict() == {"epoch": 1, "index": 2, "seed": 3}  # not where the thread is
        ahead.close()
        got += _take(ahead, 2)  # resumes after the last batch handed out
    finally:
        ahead.close()
    assert _firsts(got) == _firsts(plain)
    failing = Prefetcher(BatchStream([(torch.zeros(2, D), torch.zeros(2, 1)), (torch.zeros(2, 5, 1), torch.zeros(2, 1))]))
    next(failing)
    with pytest.raises(ValueError, match="input 0 has shape"):  # raised where the batch is taken
        next(failing)


def _factory(tmp_path: Path, body: str) -> str:
    path = tmp_path / "factory.py"
    path.write_text(body)
    return f"{path}:make"


MODEL = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from piper_directives import annotate

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 1)

        def forward(self, x):
            with annotate("PP"):
                x = torch.tanh(self.a(x))
            with annotate("PP"):
                return self.b(x)

    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(1, keepdim=True))
""")


def test_factory_forms(tmp_path: Path) -> None:
    one = load_factory(_factory(tmp_path, MODEL + "\ndef make():\n    return Net(), x[:4], x[:4, :1], nn.functional.mse_loss\n"))
    assert one.data is None and one.batches(5)[0][0].shape == (4, 3)
    spec = _factory(tmp_path, MODEL + "\ndef make():\n    return Net(), data, nn.functional.mse_loss, data\n")
    with pytest.raises(ValueError, match="needs a batch size"):
        load_factory(spec)
    ds = load_factory(spec, batch_size=4, seed=1)
    assert ds.example_inputs[0].shape == (4, 3) and ds.batch_size == 4 and ds.eval_batches is not None
    stream = ds.stream()
    assert torch.equal(next(stream)[0][0], ds.example_inputs[0])  # the example is the stream's first batch
    assert torch.equal(ds.eval_batches(1)[0][0], _rows(4, 8))  # held out: in order
    with pytest.raises(ValueError, match=r"only 2 batches, batch 2"):
        ds.eval_batches(2)
    bad = _factory(tmp_path, MODEL + "\ndef make():\n    return Net(), 3, nn.functional.mse_loss\n")
    with pytest.raises(ValueError, match="the factory must return"):
        load_factory(bad)


def test_a_batch_size_for_data_that_comes_batched_is_refused_not_ignored(tmp_path: Path) -> None:
    """``--batch-size`` batches a Dataset's samples; given for anything else it would do
    nothing, so it is refused naming what the data is."""
    x = torch.randn(8, 3)
    for source, what in [(DataLoader(TensorDataset(x, x), batch_size=4), "a DataLoader"),
                         ([(x, x)], "an iterable of batches"), (lambda step: (x, x), "a function of the step")]:
        with pytest.raises(ValueError, match=f"a batch size .*batches a Dataset's samples; this data is {what}"):
            BatchStream(source, batch_size=4)
    tensors = _factory(tmp_path, MODEL + "\ndef make():\n    return Net(), x[:4], x[:4, :1], nn.functional.mse_loss\n")
    with pytest.raises(ValueError, match=r"this factory returns its batch \(inputs, targets\) itself"):
        load_factory(tensors, batch_size=4)
    with pytest.raises(ValueError, match="a built-in model makes its own batches"):
        load_workload("mlp", stages=2, batch_size=4)
    # A Dataset to train on, held-out batches ready made: the batch size is the Dataset's alone
    mixed = _factory(tmp_path, MODEL + "\ndef make():\n    return Net(), data, nn.functional.mse_loss, [(x[:4], x[:4, :1])]\n")
    spec = load_factory(mixed, batch_size=4)
    assert spec.eval_batches(0)[0][0].shape == (4, 3)


def test_fit_reads_what_a_batch_stream_reads_and_asks_a_dataset_for_its_batch_size() -> None:
    x = torch.randn(8, 3)
    stream = _batch_iterator([(x, x)], seed=0)
    assert isinstance(stream, BatchStream) and torch.equal(next(stream)[0][0], x)
    assert isinstance(_batch_iterator(DataLoader(TensorDataset(x, x), batch_size=4), seed=0), BatchStream)
    ready = iter([(x, x)])
    assert _batch_iterator(ready, seed=0) is ready  # an iterator is used as it is
    with pytest.raises(ValueError, match=r"pass BatchStream\(dataset, batch_size=N\) or a DataLoader"):
        _batch_iterator(TensorDataset(x, x), seed=0)


def _rows(start: int, stop: int) -> torch.Tensor:
    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    return x[start:stop]
