"""``user_code_modules``: which of the user's modules a captured program needs on workers."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from piper_directives import capture
from piper_directives.user_code import is_user_module


@pytest.mark.parametrize(
    ("name", "user"),
    [("os.path", False), ("torch.nn", False), ("piper_ir", False), ("__main__", False), ("my_model", True), ("pkg.sub", True)],
)
def test_installed_and_standard_modules_are_not_user_code(name, user):
    assert is_user_module(name) is user


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_loss_its_helpers_and_kept_modules_are_found(tmp_path):
    (tmp_path / "uc_helper.py").write_text("def square(e):\n    return e * e\n")
    (tmp_path / "uc_unused.py").write_text("VALUE = 1\n")
    (tmp_path / "uc_model.py").write_text(textwrap.dedent("""
        import torch
        import uc_unused  # imported but never referred to by anything captured: still in the closure
        from torch import nn
        from uc_helper import square
        from piper_directives import annotate

        class Kept(nn.Module):
            piper_experts = True  # capture keeps it as one call

            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(4, 3, 3))

            def forward(self, tokens, ids):
                return torch.bmm(tokens.unsqueeze(1), self.w[ids]).squeeze(1)

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.kept = Kept()

            def forward(self, x):
                with annotate("PP"):
                    return self.kept(x, x.argmax(-1))

        def loss(y, t):
            return square(y - t).mean()
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        module = _load(tmp_path / "uc_model.py", "uc_private_name")
        captured = capture(module.Model(), (torch.randn(4, 3),), (torch.randn(4, 3),), module.loss)
        assert captured.user_modules == ("uc_helper", "uc_private_name", "uc_unused")
        plain = capture(module.Model(), (torch.randn(4, 3),), (torch.randn(4, 3),), F.mse_loss)
        assert plain.user_modules == ("uc_helper", "uc_private_name", "uc_unused")  # the kept module's class
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("uc_helper", "uc_unused", "uc_private_name"):
            sys.modules.pop(name, None)


def test_a_model_of_installed_code_needs_nothing_shipped(three_stage):
    assert three_stage.user_modules == ()
