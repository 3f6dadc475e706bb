"""Text data for the built-in language model: ``--data text:GLOB`` or ``--data hf:PATH`` with
``--tokenizer FILE|bytes`` (``piper_train.workload`` builds the model and its batches).

- **Sources.** ``text:GLOB``: the local files the pattern matches (``**`` matches folders at
  any depth), in sorted path order, each file one document. ``hf:PATH``: a Hugging Face
  ``datasets`` dataset read from local files (needs ``piper-train[text]``): a folder written
  by ``save_to_disk``, or a ``.parquet``, ``.jsonl``/``.json``, ``.csv``, ``.txt`` or
  ``.arrow`` file (or a folder of them; its ``train`` split where it has splits), each row
  of its ``text`` column (or of its only string column) one document. Nothing is fetched.
- **Tokenizers.** ``bytes``: a document's UTF-8 bytes are its tokens (vocabulary 256, no
  file); or a ``tokenizer.json`` as Hugging Face's ``tokenizers`` library saves it (loaded as
  data by ``Tokenizer.from_file``; the vocabulary is its size with added tokens; special
  tokens its post-processor adds, such as a BOS, are kept).
- **Packing** (``pack``). The documents' tokens are laid end to end and cut into rows of
  ``seq_len`` inputs, each row's targets the next ``seq_len`` tokens (rows overlap by one
  token, as ``ByteBatches``' windows do; the tokens left after the last whole row are
  dropped). Document boundaries are kept: besides the token ids, each row has **position
  ids** that restart at 0 at each document's first token and at the row's first token (a
  document continued from the previous row starts afresh: that row cannot see its
  beginning). The model (``PackedTransformer``) derives from them both its positional
  embedding and a block-diagonal causal mask: token i attends to token j only when j <= i
  and no document starts in (j, i]. The target of a document's last token (the next
  document's first token) is ``IGNORE`` (-100), so nothing is learnt across a boundary;
  ``packed_lm_loss`` leaves those targets out.
- **Order.** The packing is fixed by the files and the tokenizer; the rows are shuffled each
  epoch by ``BatchStream`` (a generator seeded from ``(--seed, epoch)``), and a checkpoint's
  data position (epoch, batch) resumes the stream exactly. Sharding by data-parallel rank is
  the runtime's: the driver draws the global batch and the runtime cuts it into microbatches
  and replica shards, each replica reading only its own rows.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

IGNORE = -100  # a target no loss counts (cross_entropy's ignore_index)
BYTES = "bytes"
ENCODE_CHUNK = 1024  # documents encoded at once
SOURCES = ("text", "hf")
DATASET_FILES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".txt": "text",
                 ".arrow": "arrow"}

Document = str | bytes


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, documents: Sequence[Document]) -> list[Sequence[int]]: ...


@attrs.frozen
class ByteTokenizer:
    """A document's UTF-8 bytes are its token ids."""

    name: str = BYTES
    vocab_size: int = 256

    def encode(self, documents: Sequence[Document]) -> list[Sequence[int]]:
        return [d if isinstance(d, bytes) else d.encode("utf-8") for d in documents]  # bytes: a sequence of ints


class FileTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer from its ``tokenizer.json``."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ValueError(f"--tokenizer {path}: the tokenizers package is not installed (pip install "
                             "'piper-train[text]')") from None
        if not path.is_file():
            raise ValueError(f"--tokenizer {path}: no such file (a tokenizer.json as the tokenizers library saves "
                             f"it, or '{BYTES}')")
        try:
            self.tokenizer = HFTokenizer.from_file(str(path))
        except Exception as err:  # the library's own error: not a tokenizer file
            raise ValueError(f"--tokenizer {path}: not a tokenizer file the tokenizers library reads: {err}") from None
        self.name = str(path)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, documents: Sequence[Document]) -> list[Sequence[int]]:
        texts = [d.decode("utf-8") if isinstance(d, bytes) else d for d in documents]
        ids: list[Sequence[int]] = []
        for at in range(0, len(texts), ENCODE_CHUNK):  # a chunk's encodings (offsets, ...) at a time
            ids.extend(e.ids for e in self.tokenizer.encode_batch(texts[at : at + ENCODE_CHUNK]))
        return ids


def load_tokenizer(spec: str | None) -> Tokenizer:
    """``bytes`` (also the default, ``None``) or a ``tokenizer.json`` file."""
    if spec is None or spec == BYTES:
        return ByteTokenizer()
    return FileTokenizer(Path(spec))


# -- documents -----------------------------------------------------------------------------------


def read_documents(spec: str, *, as_bytes: bool = False) -> list[Document]:
    """The documents of ``text:GLOB`` or ``hf:PATH`` (module doc); a text file's as its bytes
    where ``as_bytes`` (the byte tokenizer), else decoded as UTF-8."""
    kind, sep, where = spec.partition(":")
    if not sep or kind not in SOURCES or not where:
        raise ValueError(f"--data {spec!r}: expected text:GLOB (local text files) or hf:PATH (a Hugging Face "
                         "dataset in local files)")
    return _text_files(where, as_bytes) if kind == "text" else _hf_dataset(where)


def _text_files(pattern: str, as_bytes: bool) -> list[Document]:
    paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    if not paths:
        raise ValueError(f"--data text:{pattern}: no file matches")
    documents: list[Document] = []
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise ValueError(f"--data text:{pattern}: cannot read {path}: {err.strerror or err}") from None
        if not as_bytes:
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError as err:
                line = data.count(b"\n", 0, err.start) + 1
                raise ValueError(f"--data text:{pattern}: {path} is not UTF-8 text: byte 0x{data[err.start]:02x} at "
                                 f"line {line}") from None
        if data:
            documents.append(data)
    if not documents:
        raise ValueError(f"--data text:{pattern}: every file it matches is empty")
    return documents


def _hf_dataset(where: str) -> list[Document]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--data hf:{where}: the datasets package is not installed (pip install "
                         "'piper-train[text]')") from None
    path = Path(os.path.expanduser(where))
    what = f"--data hf:{where}"
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    # load_dataset converts the files into an Arrow cache: a folder of this call's, dropped once the
    # documents are read (nothing left in ~/.cache, nothing stale reused).
    with tempfile.TemporaryDirectory(prefix="piper-datasets-") as cache:
        try:
            return _read_dataset(datasets, path, what, cache)
        finally:
            if bars:
                datasets.enable_progress_bars()


def _read_dataset(datasets: Any, path: Path, what: str, cache: str) -> list[Document]:
    formats = ", ".join(sorted(DATASET_FILES))
    files: list[Path] = []
    saved = path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())
    if not path.exists():
        raise ValueError(f"{what}: no such file or folder")
    if not saved:
        if path.is_file() and path.suffix not in DATASET_FILES:
            raise ValueError(f"{what}: expected a dataset folder (save_to_disk) or a data file ({formats})")
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in DATASET_FILES)
        if not files or len({DATASET_FILES[p.suffix] for p in files}) != 1:
            found = "no data files" if not files else "files of several formats"
            raise ValueError(f"{what}: {found} ({formats}) in {path}")
    try:
        if saved:
            loaded: Any = datasets.load_from_disk(str(path))
        else:
            builder = DATASET_FILES[files[0].suffix]
            loaded = datasets.load_dataset(builder, data_files=[str(p) for p in files], cache_dir=cache)
    except Exception as err:  # the library's own error on a damaged or foreign file
        raise ValueError(f"{what}: datasets cannot read it: {type(err).__name__}: {err}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"{what}: no 'train' split (it has {', '.join(loaded)})")
        loaded = loaded["train"]
    strings = [name for name, feature in loaded.features.items()
               if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")]
    column = "text" if "text" in strings else strings[0] if len(strings) == 1 else None
    if column is None:
        raise ValueError(f"{what}: no 'text' column and not exactly one string column (columns: "
                         f"{', '.join(loaded.column_names)})")
    documents = [t for t in loaded[column] if t]
    if not documents:
        raise ValueError(f"{what}: its {column!r} column holds no text")
    return documents


# -- packing -------------------------------------------------------------------------------------


class PackedText(Dataset):
    """Rows of ``seq_len`` tokens packed from documents (module doc): item ``i`` is
    ``((tokens, positions), targets)``, each an int64 tensor of ``seq_len``."""

    def __init__(self, tokens: Tensor, starts: Tensor, seq_len: int, rows: range | None = None) -> None:
        self.tokens, self.starts, self.seq_len = tokens, starts, seq_len
        self.rows = rows if rows is not None else range(max(0, (len(tokens) - 1) // seq_len))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        at = self.rows[i] * self.seq_len
        window = self.tokens[at : at + self.seq_len + 1].long()
        starts = self.starts[at : at + self.seq_len + 1]
        targets = window[1:].masked_fill(starts[1:], IGNORE)
        return (window[:-1], positions(starts[:-1])), targets

    def split(self, fraction: float) -> tuple[PackedText, PackedText]:
        """The first rows and the last ``fraction`` of them (at least none)."""
        held = int(len(self.rows) * fraction)
        cut = len(self.rows) - held
        return (PackedText(self.tokens, self.starts, self.seq_len, self.rows[:cut]),
                PackedText(self.tokens, self.starts, self.seq_len, self.rows[cut:]))


def positions(starts: Tensor) -> Tensor:
    """Position ids of a row whose document starts are ``starts`` (bool, ``(seq,)`` or
    ``(..., seq)``): the offset from the latest start, the row's first token being one."""
    starts = starts.clone()
    starts[..., 0] = True
    index = torch.arange(starts.shape[-1]).expand_as(starts)
    latest = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - latest


def pack(documents: Sequence[Sequence[int]], seq_len: int) -> PackedText:
    """The documents' token ids end to end, cut into rows of ``seq_len`` (module doc)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    kept = [d for d in documents if len(d)]
    total = sum(len(d) for d in kept)
    if total < seq_len + 1:
        raise ValueError(f"the documents hold {total} tokens, fewer than one row of seq_len {seq_len} needs "
                         f"({seq_len + 1})")
    if all(isinstance(d, bytes | bytearray) for d in kept):  # bytes: 0-255 each
        tokens = torch.frombuffer(bytearray(b"".join(kept)), dtype=torch.uint8).to(torch.int32)  # type: ignore[arg-type]
    else:
        tokens = torch.cat([torch.as_tensor(d, dtype=torch.int64) for d in kept])
        if tokens.min() < 0 or tokens.max() >= 2**31:
            raise ValueError("token ids must be in [0, 2**31)")
        tokens = tokens.to(torch.int32)
    starts = torch.zeros(total, dtype=torch.bool)
    lengths = torch.tensor([len(d) for d in kept])
    starts[torch.cumsum(lengths, 0) - lengths] = True
    return PackedText(tokens, starts, seq_len)


def packed_lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross entropy summed over the targets that are not ``IGNORE``, divided by every target
    slot: a mean over a fixed count per sample, so microbatches' losses average to the batch's
    exactly (a mean over the counted targets alone would weigh microbatches by their counts)."""
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return total / targets.numel()


@attrs.frozen(eq=False)
class TextData:
    """What ``--data`` gave: the packed rows, the tokenizer's vocabulary, and counts to say."""

    packed: PackedText
    vocab_size: int
    documents: int
    tokens: int
    tokenizer: str


def load_text(spec: str, tokenizer: str | None, seq_len: int) -> TextData:
    """Read, tokenize and pack the documents of ``spec`` (module doc)."""
    tok = load_tokenizer(tokenizer)
    documents = read_documents(spec, as_bytes=isinstance(tok, ByteTokenizer))
    ids = tok.encode(documents)
    packed = pack(ids, seq_len)
    over = int(packed.tokens.max())
    if over >= tok.vocab_size:
        raise ValueError(f"--tokenizer {tok.name}: token id {over} is outside its vocabulary of {tok.vocab_size}")
    return TextData(packed, tok.vocab_size, len(documents), sum(len(d) for d in ids), tok.name)
