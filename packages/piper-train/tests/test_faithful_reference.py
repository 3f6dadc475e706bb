"""Captured segments run one after another on one device, drawing random numbers and casting
as a runtime will (``seeded``, ``cast_forward``), against ``ReferenceTrainer`` running the
user's own model: dropout masks and bf16 arithmetic must be the reference's exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import annotate, capture
from piper_directives.capturing import CapturedModel
from piper_directives.precision import cast_forward, cast_inputs, torch_dtype
from piper_directives.randomness import Randomness, seeded
from piper_runtime import OptimizerSpec
from piper_train.reference import ReferenceTrainer

SEED = 1234


class Noisy(nn.Module):
    """Dropout in every region (a module, a functional call and attention's dropout_p), a
    region nested in another, and a tied weight between the first and last region."""

    def __init__(self, d: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(0.3)
        self.qkv = nn.Linear(d, 3 * d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with annotate("PP"):
            x = self.drop(self.emb(tokens))
        with annotate("PP"):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)
            x = x + a.transpose(1, 2).flatten(-2)
            with annotate("EP"):
                x = F.dropout(torch.tanh(self.mid(x)), 0.2, training=True)
            x = self.drop(x)
        with annotate("PP"):
            return self.head(x)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(n: int = 8, t: int = 6, vocab: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (n, t + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def segment_step(
    captured: CapturedModel,
    inputs: tuple[torch.Tensor, ...],
    targets: tuple[torch.Tensor, ...],
    *,
    microbatches: int,
    step: int,
    shards: int = 1,
    seed: int | None = SEED,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One training step the way a runtime runs it, on one device: every (microbatch,
    shard) through the segments in order, each forward under ``seeded`` (and the graph's
    precision), loss scaled by 1/(microbatches*shards); gradients are those of the captured
    model's parameters (summed over a tie's holders, which share the parameter here)."""
    graph, modules = captured.graph, captured.modules
    compute = torch_dtype(graph.precision.compute) if graph.precision else None
    params = {id(p): p for m in modules.values() for p in m.parameters()}
    for p in params.values():
        p.grad = None
    losses = []
    for i, chunk in enumerate(zip(*(t.chunk(microbatches) for t in (*inputs, *targets)), strict=True)):
        shard_losses = []
        for j, piece in enumerate(zip(*(t.chunk(shards) for t in chunk), strict=True)):
            xs = piece[: len(inputs)]
            env = dict(zip(graph.inputs, cast_inputs(xs, compute) if compute else xs, strict=True))
            env.update(zip(graph.targets, piece[len(inputs) :], strict=True))
            for seg in graph.segments:
                args = [env[v] for v in seg.inputs]
                with seeded(seed, seg.id, i, step, j) if seed is not None else torch.random.fork_rng(devices=[]):
                    if compute is not None and seg.role.value == "stage":
                        out = cast_forward(modules[seg.id], args, compute)
                    else:
                        out = modules[seg.id](*args)
                if seg.role.value == "loss":
                    loss = out
                else:
                    env.update(zip(seg.outputs, out, strict=True))
            (loss / (microbatches * shards)).backward()
            shard_losses.append(float(loss.detach()))
        losses.append(sum(shard_losses) / shards)
    return losses, {id_: p.grad for id_, p in params.items()}


def _by_name(model: nn.Module, grads: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: grads[id(p)] for name, p in model.named_parameters()}


@pytest.mark.parametrize("shards", [1, 2])
def test_captured_segments_draw_the_references_dropout_masks(shards):
    torch.manual_seed(0)
    model = Noisy()
    inputs, targets = _batch()
    captured = capture(model, (inputs,), (targets,), _lm_loss)
    assert len(captured.graph.stage_segments()) == 5  # the nested EP region splits its PP region in three
    reference = ReferenceTrainer(
        model, _lm_loss, OptimizerSpec("sgd", 0.1), 2, shards=shards, randomness=Randomness(SEED, captured.runs)
    )
    for step in range(2):
        losses, grads = segment_step(captured, (inputs,), (targets,), microbatches=2, step=step, shards=shards)
        want = reference.step((inputs,), (targets,))
        assert tuple(losses) == want.losses  # same masks, same arithmetic: bit for bit
        got = _by_name(model, grads)
        assert got.keys() == want.grads.keys()
        for name, g in want.grads.items():
            torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-7, msg=name)
        with torch.no_grad():  # take the reference's update, so step 1 starts from equal weights
            for name, p in model.named_parameters():
                p.copy_(reference.parameters()[name])


def test_dropout_is_on_and_differs_across_microbatches_and_steps():
    """The masks are real and keyed: every (microbatch, step) and every seed draws its own,
    the same key the same."""
    torch.manual_seed(0)
    model = Noisy()
    inputs, targets = _batch()
    same = torch.cat([inputs[:4], inputs[:4]]), torch.cat([targets[:4], targets[:4]])  # two equal microbatches
    captured = capture(model, (same[0],), (same[1],), _lm_loss)
    (a, b), _ = segment_step(captured, (same[0],), (same[1],), microbatches=2, step=0)
    assert a != b  # equal data, different microbatch keys
    (c, d), _ = segment_step(captured, (same[0],), (same[1],), microbatches=2, step=1)
    assert {a, b}.isdisjoint({c, d})  # a new step draws new masks
    (e, f), _ = segment_step(captured, (same[0],), (same[1],), microbatches=2, step=0)
    assert (e, f) == (a, b)  # the same key gives the same masks
    (g, h), _ = segment_step(captured, (same[0],), (same[1],), microbatches=2, step=0, seed=SEED + 1)
    assert {g, h}.isdisjoint({a, b})  # the seed decides the masks


def test_reference_randomness_needs_microbatched_steps():
    model = Noisy()
    with pytest.raises(ValueError, match="full-batch step"):
        ReferenceTrainer(model, _lm_loss, OptimizerSpec(), 2, accumulate=False, randomness=Randomness(0, {}))


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with annotate("PP"):
            h = self.norm(torch.tanh(self.a(x)))
        with annotate("PP"):
            return self.b(h)


def test_bf16_precision_segments_match_the_bf16_reference_and_keep_fp32_master_state():
    torch.manual_seed(0)
    model = Regressor()
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    captured = capture(model, (x,), (y,), F.mse_loss, precision="bf16")
    graph = captured.graph
    assert (graph.precision.compute, graph.precision.master) == ("bfloat16", "float32")
    metas = {v.name: v.meta for v in graph.values}
    assert metas["input:0"].dtype == "bfloat16" and metas["target:0"].dtype == "float32"
    assert {metas[o].dtype for s in graph.stage_segments() for o in s.outputs} == {"bfloat16"}
    assert {m.dtype for s in graph.stage_segments() for _, m in s.params} == {"float32"}

    bf16 = ReferenceTrainer(model, F.mse_loss, OptimizerSpec("adamw", 1e-2), 2, precision=graph.precision)
    fp32 = ReferenceTrainer(model, F.mse_loss, OptimizerSpec("adamw", 1e-2), 2)
    losses, grads = segment_step(captured, (x,), (y,), microbatches=2, step=0, seed=None)
    want, exact = bf16.step((x,), (y,)), fp32.step((x,), (y,))
    assert tuple(losses) == want.losses  # the same casts in the same places: bit for bit
    got = _by_name(model, grads)
    for name, g in want.grads.items():
        assert g.dtype == got[name].dtype == torch.float32  # gradients reach the fp32 master weights
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)
        # Against fp32 training: bf16 keeps 8 significant bits (relative spacing 2**-8 = 0.4%),
        # and each layer's rounding compounds; 5% of the largest gradient entry bounds it here.
        torch.testing.assert_close(g, exact.grads[name], rtol=0.05, atol=0.05 * exact.grads[name].abs().max().item())
    assert {p.dtype for p in bf16.parameters().values()} == {torch.float32}
    state = bf16.optimizer.state[next(iter(bf16.model.parameters()))]
    assert state["exp_avg"].dtype == torch.float32  # optimizer state in the master dtype


def test_precision_names_are_checked():
    from piper_ir import CaptureError

    with pytest.raises(CaptureError, match="unknown precision 'int4'"):
        capture(Regressor(), (torch.randn(4, 6),), (torch.randn(4, 3),), F.mse_loss, precision="int4")
