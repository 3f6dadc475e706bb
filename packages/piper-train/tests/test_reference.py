import pytest
import torch

from piper_runtime import OptimizerSpec
from piper_train.models import build_model
from piper_train.reference import ReferenceTrainer


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_accumulated_microbatches_equal_the_full_batch_step(name):
    """Splitting into microbatches (loss_i / M, summed) is the full-batch step."""
    spec = build_model(name, stages=2, seed=5)
    opt = OptimizerSpec("sgd", 0.1)
    acc = ReferenceTrainer(spec.model, spec.loss_fn, opt, 4)
    full = ReferenceTrainer(spec.model, spec.loss_fn, opt, 4, accumulate=False)
    inputs, targets = spec.batches(0)
    a, f = acc.step(inputs, targets), full.step(inputs, targets)
    assert a.losses == pytest.approx(f.losses, rel=1e-6)
    assert a.loss == pytest.approx(float(spec.loss_fn(spec.model(*inputs), *targets)), rel=1e-5)
    for name_, grad in f.grads.items():
        torch.testing.assert_close(a.grads[name_], grad, rtol=1e-4, atol=1e-6)
    for name_, p in full.parameters().items():
        torch.testing.assert_close(acc.parameters()[name_], p, rtol=1e-4, atol=1e-6)


def test_the_model_passed_in_is_not_trained():
    spec = build_model("mlp", stages=2)
    before = {n: p.clone() for n, p in spec.model.named_parameters()}
    ReferenceTrainer(spec.model, spec.loss_fn, OptimizerSpec("sgd", 0.1), 2).step(*spec.batches(0))
    assert all(torch.equal(p, before[n]) for n, p in spec.model.named_parameters())


def test_a_batch_too_small_for_its_pieces_is_rejected():
    spec = build_model("mlp", stages=1)
    inputs, targets = spec.batches(0)
    with pytest.raises(ValueError, match="does not split into 3 microbatches of 2 shards"):
        ReferenceTrainer(spec.model, spec.loss_fn, OptimizerSpec(), 3, shards=2).step(inputs[0][:5], targets[0][:5])


@pytest.mark.parametrize(("samples", "microbatches", "shards"), [(13, 4, 1), (11, 2, 2), (16, 3, 1)])
def test_a_batch_that_does_not_divide_evenly_steps_as_the_whole_batch(samples, microbatches, shards):
    """A partial batch: pieces a sample apart (tensor_split's cut), each loss divided by the
    batch's samples over its own, so the accumulated gradient and the reported loss are the
    whole batch's mean; the microbatch losses are the pieces' means weighted by samples."""
    spec = build_model("mlp", stages=2, seed=3, dtype=torch.float64)
    opt = OptimizerSpec("sgd", 0.1)
    inputs, targets = spec.batches(0)
    inputs, targets = tuple(t[:samples] for t in inputs), tuple(t[:samples] for t in targets)
    acc = ReferenceTrainer(spec.model, spec.loss_fn, opt, microbatches, shards=shards)
    full = ReferenceTrainer(spec.model, spec.loss_fn, opt, microbatches, accumulate=False)
    a, f = acc.step(inputs, targets), full.step(inputs, targets)
    whole = float(spec.loss_fn(spec.model(*inputs), *targets))
    assert a.loss == pytest.approx(whole, rel=1e-12) and f.loss == pytest.approx(whole, rel=1e-12)
    assert a.losses == pytest.approx(f.losses, rel=1e-12)  # each microbatch's mean over its shards
    for name, grad in f.grads.items():
        torch.testing.assert_close(a.grads[name], grad, rtol=1e-10, atol=1e-14)


def test_a_mean_loss_is_the_mean_of_its_pieces_and_a_sum_is_not():
    """``whole_and_pieces``: the batch run whole against the mean of its microbatch x shard
    pieces, forward only; a mean over the batch agrees, a sum is the pieces' mean times
    their count, a mean over a count that varies between pieces (ignored targets) differs."""
    spec = build_model("mlp", stages=2, seed=0, dtype=torch.float64)
    (x,), (y,) = spec.batches(0)
    mean = ReferenceTrainer(spec.model, torch.nn.functional.mse_loss, OptimizerSpec(), 2, shards=2)
    whole, parts = mean.whole_and_pieces((x,), (y,))
    assert parts == pytest.approx(whole, rel=1e-12)
    assert mean.whole_and_pieces(x, y) == (whole, parts)  # a bare tensor is the one input, as for Trainer
    summed = ReferenceTrainer(spec.model, lambda out, t: ((out - t) ** 2).sum(), OptimizerSpec(), 2, shards=2)
    whole, parts = summed.whole_and_pieces((x,), (y,))
    assert parts == pytest.approx(whole / 4, rel=1e-12)

    def ignoring(out, t):  # the mean over the targets that are not NaN: their count varies per piece
        keep = ~t.isnan()
        return ((out - t.nan_to_num()) ** 2)[keep].mean()

    y = y.clone()
    y[:2] = float("nan")  # ignored targets in the first piece only,
    y[2:4] += 10.0  # whose other targets are far off: weighed by their count whole, by a quarter in pieces
    whole, parts = ReferenceTrainer(spec.model, ignoring, OptimizerSpec(), 2, shards=2).whole_and_pieces((x,), (y,))
    assert parts > 1.3 * whole
    assert spec.model.training  # eval mode only while it measured
