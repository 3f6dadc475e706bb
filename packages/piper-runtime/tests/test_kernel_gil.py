"""``piper_runtime.rank.kernel_gil``: inductor's CPU kernels bound so that they run with the
GIL released (the local runtime's ranks are threads of one process)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from piper_runtime.rank import kernel_gil
from piper_runtime.rank.compiled import compile_graph


def test_the_installed_inductor_binding_is_the_one_it_changes_and_is_restored():
    cls = kernel_gil.binding_class()
    assert cls is not None, "torch's inductor binding changed: kernels would hold the GIL again"
    before = (cls.call_entry_function, cls.extra_parse_arg)
    with kernel_gil.releasing_gil() as released:
        assert released
        assert "PiperGilRelease" in cls.call_entry_function and "PyEval_SaveThread" in cls.extra_parse_arg
    assert (cls.call_entry_function, cls.extra_parse_arg) == before


def test_a_kernel_inductor_compiles_runs_through_the_releasing_binding(monkeypatch):
    cls = kernel_gil.binding_class()
    built: list[str] = []
    load_async = cls.load_async

    def recording(main_code: str, *args, **kwargs):  # the kernel's source with its binding appended
        built.append(main_code)
        return load_async(main_code, *args, **kwargs)

    monkeypatch.setattr(cls, "load_async", recording)
    def f(x: torch.Tensor) -> tuple[torch.Tensor]:  # compiled by no other test of this process
        return (torch.tanh(x) * 1.25 + x,)

    x = torch.randn(64, 33)
    fn = compile_graph(make_fx(f)(x), "inductor")
    (got,) = fn(x)
    torch.testing.assert_close(got, f(x)[0])
    bindings = [code for code in built if "PyInit_" in code]
    assert bindings, "inductor bound no kernel"
    assert all("PiperGilRelease piper_released; std::apply(kernel, piper_args);" in code for code in bindings)


@pytest.mark.parametrize("torch_call, inductor_extra", [("other({});", ""), ("kernel({}); Py_RETURN_NONE;", "x")])
def test_another_torchs_binding_is_left_as_it_is(monkeypatch, torch_call, inductor_extra):
    cls = kernel_gil.binding_class()
    monkeypatch.setattr(cls, "call_entry_function", torch_call)
    monkeypatch.setattr(cls, "extra_parse_arg", inductor_extra)
    assert kernel_gil.binding_class() is None
    with kernel_gil.releasing_gil() as released:
        assert not released
        assert (cls.call_entry_function, cls.extra_parse_arg) == (torch_call, inductor_extra)
