"""Where a model comes from: a built-in example or a user's ``path/to/file.py:factory``.

The factory contract (also in the README): ``factory()`` takes no arguments and returns
``(model, example_inputs, example_targets, loss_fn)`` or ``(model, example_inputs,
example_targets, loss_fn, batches)`` where ``model`` is an ``nn.Module`` whose ``forward`` is
fully covered by ``annotate("PP")`` regions, the inputs and targets are a tensor or a tuple of
tensors holding one full batch (dim 0 is the batch), ``loss_fn(*outputs, *targets)`` returns a
scalar mean loss, and ``batches(step)`` (optional) returns step ``step``'s ``(inputs,
targets)`` like the example batch; without it every training step reuses the example batch.
Or it returns ``(model, data, loss_fn)`` or ``(model, data, loss_fn, eval_data)``: ``data`` a
``torch.utils.data.Dataset`` of ``(input, target)`` samples (batched by ``batch_size``), a
``DataLoader``, or any iterable of ``(inputs, targets)`` batches (``piper_train.batches``);
the first batch is the example the program is compiled for, every step draws the next;
``eval_data`` likewise, the held-out batches. The strategy decides how many regions go on
each rank, so one factory serves every strategy (the region count must be divisible by the
number of pipeline ranks).

The file runs as a script would: its directory is put first on ``sys.path`` (if it is not
there yet), so it can import modules next to it. The workers get the file and those modules
by value (piper_runtime.driver.user_code), not by import.
"""

from __future__ import annotations

import importlib.util
import io
import sys
import tokenize
import traceback
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
from torch.utils.data import Dataset

from piper_train.batches import BatchStream, is_data_source
from piper_train.hf import build_hf, is_hf, layer_count, load_hf, logits_only
from piper_train.models import LM_VALIDATION, MODELS, ModelSpec, PackedTransformer, build_model
from piper_train.text import load_text as read_text
from piper_train.text import packed_lm_loss


def _as_tuple(value: object, what: str, origin: str) -> tuple[torch.Tensor, ...]:
    items = value if isinstance(value, tuple | list) else (value,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise ValueError(f"{origin}: {what} must be a tensor or a tuple of tensors")
    return tuple(items)


def load_factory(spec: str, *, batch_size: int | None = None, seed: int = 0) -> ModelSpec:
    """Import ``path.py:factory`` and call it; ``batch_size`` batches a ``Dataset`` it
    returns, ``seed`` seeds the shuffling of its data."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path_text or not name or not path.is_file():
        raise ValueError(f"model {spec!r}: expected an existing 'path/to/file.py:factory'")
    _check_source(path, spec)
    module_name = f"piper_user_{path.stem}"
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # like ``python file.py``: modules next to it import by name
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise ValueError(f"model {spec!r}: cannot import {path}")
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    try:
        loader.loader.exec_module(module)
    except Exception as err:  # the user's file: say where, no traceback of ours
        del sys.modules[module_name]
        raise ValueError(f"model {spec!r}: running {path} failed: {user_failure(err, path)}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {path} has no callable {name!r}")
    try:
        result = factory()
    except Exception as err:
        raise ValueError(f"model {spec!r}: the factory {name}() raised {user_failure(err, path)}") from None
    forms = ("(model, inputs, targets, loss_fn[, batches]), (model, data, loss_fn) or "
             "(model, data, loss_fn, eval_data)")
    if not isinstance(result, tuple) or len(result) not in (3, 4, 5) or not isinstance(result[0], torch.nn.Module):
        raise ValueError(f"model {spec!r}: the factory must return {forms}")
    if len(result) == 5 or (len(result) == 4 and not is_data_source(result[1])):
        model, inputs, targets, loss_fn = result[:4]
        if not callable(loss_fn):
            raise ValueError(f"model {spec!r}: the factory must return (nn.Module, inputs, targets, callable loss)")
        inputs_t, targets_t = _as_tuple(inputs, "inputs", spec), _as_tuple(targets, "targets", spec)
        if batch_size is not None:
            raise ValueError(f"model {spec!r}: a batch size (--batch-size) batches a Dataset's samples; this "
                             "factory returns its batch (inputs, targets) itself")
        if len(result) == 5:
            if not callable(result[4]):
                raise ValueError(f"model {spec!r}: the factory's fifth item must be a callable batches(step)")
            return ModelSpec(spec, model, inputs_t, targets_t, loss_fn, _checked_batches(result[4], spec), 0, 0)
        return ModelSpec(spec, model, inputs_t, targets_t, loss_fn, lambda step: (inputs_t, targets_t), 0, 0)
    model, data, loss_fn, *rest = result
    if not callable(loss_fn) or not is_data_source(data):
        raise ValueError(f"model {spec!r}: the factory must return {forms}; got a {type(data).__name__} as data")
    eval_data = rest[0] if rest else None
    if eval_data is not None and not is_data_source(eval_data):
        raise ValueError(f"model {spec!r}: eval_data must be a Dataset, a DataLoader or an iterable of batches")
    train = _Indexed(lambda: BatchStream(data, batch_size=batch_size, seed=seed, name=f"{spec} data"))
    held_out = None
    if eval_data is not None:
        held_out = _Indexed(
            lambda: BatchStream(eval_data, batch_size=batch_size if isinstance(eval_data, Dataset) else None,
                                shuffle=False, name=f"{spec} eval data", drop_last=True),
            one_epoch=True,
        )
    inputs_t, targets_t = train(0)
    return ModelSpec(spec, model, inputs_t, targets_t, loss_fn, train, 0, seed, held_out, data, batch_size)


def _check_source(path: Path, spec: str) -> None:
    """Refuse a file that is not Python text, naming it, before it runs: a binary file (Python
    would say "source code string cannot contain null bytes" of no file), or bytes its
    encoding (UTF-8 unless the file declares another, PEP 263) cannot decode, named by line."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"model {spec!r}: cannot read {path}: {err.strerror or err}") from None
    if b"\0" in data:
        line = data.count(b"\n", 0, data.index(b"\0")) + 1
        raise ValueError(f"model {spec!r}: {path} is not Python source: a NUL byte at line {line} (a binary file?)")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as err:  # an unknown or contradictory encoding declaration
        raise ValueError(f"model {spec!r}: {path}: {err.msg}") from None
    try:
        data.decode(encoding)
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(f"model {spec!r}: {path} is not {encoding} text: byte 0x{data[err.start]:02x} at line "
                         f"{line} cannot be decoded (save it as UTF-8, or declare its encoding: PEP 263)") from None


def user_failure(err: Exception, path: Path) -> str:
    """``err`` in a user's file as one line: its type and message, and where: the line of a
    ``SyntaxError``, else the last frame in ``path`` (and the frame that raised, if another)."""
    if isinstance(err, SyntaxError):
        return f"{type(err).__name__} at {err.filename or path}:{err.lineno or '?'}: {err.msg}" + (
            f": {err.text.strip()}" if err.text else ""
        )
    frames = traceback.extract_tb(err.__traceback__)
    mine = [f for f in frames if Path(f.filename).resolve() == path.resolve()]
    where = [f"{f.filename}:{f.lineno} in {f.name}" for f in (mine[-1:] + frames[-1:]) if f is not None]
    where = list(dict.fromkeys(where))
    return f"{type(err).__name__}: {err}" + (f" (at {', raised at '.join(where)})" if where else "")


def _checked_batches(batches: Callable[[int], object], spec: str) -> Callable[[int], tuple[tuple[torch.Tensor, ...], ...]]:
    def checked(step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        batch = batches(step)
        if not isinstance(batch, tuple) or len(batch) != 2:
            raise ValueError(f"model {spec!r}: batches({step}) must return (inputs, targets)")
        return _as_tuple(batch[0], "inputs", spec), _as_tuple(batch[1], "targets", spec)

    return checked


class _Indexed:
    """Batch ``k`` of a stream by index (drawing and keeping the batches up to it): the
    ``ModelSpec.batches`` of a data source, for ``piper check`` and the example batch, and
    its ``eval_batches`` (``one_epoch``: held-out data is not repeated)."""

    def __init__(self, make: Callable[[], BatchStream], one_epoch: bool = False) -> None:
        self.make = make
        self.one_epoch = one_epoch
        self.stream: BatchStream | None = None
        self.drawn: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []

    def __call__(self, k: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        if self.stream is None:
            self.stream = self.make()
        while len(self.drawn) <= k:
            try:
                batch = next(self.stream)
            except StopIteration:
                batch = None
            if batch is None or (self.one_epoch and self.stream.epoch > 0):
                raise ValueError(f"{self.stream.name}: only {len(self.drawn)} batches, batch {k} was asked for")
            self.drawn.append(batch)
        return self.drawn[k]


def load_workload(
    spec: str, *, stages: int, seed: int = 0, batch_size: int | None = None, regions: str | None = None,
    capture: str = "auto", data: str | None = None, tokenizer: str | None = None, seq_len: int | None = None,
) -> ModelSpec:
    """``_load`` with the regions and the capture method set (``ModelSpec.regions``); with
    ``data`` (``text:GLOB`` or ``hf:PATH``), the built-in ``lm`` on that text (``load_text``)."""
    if data is not None:
        workload = load_text(spec, data, tokenizer=tokenizer, seq_len=seq_len, stages=stages, seed=seed,
                             batch_size=batch_size)
    else:
        for flag, value in (("--tokenizer", tokenizer), ("--seq-len", seq_len)):
            if value is not None:
                raise ValueError(f"{flag} is for text data: give --data text:GLOB or hf:PATH")
        workload = _load(spec, stages=stages, seed=seed, batch_size=batch_size)
    return attrs.evolve(workload, regions=regions, capture=capture)


TEXT_MODEL = "lm"  # the built-in model --data trains
TEXT_BATCH, TEXT_SEQ_LEN = 16, 64  # the lm model's batch and sequence length


def load_text(
    spec: str, data: str, *, tokenizer: str | None, seq_len: int | None, stages: int, seed: int = 0,
    batch_size: int | None = None,
) -> ModelSpec:
    """The ``lm`` model (a ``PackedTransformer``: d 64, 4 heads, one block per stage, its
    vocabulary the tokenizer's), or a Hugging Face model ``hf:PATH`` fed the position ids as
    ``position_ids`` (its vocabulary must hold the tokenizer's ids, its positions a row), on
    the rows ``piper_train.text`` packs from ``data``:
    ``batch_size`` rows of ``seq_len`` tokens a batch (default 16 of 64), reshuffled every
    epoch from ``seed``, each epoch's partial last batch dropped. The last tenth of the rows
    is held out (``eval_batches``, read in order, whole batches only) where it fills a batch;
    else there is no held-out data (docs/data.md)."""
    if spec != TEXT_MODEL and not is_hf(spec):
        raise ValueError(f"--data trains the built-in model {TEXT_MODEL!r} (sized to the tokenizer) or an hf: model; "
                         f"--model {spec} brings its own data")
    seq_len = seq_len or TEXT_SEQ_LEN
    batch = batch_size or TEXT_BATCH
    text = read_text(data, tokenizer, seq_len)
    train, held = text.packed.split(LM_VALIDATION)
    held_note = f", the last {len(held)} held out"
    if len(held) < batch:
        held_note = f", none held out (the last tenth, {len(held)} rows, fills no batch of {batch})"
        train, held = text.packed, None
    if len(train) < batch:
        raise ValueError(f"--data {data}: {len(train)} rows of {seq_len} tokens, fewer than a batch of {batch} "
                         "(--batch-size)")
    if is_hf(spec):
        model, config = build_hf(spec, seed=seed)
        model, stages = logits_only(model, packed=True).train(), layer_count(model)
        vocab, positions = int(config.vocab_size), getattr(config, "max_position_embeddings", None)
        if vocab < text.vocab_size:
            raise ValueError(f"--model {spec}: its vocabulary of {vocab} is smaller than the tokenizer's "
                             f"({text.vocab_size}, --tokenizer {text.tokenizer})")
        if positions and seq_len > positions:
            raise ValueError(f"--seq-len {seq_len}: --model {spec} has {positions} positions")
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = PackedTransformer(text.vocab_size, 64, 4, stages, seq_len)
    name = f"{spec} on {data}"
    # Each epoch's partial last batch dropped: every batch is whole (one of fewer rows might not
    # cut into the microbatches and replicas). The shuffling is BatchStream's own generator,
    # seeded from (seed, epoch): not torch's global one, which the local runtime's rank threads
    # use while the prefetching thread opens the next epoch.
    stream = _Indexed(lambda: BatchStream(train, batch_size=batch, seed=seed, name=f"--data {data}", drop_last=True))
    held_out = None
    if held is not None:
        held_out = _Indexed(lambda: BatchStream(held, batch_size=batch, shuffle=False, drop_last=True,
                                                name=f"--data {data} (held out)"), one_epoch=True)
    inputs, targets = stream(0)
    return ModelSpec(spec, model, inputs, targets, packed_lm_loss, stream, stages, seed, held_out, train, batch,
                     drop_last=True,
                     about=f"{name}: {text.documents} documents, {text.tokens} tokens ({text.tokenizer} "
                              f"tokenizer, vocabulary {text.vocab_size}), {len(train)} rows of {seq_len}{held_note}")


def _load(spec: str, *, stages: int, seed: int = 0, batch_size: int | None = None) -> ModelSpec:
    """A built-in model name (``mlp``, ``transformer``, ``lm``), ``file.py:factory`` or
    ``hf:PATH`` (piper_train.hf) (``batch_size``: for a factory that returns a ``Dataset``, or
    the batches of a Hugging Face model)."""
    if is_hf(spec):
        return load_hf(spec, seed=seed, batch_size=batch_size)
    if spec in MODELS:
        if batch_size is not None:
            raise ValueError(f"model {spec!r}: a batch size (--batch-size) is for a factory that returns a Dataset; "
                             "a built-in model makes its own batches")
        return build_model(spec, stages=stages, seed=seed)
    if ":" in spec:
        return load_factory(spec, batch_size=batch_size, seed=seed)
    raise ValueError(f"unknown model {spec!r}; use one of {sorted(MODELS)}, 'path/to/file.py:factory' or "
                     "'hf:path/to/config-or-model-dir'")
