import pytest
import torch
from torch import nn

from piper_directives import annotate, capture
from piper_ir import CaptureError, EdgeKind, NodeKind, Phase, SegmentRole


def _three_stage():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 2)

        def forward(self, x):
            with annotate("PP"):
                return self.a(x)

    return Two()


def test_segments_follow_annotations_in_trace_order(three_stage):
    g = three_stage.graph
    stages = g.stage_segments()
    assert [s.id for s in stages] == ["s0", "s1", "s2"]
    assert [s.tags.as_dict() for s in stages] == [{"PP": 0}, {"PP": 1}, {"PP": 2}]
    assert g.loss_segment().role is SegmentRole.LOSS
    assert [p for p, _ in stages[1].params] == ["b.weight", "b.bias"]
    assert stages[0].source and "conftest.py" in stages[0].source


def test_one_forward_one_backward_per_segment_and_one_update_per_stage(three_stage):
    g = three_stage.graph
    kinds = [(n.kind, n.phase) for n in g.nodes]
    assert kinds.count((NodeKind.COMPUTE, Phase.F)) == 4
    assert kinds.count((NodeKind.COMPUTE, Phase.B)) == 4
    assert kinds.count((NodeKind.OPTIMIZER, Phase.OPT)) == 3


def test_skip_connection_becomes_a_data_edge_with_its_gradient(three_stage):
    g = three_stage.graph
    data = {(e.src, e.dst, e.value) for e in g.edges if e.kind is EdgeKind.DATA}
    (skip,) = [v for (s, d, v) in data if s == "F.s0" and d == "F.s2"]
    assert ("B.s2", "B.s0", f"grad:{skip}") in data


def test_metas_record_shapes_and_batch_dimension(three_stage):
    g = three_stage.graph
    inp = g.value_by_name["input:0"].meta
    assert inp.shape == (8, 4) and inp.batch_dim == 0 and not inp.requires_grad
    out = g.value_by_name[g.segment_by_id["s2"].outputs[0]].meta
    assert out.shape == (8, 2) and out.batch_dim == 0 and out.requires_grad


def test_segment_modules_reproduce_the_model(three_stage):
    torch.manual_seed(1)
    x = torch.randn(8, 4)
    mods = three_stage.modules
    env = {"input:0": x}
    for seg in three_stage.graph.stage_segments():
        outs = mods[seg.id](*[env[v] for v in seg.inputs])
        env.update(zip(seg.outputs, outs, strict=True))
    expected = torch.tanh(mods["s0"].a(x))
    assert torch.equal(env[three_stage.graph.segment_by_id["s0"].outputs[0]], expected)


def test_nested_annotations_carry_both_tags_and_split_runs():
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            with annotate("PP"):
                x = self.a(x)
                with annotate("EP"):
                    x = self.b(x)
                x = self.c(x)
            return x

    cap = capture(Nested(), (torch.randn(4, 4),), (torch.randn(4, 4),), nn.functional.mse_loss)
    tags = [s.tags.as_dict() for s in cap.graph.stage_segments()]
    assert tags == [{"PP": 0}, {"EP": 0, "PP": 0}, {"PP": 0}]


def test_explicit_index():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            with annotate("PP", 3):
                x = self.a(x)
            with annotate("PP"):
                return self.b(x)

    cap = capture(M(), (torch.randn(2, 2),), (torch.randn(2, 2),), nn.functional.mse_loss)
    assert [s.tags.get("PP") for s in cap.graph.stage_segments()] == [3, 4]


def test_compute_outside_annotations_is_named():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(self, x):
            with annotate("PP"):
                x = self.a(x)
            return torch.relu(x)

    with pytest.raises(CaptureError, match=r"outside every annotate.*relu.*test_capture.py"):
        capture(Leaky(), (torch.randn(2, 2),), (torch.randn(2, 2),), nn.functional.mse_loss)


def test_loss_must_be_a_scalar(three_stage):
    with pytest.raises(CaptureError, match="scalar"):
        capture(_three_stage(), (torch.randn(8, 4),), (torch.randn(8, 2),), lambda y, t: y - t)


@pytest.mark.parametrize(
    ("inputs", "targets", "message"),
    [
        ((torch.randn(1, 4),), (torch.randn(1, 2),), "at least 2 samples"),
        ((torch.randn(8, 4),), (torch.randn(6, 2),), "disagree on the batch size"),
        ((), (torch.randn(8, 2),), "at least one example input"),
    ],
)
def test_bad_example_batches(inputs, targets, message):
    with pytest.raises(CaptureError, match=message):
        capture(_three_stage(), inputs, targets, nn.functional.mse_loss)


def test_one_tensor_is_one_input_not_a_sequence_of_rows():
    """``capture(model, x, y, loss)`` reads a bare tensor as the one input (target), as the
    tuple ``(x,)`` would be: not as 8 inputs, one per row."""
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    bare = capture(_three_stage(), x, y, nn.functional.mse_loss)
    wrapped = capture(_three_stage(), (x,), (y,), nn.functional.mse_loss)
    assert [(v.name, v.meta.shape) for v in bare.graph.values] == [(v.name, v.meta.shape) for v in wrapped.graph.values]


def test_a_model_that_is_no_module_or_a_loss_that_is_no_function_is_named():
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with pytest.raises(CaptureError, match="the model must be a torch.nn.Module, got function"):
        capture(lambda t: t, x, y, nn.functional.mse_loss)
    with pytest.raises(CaptureError, match=r"the loss function must be callable .*, got int"):
        capture(_three_stage(), x, y, 3)


def test_annotate_is_free_outside_capture():
    with annotate("PP") as a:
        assert a._scope is None
    with pytest.raises(ValueError, match="reserved"):
        annotate("MB")
