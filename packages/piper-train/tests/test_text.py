"""Text data (piper_train.text): documents read from files or a Hugging Face dataset,
tokenized (bytes, or a tokenizer.json trained here with the tokenizers library), packed into
rows with document boundaries kept (position ids, ignored targets), shuffled reproducibly and
resumed exactly; the model's block-diagonal attention; the loss over packed rows."""

from __future__ import annotations

import json

import pytest
import torch

from piper_train.batches import BatchStream
from piper_train.models import PackedTransformer, TinyTransformer
from piper_train.text import IGNORE, load_text, pack, packed_lm_loss, positions, read_documents
from piper_train.workload import load_workload


def _rows(packed):
    return [packed[i] for i in range(len(packed))]


def test_packing_keeps_document_boundaries() -> None:
    # Documents of 3, 5 and 4 tokens (13 tokens in all with a 1-token one); rows of 4.
    docs = [[10, 11, 12], [20, 21, 22, 23, 24], [30], [40, 41, 42, 43]]
    packed = pack(docs, 4)
    assert len(packed) == (13 - 1) // 4 == 3
    rows = _rows(packed)
    (tokens, pos), targets = rows[0]
    assert tokens.tolist() == [10, 11, 12, 20] and pos.tolist() == [0, 1, 2, 0]
    # 12 -> 20 crosses a boundary: ignored; 20 -> 21 (the next row's first token) is kept.
    assert targets.tolist() == [11, 12, IGNORE, 21]
    (tokens, pos), targets = rows[1]
    # The row starts inside document 2: positions restart with the row.
    assert tokens.tolist() == [21, 22, 23, 24] and pos.tolist() == [0, 1, 2, 3]
    assert targets.tolist() == [22, 23, 24, IGNORE]
    (tokens, pos), targets = rows[2]
    assert tokens.tolist() == [30, 40, 41, 42] and pos.tolist() == [0, 0, 1, 2]
    assert targets.tolist() == [IGNORE, 41, 42, 43]
    assert all(t.dtype == torch.int64 for (x, p), y in rows for t in (x, p, y))
    # The last token (43) only ever appears as a target; what is left after the last row is dropped.
    assert len(pack([[1] * 9], 4)) == 2
    with pytest.raises(ValueError, match="fewer than one row of seq_len 8 needs"):
        pack([[1, 2], [3]], 8)


def test_positions_restart_at_each_start_and_at_the_row() -> None:
    starts = torch.tensor([[False, False, True, False, True, True, False], [True] + [False] * 6])
    assert positions(starts).tolist() == [[0, 1, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
    assert not starts[0, 0]  # the argument is left as it is


def test_rows_are_shuffled_reproducibly_per_epoch_and_resume_exactly() -> None:
    packed = pack([list(range(i * 100, i * 100 + 36)) for i in range(5)], 8)  # 180 tokens: 22 rows
    assert len(packed) == 22

    def stream(seed: int) -> BatchStream:
        return BatchStream(packed, batch_size=4, seed=seed)

    def firsts(s: BatchStream, n: int) -> list[list[int]]:
        return [next(s)[0][0][:, 0].tolist() for _ in range(n)]

    whole = firsts(stream(3), 14)  # 6 batches an epoch (the last of 2 rows): into the third epoch
    assert whole == firsts(stream(3), 14) and whole != firsts(stream(4), 14)
    assert whole[:6] != whole[6:12]  # reshuffled each epoch
    assert sorted(r for batch in whole[:6] for r in batch) == sorted(packed[i][0][0][0].item() for i in range(22))
    resumed = stream(3)
    firsts(resumed, 8)
    state = resumed.state_dict()
    assert state == {"epoch": 1, "index": 2, "seed": 3}
    again = stream(3)
    again.load_state_dict(state)
    assert firsts(again, 6) == whole[8:]


def test_text_files_with_bytes_and_errors(tmp_path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_bytes("héllo\n".encode())
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "empty.txt").write_text("")
    docs = read_documents(f"text:{tmp_path}/**/*.txt", as_bytes=True)
    assert docs == [b"first document\n", "héllo\n".encode()]  # sorted paths, the empty file left out
    text = load_text(f"text:{tmp_path}/**/*.txt", "bytes", seq_len=4)
    assert (text.vocab_size, text.documents, text.tokens) == (256, 2, 15 + 7)
    assert bytes(text.packed.tokens.tolist()) == b"first document\nh\xc3\xa9llo\n"
    (tmp_path / "bad.txt").write_bytes(b"ok\n\xff")
    with pytest.raises(ValueError, match=r"bad.txt is not UTF-8 text: byte 0xff at line 2"):
        read_documents(f"text:{tmp_path}/*.txt")
    for spec, message in [(f"text:{tmp_path}/*.md", "no file matches"), (f"text:{tmp_path}/empty.txt", "is empty"),
                          ("parquet:x", "expected text:GLOB"), ("text:", "expected text:GLOB")]:
        with pytest.raises(ValueError, match=message):
            read_documents(spec)


def _tokenizer(tmp_path, texts: list[str]):
    tokenizers = pytest.importorskip("tokenizers")  # piper-train[text]
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, path


def test_a_tokenizer_file_tokenizes_each_document(tmp_path) -> None:
    texts = ["the cat sat on the mat", "a dog ran", "the dog sat on a cat and the mat"]
    tok, path = _tokenizer(tmp_path, texts)
    for i, t in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(t)
    text = load_text(f"text:{tmp_path}/doc*.txt", str(path), seq_len=5)
    ids = [tok.encode(t).ids for t in texts]
    assert text.vocab_size == tok.get_vocab_size() == 10 and text.tokenizer == str(path)
    assert text.packed.tokens.tolist() == [i for d in ids for i in d]
    assert text.packed.starts.nonzero().flatten().tolist() == [0, 6, 9]
    (bad := tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizer file the tokenizers library reads"):
        load_text(f"text:{tmp_path}/doc*.txt", str(bad), seq_len=5)
    with pytest.raises(ValueError, match="no such file"):
        load_text(f"text:{tmp_path}/doc*.txt", str(tmp_path / "missing.json"), seq_len=5)


def test_attention_and_positions_keep_documents_apart() -> None:
    """Each document's logits in a packed row are its logits alone: nothing crosses a boundary."""
    torch.manual_seed(0)
    model = PackedTransformer(50, 32, 4, 2, 16).eval()
    docs = [torch.randint(0, 50, (n,)) for n in (5, 7, 4)]
    tokens = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(tokens, pos)
        at = 0
        for d in docs:
            alone = model(d[None], torch.arange(len(d))[None])
            torch.testing.assert_close(packed[:, at : at + len(d)], alone, rtol=1e-5, atol=1e-6)
            at += len(d)
        # One document over the whole row is the plain causal model's (same weights).
        plain = TinyTransformer(50, 32, 4, 2, 16).eval()
        plain.load_state_dict(model.state_dict())
        torch.testing.assert_close(model(tokens, torch.arange(16)[None]), plain(tokens))


def test_the_loss_ignores_boundary_targets_and_averages_over_microbatches() -> None:
    logits = torch.randn(4, 6, 10, dtype=torch.float64)
    targets = torch.randint(0, 10, (4, 6))
    targets[0, 2] = targets[3, 5] = targets[1, 0] = IGNORE
    keep = targets != IGNORE
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum") / 24
    torch.testing.assert_close(packed_lm_loss(logits, targets), expected)
    halves = [packed_lm_loss(logits[i : i + 2], targets[i : i + 2]) for i in (0, 2)]
    torch.testing.assert_close((halves[0] + halves[1]) / 2, expected)


def test_the_lm_model_on_text_data(tmp_path) -> None:
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text(f"document {i}: " + "abcdefgh" * (10 + i))
    spec = load_workload("lm", stages=3, data=f"text:{tmp_path}/*.txt", seq_len=16, batch_size=2, seed=1)
    assert isinstance(spec.model, PackedTransformer) and len(spec.model.blocks) == 3
    assert spec.model.head.out.out_features == 256
    assert [t.shape for t in (*spec.example_inputs, *spec.example_targets)] == [(2, 16)] * 3
    # 416 bytes: 25 rows of 16, the last 2 held out (a whole batch of 2).
    assert len(spec.data) == 23 and spec.eval_batches is not None and (spec.batch_size, spec.drop_last) == (2, True)
    assert spec.stream().batches_per_epoch == 11  # the partial last batch is dropped
    assert "4 documents, 416 tokens (bytes tokenizer, vocabulary 256), 23 rows of 16, the last 2 held out" in spec.about
    assert torch.equal(spec.stream().__next__()[0][0], spec.example_inputs[0])
    held = spec.eval_batches(0)[0][0]
    assert torch.equal(held[0], spec.data.tokens[23 * 16 : 24 * 16].long())  # in order
    with pytest.raises(ValueError, match="--tokenizer is for text data"):
        load_workload("lm", stages=2, tokenizer="bytes")
    with pytest.raises(ValueError, match="--data trains the built-in model 'lm'"):
        load_workload("mlp", stages=2, data=f"text:{tmp_path}/*.txt")


def test_a_hugging_face_dataset_from_local_files(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")  # piper-train[text]
    rows = [{"id": i, "text": f"row {i} " * (i + 1)} for i in range(6)]
    texts = [r["text"] for r in rows]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "folder").mkdir()
    datasets.Dataset.from_list([{"body": t, "n": 1} for t in texts]).to_parquet(str(tmp_path / "folder" / "a.parquet"))
    for where in ("saved", "rows.jsonl", "folder"):  # a save_to_disk folder, a file, a folder of files
        assert read_documents(f"hf:{tmp_path / where}") == texts  # "text", or the only string column
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "splits"))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "mixed" / "b.csv").write_text("text\ny\n")
    (tmp_path / "damaged.parquet").write_bytes(b"not parquet")
    (tmp_path / "two").mkdir()
    datasets.Dataset.from_list([{"a": "x", "b": "y"}]).to_parquet(str(tmp_path / "two" / "t.parquet"))
    for where, message in [("splits", "no 'train' split"), ("two", "no 'text' column and not exactly one string"),
                           ("missing", "no such file or folder"), ("two/t.parquet", "no 'text' column"),
                           ("mixed", "files of several formats"), ("damaged.parquet", "datasets cannot read it")]:
        with pytest.raises(ValueError, match=message):
            read_documents(f"hf:{tmp_path / where}")
