"""Where training batches come from: one batch, a function of the step, a ``Dataset``, a
``DataLoader`` or any iterable of ``(inputs, targets)`` batches, drawn one per step.

``BatchStream(source)`` turns any of them into an endless stream of ``(inputs, targets)``
pairs (each a tuple of tensors, dim 0 the batch), epoch after epoch:

- a function ``batches(step)`` (the built-in models): batch k is ``batches(k)``, no epochs;
- a ``torch.utils.data.Dataset`` of ``(input, target)`` samples: batched by a ``DataLoader``
  of ``batch_size``, reshuffled each epoch by a generator seeded from ``(seed, epoch)``
  (``shuffle=False``: in order), the last partial batch kept (``drop_last=True``: dropped);
- a ``DataLoader``: iterated once per epoch, its shuffling seeded from ``(seed, epoch)``
  (torch's global generator is forked for the first draw, so the user's own is untouched);
- any other iterable of batches (a list, a generator): iterated once per epoch (a one-shot
  iterator gives one epoch, then the stream ends).

Every batch must have as many inputs and targets as the first, of its dtypes and numbers of
dimensions; their sizes may differ (another sequence length, another batch size, an epoch's
last partial batch, which trains, never padded: ``Trainer`` compiles a program for each new
shape on first sight and weighs a partial batch's loss by its samples). Anything else is a
``ValueError`` naming the batch. ``drop_last=True`` drops an epoch's partial last batch instead
(a batch smaller than the first, followed by the epoch's end). The position (epoch, batch
within it) is ``state_dict``; with the seed it fixes every later batch, so a stream loaded with
it continues exactly.

``Prefetcher`` draws ahead on a background thread (``depth`` batches), so loading overlaps
the step running on the workers; its ``state_dict`` is that of the batches handed out.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

Batch = tuple[tuple[Tensor, ...], tuple[Tensor, ...]]


def as_batch(item: Any, where: str) -> Batch:
    """``(inputs, targets)`` as tuples of tensors from what a source yields: a pair (tuple or
    list) whose members are a tensor or a tuple/list of tensors."""
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise ValueError(f"{where}: expected an (inputs, targets) pair, got {_describe(item)}")
    out = []
    for what, part in zip(("inputs", "targets"), item, strict=True):
        tensors = tuple(part) if isinstance(part, tuple | list) else (part,)
        if not tensors or not all(isinstance(t, Tensor) for t in tensors):
            raise ValueError(f"{where}: {what} must be a tensor or a tuple of tensors, got {_describe(part)}")
        out.append(tensors)
    return out[0], out[1]


def batch_size(batch: Batch) -> int:
    return batch[0][0].shape[0] if batch[0][0].dim() else 1


def is_data_source(value: object) -> bool:
    """Whether ``value`` is a source of many batches (not one batch of tensors)."""
    if isinstance(value, Tensor) or (isinstance(value, tuple | list) and all(isinstance(t, Tensor) for t in value)):
        return False
    return isinstance(value, Dataset | DataLoader) or hasattr(value, "__iter__") or callable(value)


class BatchStream:
    """Batches from ``source``, one per ``next``, epoch after epoch (module doc)."""

    def __init__(
        self, source: Any, *, batch_size: int | None = None, shuffle: bool = True, seed: int = 0, name: str = "data",
        drop_last: bool = False,
    ) -> None:
        if isinstance(source, DataLoader):
            self.kind = "loader"
        elif isinstance(source, Dataset):
            self.kind = "dataset"
            if batch_size is None or batch_size < 1:
                raise ValueError(f"{name}: a Dataset is batched by the trainer and needs a batch size >= 1")
        elif hasattr(source, "__iter__"):
            self.kind = "iterable"
        elif callable(source):
            self.kind = "function"
        else:
            raise ValueError(f"{name}: expected a Dataset, a DataLoader, an iterable of batches or a function "
                             f"of the step, got {_describe(source)}")
        if batch_size is not None and self.kind != "dataset":
            what = {"loader": "a DataLoader, which batches with its own batch_size",
                    "iterable": "an iterable of batches", "function": "a function of the step, giving batches"}
            raise ValueError(f"{name}: a batch size (--batch-size) batches a Dataset's samples; this data is "
                             f"{what[self.kind]}")
        self.source = source
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.name = name
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0  # batches handed out in this epoch
        self.dropped = 0  # partial last batches dropped so far (``drop_last``)
        self.first: Batch | None = None
        self._it: Iterator[Any] | None = None
        self._ahead: list[Any] = []  # one item read ahead, to tell an epoch's last batch
        self._ended = False

    # -- position -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state``: the epoch's iterator opened again and ``index`` batches
        skipped (a function of the step just moves to step ``index``)."""
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"{self.name}: the saved position is of a stream seeded {state['seed']}, not {self.seed}")
        self.epoch, self.index = state["epoch"], 0
        self._it, self._ahead, self._ended = None, [], False
        if self.kind == "function":
            self.index = state["index"]
            return
        for _ in range(state["index"]):
            next(self)

    @property
    def batches_per_epoch(self) -> int | None:
        """Batches in one epoch, when the source knows its length (else ``None``): a partial
        last batch counts, unless ``drop_last`` drops it."""
        source = self.source
        drop = self.drop_last
        try:
            if self.kind == "dataset" and not isinstance(source, IterableDataset):
                size = self.batch_size or 1
                return len(source) // size if drop else -(-len(source) // size)  # type: ignore[arg-type]
            if self.kind == "loader" and source.batch_size and not isinstance(source.dataset, IterableDataset):
                if drop:
                    return len(source.dataset) // source.batch_size
                return len(source)
            if isinstance(source, list | tuple):
                sizes = [batch_size(as_batch(b, self.name)) for b in (source[0], source[-1])] if source else []
                return len(source) - (1 if drop and len(source) > 1 and sizes[1] < sizes[0] else 0)
            if self.kind == "loader":
                return len(source)
        except (TypeError, ValueError):
            pass
        return None

    # -- drawing -------------------------------------------------------------------------------

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        if self.kind == "function":
            batch = self._check(as_batch(self.source(self.index), self._where()))
            self.index += 1
            return batch
        while True:
            if self._ended:
                raise StopIteration
            item = self._pull()
            if item is _END:
                if self.index == 0:  # an epoch without a full batch: the source is spent
                    self._ended = True
                    if self.epoch == 0:
                        raise ValueError(f"{self.name}: the source yields no full batch")
                    raise StopIteration
                self.epoch, self.index, self._it = self.epoch + 1, 0, None
                continue
            batch = as_batch(item, self._where())
            if (self.drop_last and self.first is not None and batch_size(batch) < batch_size(self.first)
                    and self._peek() is _END):
                self.dropped += 1  # an epoch's last batch, partial: dropped
                continue
            self._check(batch)
            self.index += 1
            return batch

    def _pull(self) -> Any:
        if self._ahead:
            return self._ahead.pop()
        if self._it is None:
            self._it = self._open()
        return next(self._it, _END)

    def _peek(self) -> Any:
        if not self._ahead:
            self._ahead.append(self._pull())
        return self._ahead[-1]

    def _open(self) -> Iterator[Any]:
        """The iterator of the current epoch, seeded from ``(seed, epoch)``."""
        seed = _mix(self.seed, self.epoch)
        source = self.source
        if self.kind == "dataset":
            generator = torch.Generator().manual_seed(seed)
            shuffle = self.shuffle and not isinstance(source, IterableDataset)
            # Its own generator decides the order: torch's global one is neither read nor reseeded
            # here (this may be the prefetching thread, and the local runtime's rank threads draw
            # from the global generator meanwhile).
            return iter(DataLoader(source, batch_size=self.batch_size, shuffle=shuffle, generator=generator,
                                   drop_last=self.drop_last))
        if isinstance(source, DataLoader):
            # A DataLoader without its own generator draws its shuffling seed from torch's
            # global one when the first batch is drawn: draw it under a seeded fork.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                it = iter(source)
                first = next(it, _END)
            return itertools.chain([first], it) if first is not _END else iter(())
        return iter(source)

    def _check(self, batch: Batch) -> Batch:
        """``batch`` unchanged if it has the first batch's count of tensors, their dtypes and
        numbers of dimensions (sizes may differ: module doc)."""
        if self.first is None:
            self.first = batch
            return batch
        for what, got, want in (("input", batch[0], self.first[0]), ("target", batch[1], self.first[1])):
            if len(got) != len(want):
                raise ValueError(f"{self._where()}: {len(got)} {what}s, the first batch has {len(want)}")
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                if g.dim() != w.dim() or g.dtype != w.dtype:
                    raise ValueError(
                        f"{self._where()}: {what} {i} has shape {tuple(g.shape)} and dtype {g.dtype}, the first "
                        f"batch's has {tuple(w.shape)} and {w.dtype}; every batch must have the first's dtypes "
                        "and numbers of dimensions (their sizes may differ)"
                    )
        return batch

    def _where(self) -> str:
        return f"{self.name}, epoch {self.epoch}, batch {self.index}"


_END = object()


class Prefetcher:
    """Draws ``depth`` batches of ``stream`` ahead on a background thread (module doc)."""

    def __init__(self, stream: BatchStream, depth: int = 1, transform: Callable[[Batch], Batch] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.stream = stream
        self.depth = depth
        self.transform = transform or (lambda b: b)
        self._state = stream.state_dict()
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Batch:
        if self._thread is None:
            self._start()
        assert self._queue is not None
        kind, value, state = self._queue.get()
        if kind == "error":
            self.close()
            raise value
        if kind == "end":
            self.close()
            raise StopIteration
        self._state = state
        return value

    def state_dict(self) -> dict[str, int]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.close()
        self.stream.load_state_dict(state)
        self._state = self.stream.state_dict()

    def close(self) -> None:
        """Stop the thread; the batches it drew ahead are dropped (a later ``next`` goes on
        from the last batch handed out)."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a put
                self._queue.get_nowait()  # type: ignore[union-attr]
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
        self._thread = None

    def _start(self) -> None:
        if self.stream.state_dict() != self._state:  # the thread had drawn ahead: rewind
            self.stream.load_state_dict(self._state)
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._run, name="piper-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        q, stop = self._queue, self._stop
        assert q is not None
        while not stop.is_set():
            try:
                batch = self.transform(next(self.stream))
                item = ("batch", batch, self.stream.state_dict())
            except StopIteration:
                item = ("end", None, None)
            except BaseException as exc:  # handed to the consumer, raised there
                item = ("error", exc, None)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] != "batch":
                return


def _mix(seed: int, epoch: int) -> int:
    return (seed * 1_000_003 + epoch) % (2**63 - 1)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
