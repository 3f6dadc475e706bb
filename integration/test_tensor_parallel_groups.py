"""Tensor parallelism of LLaMA-family blocks captured by torch.export (issue 37, item 1): column
groups (q/k/v -> attention -> o, w1 and w3 -> silu(w1 x) * w3 x -> w2) split by attention heads,
grouped-query key/value heads split when the degree divides them and replicated (each rank
narrowing to its query heads' ones) otherwise, rotary embedding per local head.

The oracle is ``run_check`` (``piper check``) in float64 against one device, 2 AdamW steps:
examples/llama (4 query heads, 2 kv heads, SwiGLU, tied embedding/head cut by vocabulary) under TP=2
and PP=2 x TP=2 (1F1B), multi-query (1 kv head) under TP=2, 2 kv heads under TP=4 (ranks 0, 1 on
kv head 0, ranks 2, 3 on head 1), and Hugging Face Llama and Qwen3 (per-head q/k norms)
built from saved configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from piper_directives import build_schedule, tensor_parallel
from piper_runtime import OptimizerSpec
from piper_train.check import TOLERANCES, run_check
from piper_train.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = f"{ROOT / 'examples' / 'llama' / 'model.py'}:tiny"
VARIANTS = ROOT / "integration" / "fixtures" / "llama_variants.py"
pytestmark = pytest.mark.usefixtures("ray_cluster")


def _check(runtime: str, spec: str, *, pp: int = 1, tp: int = 2, stages: int | None = None,
           plan: dict[str, str] | None = None) -> set[str]:
    """``piper check --precision fp64`` (2 AdamW steps, 2 microbatches); the names of the
    parameters cut. ``runtime``: the fixture's (``RunOptions``' default is read at import)."""
    workload = load_workload(spec, stages=stages or 1)
    strategy = tensor_parallel(build_schedule("1f1b", pp, 2, stages=stages), tp, plan=plan)
    rtol, atol = TOLERANCES["fp64"]
    report = run_check(workload, strategy, steps=2, optimizer=OptimizerSpec("adamw", 1e-3), rtol=rtol, atol=atol,
                       precision="fp64", runtime=runtime)
    assert report.ok, report.failures()
    worst = max(report.worst(w).rel for w in ("grad", "param"))
    assert worst < 1e-12, worst
    print(f"{spec} pp={pp} tp={tp}: largest relative difference {worst:.3e}")
    return {p.name for sh in report.program.sharding for p in sh.params}


def test_llama_example_tp2_shards_heads_and_swiglu(runtime):
    cut = _check(runtime, EXAMPLE, stages=4)
    for layer in range(4):
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                     "feed_forward.w2", "feed_forward.w3"):
            assert f"layers.{layer}.{name}.weight" in cut
    assert {"tok_embeddings.weight", "output.weight"} <= cut  # the tied head: by vocabulary (test_vocab_parallel)


def test_llama_example_pp2_tp2_1f1b(runtime):
    cut = _check(runtime, EXAMPLE, pp=2, stages=4)
    assert "layers.3.attention.wk.weight" in cut


def test_multi_query_attention_replicates_the_kv_head(runtime):
    cut = _check(runtime, f"{VARIANTS}:mqa", stages=2)
    assert "layers.0.attention.wq.weight" in cut and "layers.0.attention.wk.weight" not in cut


def test_two_kv_heads_on_four_ranks(runtime):
    cut = _check(runtime, f"{VARIANTS}:gqa2", tp=4, stages=2)
    assert "layers.1.attention.wo.weight" in cut and "layers.1.attention.wv.weight" not in cut


def test_hugging_face_llama_tp2(runtime, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64, num_hidden_layers=4,
                             tie_word_embeddings=True).save_pretrained(tmp_path)
    cut = _check(runtime, f"hf:{tmp_path}", stages=4)
    assert {"model.layers.0.self_attn.k_proj.weight", "model.layers.3.mlp.down_proj.weight"} <= cut
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= cut  # tied, cut by vocabulary (shard_vocab)


def test_hugging_face_qwen3_sums_the_per_head_norm_gradients(runtime, tmp_path):
    """Qwen3's q/k norms (over each head's features, one weight shared by all heads) sit between
    the columns and the row: each rank's gradient of their weights comes from its heads only,
    so the rewrite reads them through ``f`` (summed over the group in backward)."""
    transformers = pytest.importorskip("transformers")
    transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64, num_hidden_layers=2,
                             head_dim=8).save_pretrained(tmp_path)
    cut = _check(runtime, f"hf:{tmp_path}", stages=2)
    assert "model.layers.1.self_attn.q_proj.weight" in cut and "model.layers.1.self_attn.q_norm.weight" not in cut


def test_a_plan_by_module_path_shards_only_the_attention(runtime):
    """``tensor_parallel(..., plan=)``: the attention's Linears named, the SwiGLU left whole."""
    plan = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
            "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise"}
    cut = _check(runtime, EXAMPLE, pp=2, stages=4, plan=plan)
    assert "layers.2.attention.wo.weight" in cut and not any("feed_forward" in n for n in cut)
