"""Capture keeps what the user's forward means, or refuses it naming the user's line.

Each test builds a small model with one construct real models contain (autocast, no_grad,
checkpoint, tied weights, buffers, sizes crossing regions, code fx cannot trace) and checks
the captured graph and segment modules against eager execution of the same model.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from piper_directives import annotate, capture
from piper_directives.capturing import CapturedModel, tie_locations
from piper_directives.segment_module import SegmentModule
from piper_ir import CaptureError, from_json, to_json

X, Y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.randn(8, 4)


def _capture(model: nn.Module, x: torch.Tensor = X, y: torch.Tensor = Y) -> CapturedModel:
    return capture(model, (x,), (y,), F.mse_loss)


def _run_segments(captured: CapturedModel, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The stage segments one after another on one device; returns the model outputs."""
    env = dict(zip(captured.graph.inputs, inputs, strict=True))
    for seg in captured.graph.stage_segments():
        env.update(zip(seg.outputs, captured.modules[seg.id](*[env[v] for v in seg.inputs]), strict=True))
    return tuple(env[v] for v in captured.graph.loss_segment().inputs if v in env)


# --- autocast and grad mode -----------------------------------------------------------------


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with annotate("PP"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = self.a(x)
        with annotate("PP"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = torch.relu(self.b(x))
                with torch.autocast("cpu", enabled=False):
                    x = x.float() * 2  # fp32 inside the bf16 region
            return x


def test_autocast_regions_are_kept_in_the_segments():
    model = Autocast()
    captured = _capture(model)
    s0, s1 = captured.graph.stage_segments()
    assert captured.graph.value_by_name[s0.outputs[0]].meta.dtype == "bfloat16"  # a Linear under autocast
    (out,) = _run_segments(captured, X)
    want = model(X)
    assert out.dtype == want.dtype == torch.float32 and torch.equal(out, want)
    mid = captured.modules["s0"](X)[0]
    assert mid.dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")  # the context was left again


def test_autocast_survives_pickling_where_torch_fx_would_drop_it():
    """torch.fx pickles source and re-traces it; a call with no traced argument (entering
    autocast) would vanish. SegmentModule pickles the graph itself."""
    captured = _capture(Autocast())
    module = captured.modules["s0"]
    assert isinstance(module, SegmentModule)
    loaded = pickle.loads(pickle.dumps(module))
    assert loaded.code == module.code and isinstance(loaded, SegmentModule)
    assert loaded(X)[0].dtype == torch.bfloat16
    plain = torch.fx.GraphModule(module, module.graph)
    assert pickle.loads(pickle.dumps(plain))(X)[0].dtype == torch.float32  # what SegmentModule avoids


def test_no_grad_regions_are_kept():
    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.target = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            with annotate("PP"):
                with torch.no_grad():
                    t = self.target(x)  # no gradient may reach self.target
                h = self.a(x)
            with annotate("PP"):
                return h * t

    model = Frozen()
    captured = _capture(model)
    (out,) = _run_segments(captured, X)
    F.mse_loss(out, Y).backward()
    assert model.target.weight.grad is None and model.a.weight.grad is not None
    torch.testing.assert_close(out, model(X), rtol=0, atol=0)


def test_autocast_for_a_missing_device_is_reported(recwarn):
    class CudaCast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            with annotate("PP"):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return self.a(x)

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: autocast('cuda') is kept")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _capture(CudaCast())
    messages = [str(w.message) for w in caught]
    assert any("test_capture_faithful.py" in m and "runs without autocast" in m for m in messages), messages


# --- activation checkpointing ---------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_marks_its_segment_for_recomputation(reentrant):
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            with annotate("PP"):
                x = self.a(x)
            with annotate("PP"):
                x = checkpoint(lambda h: torch.tanh(self.b(h)), x, use_reentrant=reentrant)
            with annotate("PP"):
                return self.c(x)

    model = Checkpointed()
    captured = _capture(model)
    assert [s.recompute for s in captured.graph.stage_segments()] == [False, True, False]
    (out,) = _run_segments(captured, X)
    F.mse_loss(out, Y).backward()
    assert model.b.weight.grad is not None  # the reentrant checkpoint's no_grad forward is not kept
    torch.testing.assert_close(out, model(X), rtol=0, atol=0)
    assert from_json(to_json(captured.graph)) == captured.graph


# --- tied parameters ------------------------------------------------------------------------


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 4)
        self.mid = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 16, bias=False)
        self.lm_head.weight = self.wte.weight  # GPT-2's tied embedding

    def forward(self, tokens):
        with annotate("PP"):
            x = self.wte(tokens)
        with annotate("PP"):
            x = torch.tanh(self.mid(x))
        with annotate("PP"):
            return self.lm_head(x)


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(1))
    return t, t


def test_a_tied_weight_is_one_logical_parameter_held_by_both_segments():
    model = TiedLM()
    tokens, targets = _tokens()
    captured = capture(model, (tokens,), (targets,), lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()))
    (tie,) = captured.graph.ties
    assert tie.name == "wte.weight"  # what model.named_parameters() calls it
    assert tie.holders == (("s0", "wte.weight"), ("s2", "lm_head.weight"))
    assert captured.modules["s0"].get_parameter("wte.weight") is captured.modules["s2"].get_parameter("lm_head.weight")
    assert [p for p, _ in captured.graph.segment_by_id["s2"].params] == ["lm_head.weight"]
    locations = tie_locations(captured, tie)
    assert "'wte.weight' in s0" in locations and "'lm_head.weight' in s2" in locations
    assert "module 'lm_head'" in locations and "test_capture_faithful.py" in locations
    # One device, segments in order: the shared tensor's gradient is the sum over both uses.
    (logits,) = _run_segments(captured, tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    got = model.wte.weight.grad.clone()
    model.zero_grad()
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    torch.testing.assert_close(got, model.wte.weight.grad, rtol=0, atol=0)


def test_a_module_called_from_two_regions_is_tied_too():
    class Reused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with annotate("PP"):
                x = self.lin(x)
            with annotate("PP"):
                return self.lin(torch.tanh(x))

    captured = _capture(Reused())
    assert [(t.name, t.holders) for t in captured.graph.ties] == [
        ("lin.weight", (("s0", "lin.weight"), ("s1", "lin.weight"))),
        ("lin.bias", (("s0", "lin.bias"), ("s1", "lin.bias"))),
    ]


# --- refused constructs ---------------------------------------------------------------------


def test_batchnorm_running_statistics_are_refused_and_left_untouched():
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            with annotate("PP"):
                x = self.lin(x)
            with annotate("PP"):
                return self.bn(x)

    model = Normed()
    before = model.bn.running_mean.clone()
    with pytest.raises(CaptureError, match=r"buffer 'bn.running_mean' in place by call_module bn .*module 'bn'.*test_capture_faithful.py"):
        _capture(model)
    with pytest.raises(CaptureError, match=r"buffer 'bn.running_mean' in place"):  # cast copies hide nothing
        capture(model, (X,), (Y,), F.mse_loss, precision="bf16")
    assert torch.equal(model.bn.running_mean, before) and int(model.bn.num_batches_tracked) == 0
    model.bn.track_running_stats = False  # batch statistics only: nothing to keep in sync
    model.bn.running_mean = model.bn.running_var = None
    _capture(model)


class Counting(nn.Module):
    def __init__(self, by_input: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.by_input = by_input
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        with annotate("PP"):
            if self.by_input:
                self.calls.add_(x.sum())  # traced: it is in the captured code
            else:
                self.calls.add_(1)  # runs while tracing, never captured
            return self.lin(x)


def test_an_in_place_buffer_update_is_refused():
    with pytest.raises(CaptureError, match=r"buffer 'calls' in place by call_method add_ .*test_capture_faithful.py.*self.calls.add_\(x.sum"):
        _capture(Counting(by_input=True))
    model = Counting(by_input=False)
    with pytest.raises(CaptureError, match=r"buffer 'calls' of module '<model>' \(Counting, .*test_capture_faithful.py:\d+\) in place .*tracing ran it once"):
        _capture(model)
    assert float(model.calls) == 0.0  # put back as it was


def test_a_size_handed_to_another_region_is_refused():
    class Sizes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with annotate("PP"):
                n = x.size(1)
                x = self.lin(x)
            with annotate("PP"):
                return x.narrow(1, 0, n)

    with pytest.raises(CaptureError, match=r"region s0 hands region s1 a int, not a tensor: .*size.*test_capture_faithful.py.*n = x.size\(1\)"):
        _capture(Sizes())


def test_a_tuple_handed_to_another_region_is_refused():
    class Halves(nn.Module):
        def forward(self, x):
            with annotate("PP"):
                parts = x.chunk(2, dim=1)
            with annotate("PP"):
                return parts[0] * 2

    with pytest.raises(CaptureError, match=r"region s0 hands region s1 a tuple.*index tuples inside the region that made them"):
        _capture(Halves())


def test_an_assert_on_a_shape_names_the_line_and_gives_a_hint():
    class Checked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with annotate("PP"):
                assert x.shape[-1] == 4, "wrong width"
                return self.lin(x)

    with pytest.raises(CaptureError) as err:
        capture(Checked(), (X,), (Y,), F.mse_loss, method="fx")
    text = str(err.value)
    assert "cannot capture Checked.forward at" in text and "test_capture_faithful.py" in text
    assert 'assert x.shape[-1] == 4, "wrong width"' in text
    assert "TraceError" in text and "hint: Python control flow" in text and "torch.where" in text
    # torch.export traces it: the width is fixed by the model anyway, the batch size stays free.
    assert _capture(Checked()).method == "export"


def test_a_branch_on_a_size_names_the_line_and_gives_a_hint():
    class Branchy(nn.Module):
        def forward(self, x):
            with annotate("PP"):
                if x.size(0) > 2:  # a Python branch on a size read from a traced value
                    x = x * 2
                return x + 1

    with pytest.raises(CaptureError) as err:
        _capture(Branchy())
    text = str(err.value)
    assert "cannot capture Branchy.forward at" in text and "test_capture_faithful.py" in text
    assert "if x.size(0) > 2:" in text and "hint: Python control flow" in text
    # torch.export would trace one side of the branch and guard the batch size: refused too,
    # since a microbatch's size is not the example's.
    assert "holds only for batch sizes in [3," in text and "microbatches would take another path" in text


def test_len_of_a_traced_value_gives_its_own_hint():
    class Lengthy(nn.Module):
        def forward(self, x):
            with annotate("PP"):
                return x * len(x)

    with pytest.raises(CaptureError, match=r"(?s)return x \* len\(x\).*hint: len\(\) of a traced value: use x.size\(0\)"):
        capture(Lengthy(), (X,), (Y,), F.mse_loss, method="fx")
    # torch.export turns len(x) into the example's 8 without a guard: caught by running the
    # exported code on another batch size, and refused.
    with pytest.raises(CaptureError, match=r"(?s)hint: len\(\) of a traced value.*does not hold for another batch size"):
        _capture(Lengthy())


# --- capture has no side effects --------------------------------------------------------------


def test_capture_leaves_the_random_state_alone():
    class Dropping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with annotate("PP"):
                return F.dropout(self.lin(x), 0.5)

    model = Dropping()
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    _capture(model)
    assert torch.equal(torch.rand(3), expected)


def test_runs_map_region_boundaries_to_segments():
    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            with annotate("PP"):  # boundary 1
                with annotate("EP"):  # 2 (PP holds no operation before it: no segment)
                    x = self.a(x)
                x = self.b(x)  # after boundary 3
            with annotate("PP"):  # 5 (4 left the first PP region)
                return self.c(x)

    captured = _capture(Nested())
    assert captured.runs == {2: "s0", 3: "s1", 5: "s2"}
    assert [s.tags.as_dict() for s in captured.graph.stage_segments()] == [{"PP": 0, "EP": 0}, {"PP": 0}, {"PP": 1}]
