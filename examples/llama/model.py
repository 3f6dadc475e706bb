"""A small LLaMA-family decoder, written the way its authors write one, with no edit for Piper.

RMSNorm, rotary position embeddings whose cos/sin tables are non-persistent buffers sliced by
the sequence length (``self.cos[:t]`` with ``t`` from ``x.shape``), grouped-query attention
(fewer key/value heads than query heads), a SwiGLU feed-forward (``w2(silu(w1 x) * w3 x)``)
and an output head tied to the token embedding. Nothing in it mentions Piper: ``forward`` has
no ``annotate``, and sizes are unpacked into Python ints as usual.

torch.fx cannot trace it (slicing by a traced size); Piper captures it through torch.export,
and with no regions named takes one region per entry of ``layers`` (the embedding joins the
first, the final norm and the head the last):

    piper check --model examples/llama/model.py:tiny --schedule 1f1b --pp 2
    piper check --model examples/llama/model.py:tiny --schedule dualpipev --pp 2
    piper train --model examples/llama/model.py:factory --regions "tok_embeddings | layers.* | norm, output"

It trains on the Python standard library's own source, byte by byte (vocabulary 256).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from piper_train.data import ByteBatches, stdlib_corpus


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, end: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (bsz, seqlen, heads, head_dim); rotate interleaved pairs
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary(xq, cos, sin), apply_rotary(xk, cos, sin)
        xk = xk.repeat_interleave(self.n_rep, dim=2)
        xv = xv.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, multiple_of: int) -> None:
        super().__init__()
        hidden = int(2 * (4 * dim) / 3)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.multiple_of)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied
        nn.init.normal_(self.tok_embeddings.weight, std=args.dim**-0.5)
        cos, sin = rotary_tables(args.dim // args.n_heads, args.max_seq_len * 2, args.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        cos, sin = self.cos[:seqlen], self.sin[:seqlen]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy (float64 logits, as under ``piper check --precision fp64``,
    stay float64)."""
    return F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)), targets.flatten())


def make(args: ModelArgs, batch: int = 16, seq_len: int = 64, seed: int = 0):
    """``(model, inputs, targets, loss_fn, batches)``: a fresh model and the byte batches of
    the standard library's source (``batches(step)``; batch 0 is the example)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(args)
    data = ByteBatches(stdlib_corpus(), batch, seq_len, seed)
    inputs, targets = data(0)
    return model, inputs, targets, loss_fn, data


def factory():
    return make(ModelArgs())


def tiny():
    """A tiny configuration for quick checks (four layers, 32 wide, 16 tokens, batch 8)."""
    return make(ModelArgs(dim=32, n_heads=4, n_kv_heads=2, max_seq_len=16), batch=8, seq_len=16)
