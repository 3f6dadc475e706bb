"""``piper train|check --data text:GLOB|hf:PATH --tokenizer tokenizer.json``: the built-in
``lm`` model on local text, tokenized by a tokenizer trained here with the tokenizers library
and packed with document boundaries kept (piper_train.text). A run stopped mid-epoch and
resumed from its checkpoint has an uninterrupted run's losses, bit for bit; the strategy with
data parallelism matches single-device training on the packed rows and their position ids."""

from __future__ import annotations

import json
import random

import pytest

from piper_train.cli import main

tokenizers = pytest.importorskip("tokenizers")  # piper-train[text]

WORDS = "the quick brown fox jumps over a lazy dog cat sat on mat and ran away from big red ball".split()


@pytest.fixture
def corpus(tmp_path):
    """12 documents of 20-90 words, one a file, and a WordLevel tokenizer trained on them."""
    from tokenizers import models, pre_tokenizers, trainers

    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 90))) + " ." for _ in range(12)]
    (tmp_path / "corpus").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "corpus" / f"doc{i:02d}.txt").write_text(doc + "\n")
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return tmp_path, sum(len(tok.encode(d).ids) for d in docs)


def test_text_trains_packed_and_resumes_mid_epoch_like_an_uninterrupted_run(corpus, capsys) -> None:
    root, tokens = corpus
    rows = (tokens - 1) // 16
    assert rows == 38  # 9 batches of 4 an epoch (2 rows left over, dropped); no held-out batch fills
    base = ["train", "--data", f"text:{root}/corpus/*.txt", "--tokenizer", str(root / "tokenizer.json"),
            "--seq-len", "16", "--batch-size", "4", "--pp", "2", "--microbatches", "2", "--json",
            "--no-progress-bar"]
    saving = [*base, "--checkpoint-dir", str(root / "ckpt"), "--checkpoint-every", "2"]
    runs = []
    for argv in ([*saving, "--steps", "5"], [*saving, "--steps", "13", "--resume"], [*base, "--steps", "13"]):
        assert main(argv) == 0
        out, err = capsys.readouterr()
        runs.append(json.loads(out))
    first, resumed, whole = runs
    assert (f"data: lm on text:{root}/corpus/*.txt: 12 documents, {tokens} tokens ({root / 'tokenizer.json'} "
            "tokenizer, vocabulary 22), 38 rows of 16, none held out (the last tenth, 3 rows, fills no batch of 4)") in err
    assert (first["steps"], resumed["first_step"], resumed["steps"], whole["epochs"]) == (5, 6, 8, 2)
    assert first["losses"] + resumed["losses"] == whole["losses"]  # bit for bit, across the epoch's end
    assert whole["losses"][0] < 3.2  # ln 22 = 3.09: the vocabulary is the tokenizer's


def test_check_on_packed_text_with_data_parallelism(corpus, capsys) -> None:
    root, _ = corpus
    argv = ["check", "--data", f"text:{root}/corpus/*.txt", "--tokenizer", str(root / "tokenizer.json"),
            "--seq-len", "16", "--batch-size", "8", "--pp", "2", "--dp", "2", "--microbatches", "2", "--steps", "2",
            "--precision", "fp64"]  # fp32 AdamW turns rounding noise into parameter differences (README)
    assert main(argv) == 0, capsys.readouterr().err
    assert "PASS" in capsys.readouterr().out
    pytest.importorskip("datasets")
    argv[2] = f"hf:{root / 'rows.jsonl'}"  # the same documents as a Hugging Face dataset
    assert main([*argv, "--zero", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "data: lm on hf:" in out and "12 documents" in out and "PASS" in out


def test_a_hugging_face_model_on_packed_text(corpus, capsys) -> None:
    """``--model hf:PATH`` takes the position ids as ``position_ids``: transformers masks
    attention per document from them (a document's logits packed are its logits alone), and
    the captured model, pipelined, matches the model run as it is on one device."""
    transformers = pytest.importorskip("transformers")  # piper-train[hf]
    import torch

    from piper_train.hf import logits_only

    root, _ = corpus
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64, num_hidden_layers=2)
    config.save_pretrained(root / "llama")
    torch.manual_seed(0)
    model = logits_only(transformers.AutoModelForCausalLM.from_config(config), packed=True).eval()
    a, b = torch.randint(0, 32, (5,)), torch.randint(0, 32, (7,))
    with torch.no_grad():
        packed = model(torch.cat([a, b])[None], torch.cat([torch.arange(5), torch.arange(7)])[None])
        torch.testing.assert_close(packed[:, 5:], model(b[None], torch.arange(7)[None]))
    base = ["check", "--model", f"hf:{root / 'llama'}", "--data", f"text:{root}/corpus/*.txt", "--seq-len", "16",
            "--batch-size", "8", "--pp", "2", "--microbatches", "2", "--steps", "2", "--precision", "fp64"]
    assert main([*base, "--tokenizer", str(root / "tokenizer.json")]) == 0, capsys.readouterr().err
    assert "PASS" in capsys.readouterr().out
    assert main(base) == 2  # bytes: 256 token ids
    assert "its vocabulary of 32 is smaller than the tokenizer's (256, --tokenizer bytes)" in capsys.readouterr().err
