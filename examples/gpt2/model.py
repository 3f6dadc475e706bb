"""A small GPT-2-style decoder, written the way nanoGPT writes one, ready for Piper.

Token and learned position embeddings, pre-LayerNorm blocks with causal
``scaled_dot_product_attention``, a GELU MLP, dropout 0.1 (embeddings, attention weights,
residual branches) and an LM head tied to the token embedding (``lm_head.weight`` *is*
``transformer.wte.weight``). One ``annotate("PP")`` region per block: the embeddings share
the first block's region, the final LayerNorm and the head the last block's, so the tied
weight is held by the first and the last region.

    piper train --model examples/gpt2/model.py:factory                     # fp32
    piper train --model examples/gpt2/model.py:factory --precision bf16    # bf16 compute, fp32 master
    piper train --model examples/gpt2/model.py:factory_bf16                # blocks under torch.autocast(bf16)
    piper check --model examples/gpt2/model.py:tiny --schedule dualpipev   # matches one device, dropout on

It trains on the Python standard library's own source, byte by byte (vocabulary 256).
What makes it capturable (compare nanoGPT): sizes are never unpacked into Python ints or
asserted on (``unflatten(-1, (heads, -1))`` instead of ``view(B, T, nh, C // nh)``, positions
from a buffer ``narrow``-ed to the sequence length), and the loss is a separate function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import annotate
from piper_train.data import ByteBatches, stdlib_corpus


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1
    bias: bool = True
    autocast: str | None = None  # a device type ("cpu", "cuda"): run each region under bf16 autocast


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
        # No bias on q/k/v, whatever config.bias says: a key bias cannot change attention
        # (softmax ignores a constant shift), so its gradient is pure rounding noise, which
        # Adam rescales into real updates that no two summation orders agree on.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, seq, 3 * embd) -> q, k, v of (batch, heads, seq, head size)
        q, k, v = self.c_attn(x).unflatten(-1, (3, self.n_head, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).flatten(2)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``tokens (batch, seq) int64 -> logits (batch, seq, vocab)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2 does
        self.register_buffer("positions", torch.arange(config.block_size), persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        last = len(t.h) - 1
        device_type = self.config.autocast or "cpu"
        x = idx
        for i, block in enumerate(t.h):  # i is a Python int: no data-dependent branch
            with annotate("PP"), torch.autocast(device_type, torch.bfloat16, enabled=self.config.autocast is not None):
                if i == 0:
                    pos = self.positions.narrow(0, 0, idx.size(1))
                    x = t.drop(t.wte(idx) + t.wpe(pos))
                x = block(x)
                if i == last:
                    x = self.lm_head(t.ln_f(x))
        return x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy, computed in fp32 at least whatever the logits' dtype
    (float64 logits, as under ``piper check --precision fp64``, stay float64)."""
    return F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)), targets.flatten())


def make(config: GPTConfig, batch: int = 16, seed: int = 0):
    """``(model, inputs, targets, loss_fn, batches)``: a fresh GPT and the byte batches of
    the standard library's source (``batches(step)``; batch 0 is the example)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    data = ByteBatches(stdlib_corpus(), batch, config.block_size, seed)
    inputs, targets = data(0)
    return model, inputs, targets, loss_fn, data


def factory():
    return make(GPTConfig())


def factory_bf16():
    """Each region under ``torch.autocast("cpu", dtype=torch.bfloat16)``: matmuls in bf16,
    LayerNorm, softmax and the loss in fp32, parameters fp32."""
    return make(GPTConfig(autocast="cpu"))


TINY = GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=32)


def tiny():
    """A tiny configuration for quick checks (four regions, 32 wide, 16 tokens, batch 8)."""
    return make(TINY, batch=8)
