"""Hugging Face models with no user code (issue 36): ``--model hf:DIR`` for Llama, GPT-2,
Qwen3 and Mixtral configurations built offline, captured through torch.export with one region
per layer, matching single-device training under pipeline schedules and data parallelism.
Also a LLaMA-family model written as its authors write it (examples/llama), unedited."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama" / "model.py"
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def _configs(layers: int) -> dict[str, object]:
    return {
        "llama": transformers.LlamaConfig(**SMALL, num_hidden_layers=layers, tie_word_embeddings=True),
        "gpt2": transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=layers, n_head=4, n_positions=64),
        "qwen3": transformers.Qwen3Config(**SMALL, num_hidden_layers=layers, head_dim=8),
        "mixtral": transformers.MixtralConfig(**SMALL, num_hidden_layers=layers, num_local_experts=4,
                                              num_experts_per_tok=2),
    }


def _saved(tmp_path: Path, family: str, layers: int = 2, weights: bool = False) -> Path:
    config = _configs(layers)[family]
    folder = tmp_path / family
    if weights:
        torch.manual_seed(7)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder


def _check(piper, *args: str, microbatches: int = 2) -> dict:
    """``piper check`` in float64, where any difference above 1e-10 is a real one (in fp32
    AdamW turns the rounding of near-zero gradients, such as an embedding's unused rows, into
    differences of 1e-5)."""
    done = piper("check", *args, "--steps", "2", "--microbatches", str(microbatches), "--precision", "fp64", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"], summary
    assert "with export" in done.stderr and "regions by module path (default: one per layer)" in done.stderr
    return summary


@pytest.mark.parametrize("family, schedule", [("gpt2", "1f1b"), ("qwen3", "zb1p"), ("mixtral", "gpipe")])
def test_a_hugging_face_model_matches_one_device_under_a_pipeline(piper, tmp_path, family, schedule):
    """GPT-2 with its dropout on (0.1: the masks equal one device's), Qwen3 (q/k norms, GQA)
    under the zero-bubble split backward, Mixtral's routed experts."""
    _check(piper, "--model", f"hf:{_saved(tmp_path, family)}", "--schedule", schedule, "--pp", "2")


def test_llama_trains_and_checks_under_dualpipev_from_a_config_file(piper, tmp_path):
    """The done-when: ``piper train --model hf:<tiny llama config> --pp 2 --schedule dualpipev``
    trains with no user code (four layers: DualPipeV's four stages), and check passes."""
    config = _saved(tmp_path, "llama", layers=4) / "config.json"
    done = piper("train", "--model", f"hf:{config}", "--schedule", "dualpipev", "--pp", "2", "--steps", "3",
                 "--microbatches", "4", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    losses = json.loads(done.stdout)["losses"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert "model.layers.0 | model.layers.1 | model.layers.2 | model.layers.3" in done.stderr
    _check(piper, "--model", f"hf:{config}", "--schedule", "dualpipev", "--pp", "2", microbatches=4)


def test_gpt2_with_dropout_matches_under_dp2_zero3_in_fp64(piper, tmp_path):
    summary = _check(piper, "--model", f"hf:{_saved(tmp_path, 'gpt2')}", "--schedule", "1f1b", "--pp", "1",
                     "--dp", "2", "--zero", "3")
    assert max(summary[f"max_{w}_rel"] for w in ("loss", "grad", "param")) < 1e-12, summary


def test_safetensors_weights_in_the_directory_are_the_ones_trained(tmp_path):
    """A model directory with weights (save_pretrained): the first loss is the one the model
    itself computes with those weights on the first batch."""
    from piper_train.hf import causal_lm_loss
    from piper_train.workload import load_workload

    folder = _saved(tmp_path, "llama", weights=True)
    spec = load_workload(f"hf:{folder}", stages=0, seed=3)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    (ids,), (targets,) = spec.batches(0)
    with torch.no_grad():
        want = causal_lm_loss(reference(input_ids=ids, use_cache=False).logits, targets)
        got = spec.loss_fn(spec.model(ids), targets)
    assert torch.equal(got, want)
    assert torch.equal(spec.model.lm_head.weight, reference.lm_head.weight)


def test_pickled_weights_are_refused(piper, tmp_path):
    folder = _saved(tmp_path, "gpt2")
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    done = piper("train", "--model", f"hf:{folder}", "--steps", "1")
    assert done.returncode == 2 and "pickles" in done.stderr and "safetensors" in done.stderr


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_llama_as_its_authors_write_it_matches_one_device(piper, schedule):
    """examples/llama slices its rotary tables by the sequence length (fx cannot trace that) and
    never calls annotate: captured by export, one region per layer, no edit."""
    _check(piper, "--model", f"{EXAMPLE}:tiny", "--schedule", schedule, "--pp", "2", microbatches=4)


def test_export_as_a_hugging_face_folder_loads_with_equal_logits(piper, tmp_path):
    """``piper export --format hf``: the trained weights as a folder ``from_pretrained`` loads,
    whose logits equal those of the checkpoint's own state_dict (Piper's trained model)."""
    from piper_train.checkpoints import model_state_dict
    from piper_train.workload import load_workload

    folder = _saved(tmp_path, "llama")
    done = piper("train", "--model", f"hf:{folder}", "--pp", "2", "--steps", "2", "--microbatches", "2",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "exported"
    done = piper("export", str(tmp_path / "ckpt"), "--format", "hf", "--model", f"hf:{folder}", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    trained = load_workload(f"hf:{folder}", stages=0).model  # the run's initial weights (seed 0) ...
    initial = trained.model.layers[0].mlp.up_proj.weight.detach().clone()
    trained.load_state_dict(model_state_dict(tmp_path / "ckpt"))  # ... then the trained ones
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, use_cache=False).logits, trained(ids))
    assert not torch.equal(loaded.model.layers[0].mlp.up_proj.weight, initial)  # trained, not initial
    again = piper("export", str(tmp_path / "ckpt"), "--format", "hf", "--model", f"hf:{folder}", "--out", str(out))
    assert again.returncode == 2 and "exists" in again.stderr


def test_init_from_a_sharded_hugging_face_folder(piper, tmp_path):
    """``--init-from DIR``: the weights of a sharded ``save_pretrained`` folder (several files
    and their index) start a model built from a config alone; the first loss is the one that
    model computes itself."""
    from piper_train.hf import causal_lm_loss
    from piper_train.workload import load_workload

    config = _saved(tmp_path, "llama") / "config.json"
    torch.manual_seed(11)
    source = transformers.AutoModelForCausalLM.from_config(_configs(2)["llama"])
    source.save_pretrained(tmp_path / "weights", max_shard_size="20KB")
    assert len(list((tmp_path / "weights").glob("*.safetensors"))) > 1
    done = piper("train", "--model", f"hf:{config}", "--init-from", str(tmp_path / "weights"), "--pp", "2",
                 "--steps", "1", "--microbatches", "2", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    (ids,), (targets,) = load_workload(f"hf:{config}", stages=0).batches(0)
    with torch.no_grad():
        want = float(causal_lm_loss(source(input_ids=ids, use_cache=False).logits, targets))
    assert json.loads(done.stdout)["losses"][0] == pytest.approx(want, rel=1e-6)
    assert "initial weights: " in done.stderr


@pytest.mark.ray
def test_an_exported_model_runs_on_ray_workers(piper, tmp_path):
    """Segments captured by torch.export travel to Ray actors (their operators by name)."""
    summary = _check(piper, "--model", f"hf:{_saved(tmp_path, 'llama')}", "--schedule", "1f1b", "--pp", "2",
                     "--runtime", "ray")
    assert max(summary[f"max_{w}_rel"] for w in ("loss", "grad", "param")) < 1e-12, summary
