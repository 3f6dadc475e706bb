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


def test_indivisible_batch_is_rejected():
    spec = build_model("mlp", stages=1)
    with pytest.raises(ValueError, match="does not split into 3"):
        ReferenceTrainer(spec.model, spec.loss_fn, OptimizerSpec(), 3).step(*spec.batches(0))
