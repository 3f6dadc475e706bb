"""Example models for tests and benchmarks, written the way a Piper user writes one.

Every operation of ``forward`` sits inside an ``annotate("PP")`` region (compute outside an
annotation is a capture error). One region is one pipeline-stage candidate, so a model built
with ``stages=k`` has k regions. Forward passes take tensors positionally, return one tensor
and contain no data-dependent Python control flow, so ``torch.fx.symbolic_trace`` works.

``stage_modules(pp)`` cuts the same model into ``pp`` plain ``nn.Module``s along the region
boundaries (sharing its parameters), for baselines such as ``torch.distributed.pipelining``
that need hand-split stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from piper_train.data import ByteBatches, stdlib_corpus


def _annotate(name: str):  # a context manager from piper_directives
    # Imported when forward runs, not when this module is imported, so the hand-split
    # stage modules (and benchmarks using them) work without piper-directives installed.
    from piper_directives import annotate

    return annotate(name)


def _group(regions: list[nn.Module], pp: int) -> list[nn.Module]:
    """Cut ``regions`` into ``pp`` contiguous, balanced groups, each one ``nn.Sequential``."""
    if not 1 <= pp <= len(regions):
        raise ValueError(f"cannot split {len(regions)} annotated regions into {pp} stages")
    base, extra = divmod(len(regions), pp)
    out, start = [], 0
    for i in range(pp):
        size = base + (1 if i < extra else 0)  # earlier stages take the remainder
        out.append(nn.Sequential(*regions[start : start + size]))
        start += size
    return out


class MLP(nn.Module):
    """``n_stages`` regions of Linear+Tanh; the last region ends with a Linear to ``d_out``."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, n_stages: int) -> None:
        super().__init__()
        if n_stages < 1:
            raise ValueError(f"n_stages must be >= 1, got {n_stages}")
        blocks = []
        for i in range(n_stages):
            layers: list[nn.Module] = [nn.Linear(d_in if i == 0 else d_hidden, d_hidden), nn.Tanh()]
            if i == n_stages - 1:
                layers.append(nn.Linear(d_hidden, d_out))
            blocks.append(nn.Sequential(*layers))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            with _annotate("PP"):
                x = block(x)
        return x

    def stage_modules(self, pp: int) -> list[nn.Module]:
        return _group(list(self.blocks), pp)


class ResidualStack(nn.Module):
    """``n_blocks`` residual MLP blocks (``x + W2 gelu(W1 x)``) grouped into ``regions``
    annotated regions: a model whose step is dominated by matrix products, so per-step
    fixed costs of a pipeline runtime show against real compute."""

    def __init__(self, d_model: int, d_hidden: int, n_blocks: int, regions: int) -> None:
        super().__init__()
        if not 1 <= regions <= n_blocks:
            raise ValueError(f"cannot group {n_blocks} blocks into {regions} regions")
        blocks = [
            nn.Sequential(nn.Linear(d_model, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_model))
            for _ in range(n_blocks)
        ]
        self.regions = nn.ModuleList(_Residuals(list(g)) for g in _group(blocks, regions))

    def forward(self, x: Tensor) -> Tensor:
        for region in self.regions:
            with _annotate("PP"):
                x = region(x)
        return x

    def stage_modules(self, pp: int) -> list[nn.Module]:
        return _group(list(self.regions), pp)


class _Residuals(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.group = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.group:
            x = x + block(x)
        return x


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, seq_len: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        # No bias: a key bias cannot change attention (softmax is shift-invariant), so its
        # gradient is pure rounding noise that Adam would amplify into real updates.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        # True above the diagonal: position t may not attend to later positions. A buffer
        # (not a Python branch) keeps the mask traceable and moves with the module.
        self.register_buffer("mask", torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        t = x.size(1)
        # -1, not n_heads: the head axis is what tensor parallelism (Shard) splits, so the
        # same code runs on a shard of the heads (the convention shard_modules relies on).
        q, k, v = self.qkv(x).unflatten(-1, (3, -1, self.d_head)).permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.d_head))
        # narrow, not mask[:t, :t]: fx cannot trace a slice whose bound is a traced size.
        mask = self.mask.narrow(0, 0, t).narrow(1, 0, t)
        if positions is not None:  # packed documents (piper_train.text): none attends to another
            mask = mask | _other_documents(positions).unsqueeze(1)
        scores = scores.masked_fill(mask, float("-inf"))
        out = scores.softmax(dim=-1) @ v  # (batch, heads, seq, d_head)
        return self.proj(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: attention then a 4x MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, seq_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln1(x), positions)
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    """Token embedding plus a learned positional embedding."""

    def __init__(self, vocab: int, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        if positions is not None:  # each token's position in its document
            return self.tok(tokens) + F.embedding(positions, self.pos)
        return self.tok(tokens) + self.pos.narrow(0, 0, tokens.size(1))


class Head(nn.Module):
    """Final LayerNorm and the language-model head (logits over the vocabulary)."""

    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.ln(x))


class TinyTransformer(nn.Module):
    """A byte-level causal LM: ``tokens (batch, seq) int64 -> logits (batch, seq, vocab)``.

    One ``annotate("PP")`` region per block; the embeddings share the first block's region
    and the final LayerNorm and head share the last block's.
    """

    def __init__(
        self, vocab: int, d_model: int = 64, n_heads: int = 4, n_layers: int = 2, seq_len: int = 64
    ) -> None:
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self.embed = Embed(vocab, d_model, seq_len)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, seq_len) for _ in range(n_layers))
        self.head = Head(vocab, d_model)
        self.apply(_init_weights)

    def forward(self, tokens: Tensor) -> Tensor:
        x = tokens
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):  # i is a Python int: no data-dependent branch
            with _annotate("PP"):
                if i == 0:
                    x = self.embed(x)
                x = block(x)
                if i == last:
                    x = self.head(x)
        return x

    def stage_modules(self, pp: int) -> list[nn.Module]:
        regions: list[nn.Module] = list(self.blocks)
        regions[0] = nn.Sequential(self.embed, regions[0])
        regions[-1] = nn.Sequential(regions[-1], self.head)
        return _group(regions, pp)


class PackedTransformer(TinyTransformer):
    """``TinyTransformer`` on rows packed from several documents (``piper_train.text``):
    ``(tokens, positions) -> logits``, where ``positions`` (int64, like ``tokens``) restart at 0
    at each document's first token (and at the row's). Each token's positional embedding is
    that of its position in its document, and attention is block-diagonal causal: token i
    attends to token j only when j <= i and no position between them (j exclusive) is 0.
    Every block computes that mask from ``positions``, which each stage receives with the
    batch, so no mask travels between stages.
    """

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x = tokens
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            with _annotate("PP"):
                if i == 0:
                    x = self.embed(x, positions)
                x = block(x, positions)
                if i == last:
                    x = self.head(x)
        return x


def _other_documents(positions: Tensor) -> Tensor:
    """``(batch, seq, seq)``, True where token j is in another document than token i (a
    document starts where its position is 0)."""
    document = (positions == 0).cumsum(-1)
    return document.unsqueeze(-1) != document.unsqueeze(-2)


class Experts(nn.Module):
    """``num_experts`` small MLPs with stacked weights (leading dimension = expert).

    The convention an expert module follows to be expert-sharded (``Shard(kind="ep")``):
    ``piper_experts = True``; ``forward(tokens (n, d), expert_ids (n,))`` returns ``(n, d_out)``,
    token ``i`` processed by expert ``expert_ids[i]``, with no other data mixed in; every
    parameter has the experts on dimension 0. Capture keeps such a module as one call, and
    the EP rewrite feeds it only the tokens routed to this rank's experts, with local ids.
    """

    piper_experts = True

    def __init__(self, num_experts: int, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, d_model, d_hidden) / math.sqrt(d_model))
        self.b1 = nn.Parameter(torch.zeros(num_experts, d_hidden))
        self.w2 = nn.Parameter(torch.randn(num_experts, d_hidden, d_model) / math.sqrt(d_hidden))

    def forward(self, tokens: Tensor, expert_ids: Tensor) -> Tensor:
        # Each token meets its expert's weights (gathered per token): no Python loop over
        # experts, so fx traces it and a shard with fewer experts runs the same code.
        h = torch.bmm(tokens.unsqueeze(1), self.w1[expert_ids]).squeeze(1) + self.b1[expert_ids]
        return torch.bmm(F.gelu(h).unsqueeze(1), self.w2[expert_ids]).squeeze(1)


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer: a router picks the top-``k`` of
    ``num_experts`` experts per token (softmax gates over the chosen logits), tokens are
    sorted by expert and processed by ``Experts``, and the gated results are summed back per
    token; an optional shared expert (a plain MLP) sees every token."""

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, k: int, shared: bool) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"top-k must be in 1..{num_experts}, got {k}")
        self.k = k
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = Experts(num_experts, d_model, d_hidden)
        self.shared = (
            nn.Sequential(nn.Linear(d_model, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_model)) if shared else None
        )

    def forward(self, x: Tensor) -> Tensor:
        flat = x.flatten(0, -2)  # (tokens, d)
        top, chosen = self.router(flat).topk(self.k, dim=-1)  # (tokens, k)
        gates = torch.softmax(top, dim=-1).flatten()
        ids = chosen.flatten()  # (tokens * k,): token t's j-th choice at t * k + j
        order = torch.argsort(ids, stable=True)  # dispatch order: sorted by expert
        token = torch.div(order, self.k, rounding_mode="floor")
        out = self.experts(flat[token], ids[order]) * gates[order].unsqueeze(-1)
        y = torch.zeros_like(flat).index_add(0, token, out)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view_as(x)


class MoEModel(nn.Module):
    """``(batch, d_in) -> (batch, d_out)`` regression through ``n_stages`` regions, each an
    input (or previous) projection plus a residual ``MoE`` layer; one region per stage."""

    def __init__(
        self, d_in: int, d_model: int, d_out: int, n_stages: int, num_experts: int = 4, k: int = 2, shared: bool = True
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "proj": nn.Linear(d_in if i == 0 else d_model, d_model),
                    "moe": MoE(d_model, 2 * d_model, num_experts, k, shared),
                }
            )
            for i in range(n_stages)
        )
        self.out = nn.Linear(d_model, d_out)

    def forward(self, x: Tensor) -> Tensor:
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            with _annotate("PP"):
                h = torch.tanh(block["proj"](x))
                x = h + block["moe"](h)
                if i == last:
                    x = self.out(x)
        return x


def _init_weights(module: nn.Module) -> None:
    # Small (GPT-2 style) initial weights make the initial logits nearly uniform, so the
    # first loss is close to ln(vocab).
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, Embed):
        nn.init.normal_(module.pos, std=0.02)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy over every token: ``logits (b, s, v)``, ``targets (b, s)``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


Batch = tuple[tuple[Tensor, ...], tuple[Tensor, ...]]
LossFn = Callable[[Tensor, Tensor], Tensor]
# model, loss, training batches by step, held-out batches by index
Built = tuple[nn.Module, LossFn, Callable[[int], Batch], Callable[[int], Batch]]


@attrs.frozen(eq=False)
class ModelSpec:
    """A model with its data and loss: everything a trainer or benchmark needs.

    ``batches(step)`` returns ``(inputs, targets)``, deterministic in ``(seed, step)``;
    ``example_inputs`` / ``example_targets`` are ``batches(0)``. ``eval_batches(k)`` is the
    k-th held-out batch (data no training step sees), ``None`` when the model has none.
    ``data``: the training source a factory returned (a ``Dataset``, ``DataLoader`` or
    iterable of batches; ``None``: ``batches`` is the source), batched by ``batch_size``
    where it is a ``Dataset``. ``stream()`` is the training ``BatchStream`` either way.
    ``regions`` and ``capture`` are what ``Trainer`` and ``capture`` take as ``regions`` and
    ``method``: how to find the model's regions and trace it.
    """

    name: str
    model: nn.Module
    example_inputs: tuple[Tensor, ...]
    example_targets: tuple[Tensor, ...]
    loss_fn: LossFn
    batches: Callable[[int], Batch]
    stages: int
    seed: int
    eval_batches: Callable[[int], Batch] | None = None
    data: Any = None
    batch_size: int | None = None
    regions: str | None = None  # by module path (piper_directives.regions); None: annotate, or the default
    capture: str = "auto"  # how capture traces the model: fx, export, or auto
    about: str | None = None  # what the data is, said as the run starts (text data: piper_train.text)
    drop_last: bool = False  # a Dataset's: each epoch's partial last batch dropped (text data)

    def stream(self) -> Any:  # a piper_train.batches.BatchStream
        from piper_train.batches import BatchStream

        if self.data is not None:
            return BatchStream(self.data, batch_size=self.batch_size, seed=self.seed, name=f"{self.name} data",
                               drop_last=self.drop_last)
        return BatchStream(self.batches, seed=self.seed, name=f"{self.name} batches")


def _mix(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**63 - 1)


def _held_out(k: int) -> int:
    """The step number that seeds held-out batch ``k``: negative, so no training step's."""
    return -2 - k


def _mlp(stages: int, seed: int) -> Built:
    d_in, d_hidden, d_out, batch = 32, 64, 8, 16
    teacher = torch.randn(d_in, d_out, generator=torch.Generator().manual_seed(_mix(seed, -1)))

    def batches(step: int) -> Batch:
        x = torch.randn(batch, d_in, generator=torch.Generator().manual_seed(_mix(seed, step)))
        return (x,), (torch.sin(x @ teacher / math.sqrt(d_in)),)

    return MLP(d_in, d_hidden, d_out, stages), F.mse_loss, batches, lambda k: batches(_held_out(k))


def _stack(stages: int, seed: int) -> Built:
    d_model, batch, seq = 256, 32, 32
    teacher = torch.randn(d_model, d_model, generator=torch.Generator().manual_seed(_mix(seed, -1)))

    def batches(step: int) -> Batch:
        x = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(_mix(seed, step)))
        return (x,), (torch.tanh(x @ teacher / math.sqrt(d_model)),)

    return ResidualStack(d_model, 1024, 8, stages), F.mse_loss, batches, lambda k: batches(_held_out(k))


def _random_tokens(stages: int, seed: int) -> Built:
    vocab, seq_len, batch = 64, 16, 8

    def batches(step: int) -> Batch:
        gen = torch.Generator().manual_seed(_mix(seed, step))
        seq = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
        return (seq[:, :-1],), (seq[:, 1:],)

    return TinyTransformer(vocab, 64, 4, stages, seq_len), lm_loss, batches, lambda k: batches(_held_out(k))


LM_VALIDATION = 0.1  # the fraction of the corpus (its end) the lm example holds out


def _byte_lm(stages: int, seed: int) -> Built:
    seq_len, batch = 64, 16
    corpus = stdlib_corpus()
    cut = int(len(corpus) * (1 - LM_VALIDATION))
    train = ByteBatches(corpus[:cut], batch, seq_len, seed)
    validation = ByteBatches(corpus[cut:], batch, seq_len, seed)

    def batches(step: int) -> Batch:
        inputs, targets = train(step)
        return (inputs,), (targets,)

    def eval_batches(k: int) -> Batch:
        inputs, targets = validation(k)
        return (inputs,), (targets,)

    return TinyTransformer(256, 64, 4, stages, seq_len), lm_loss, batches, eval_batches


def _moe(stages: int, seed: int) -> Built:
    d_in, d_out, batch = 16, 8, 16
    teacher = torch.randn(d_in, d_out, generator=torch.Generator().manual_seed(_mix(seed, -1)))

    def batches(step: int) -> Batch:
        x = torch.randn(batch, d_in, generator=torch.Generator().manual_seed(_mix(seed, step)))
        return (x,), (torch.sin(x @ teacher / math.sqrt(d_in)),)

    model = MoEModel(d_in, 16, d_out, stages, num_experts=4, k=2, shared=True)
    return model, F.mse_loss, batches, lambda k: batches(_held_out(k))


MODELS = {"mlp": _mlp, "transformer": _random_tokens, "lm": _byte_lm, "moe": _moe, "stack": _stack}


def build_model(name: str, *, stages: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> ModelSpec:
    """Build registered model ``name`` with ``stages`` annotated PP regions.

    - ``mlp``: regression with MSE, float32 inputs (16, 32) -> (16, 8).
    - ``transformer``: tiny causal LM on random tokens (vocab 64, d 64, 4 heads, seq 16, batch 8).
    - ``moe``: regression with MSE through mixture-of-experts regions (16 -> 8, batch 16,
      4 experts of width 32, top-2 routing, a shared expert).
    - ``lm``: byte-level LM on the standard library's source (vocab 256, d 64, 4 heads,
      seq 64, batch 16); one block per stage. It trains on the first 90% of the corpus; its
      held-out batches come from the last 10%.
    - ``stack``: regression with MSE through 8 residual MLP blocks (d 256, hidden 1024),
      inputs (32, 32, 256), the blocks grouped into ``stages`` regions (at most 8): compute
      dominates its step (the pipeline benchmarks' model).

    Every model has held-out batches (``eval_batches``): the others draw them like training
    batches, from seeds no training step uses.

    ``seed`` fixes the initial weights (without disturbing the caller's global RNG) and the data.
    ``dtype`` is the floating-point type of the weights and of floating inputs and targets
    (float64 makes oracle comparisons exact enough to survive Adam's rescaling).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, loss_fn, batches, eval_batches = MODELS[name](stages, seed)
    if dtype != torch.float32:
        model = model.to(dtype)
        batches, eval_batches = _cast_batches(batches, dtype), _cast_batches(eval_batches, dtype)
    inputs, targets = batches(0)
    return ModelSpec(name, model, inputs, targets, loss_fn, batches, stages, seed, eval_batches)


def _cast_batches(batches: Callable[[int], Batch], dtype: torch.dtype) -> Callable[[int], Batch]:
    def cast(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)

    def cast_batches(step: int) -> Batch:
        inputs, targets = batches(step)
        return cast(inputs), cast(targets)

    return cast_batches
