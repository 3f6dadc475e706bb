"""``--stages`` with a model file is honoured or refused, never ignored, and a ``--strategy``
run says the strategy's own pipeline ranks and microbatches (item 9 of issue 10). No Ray: the
refusal comes once the model is captured, before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from piper_directives import one_f_one_b
from piper_train.cli import main

MODEL = '''
import torch
from torch import nn
from piper_directives import annotate


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            with annotate("PP"):
                x = torch.tanh(layer(x))
        return x


def factory():
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    return Three(), x, x.flip(0), nn.functional.mse_loss
'''


@pytest.fixture
def three(tmp_path: Path) -> str:
    path = tmp_path / "three.py"
    path.write_text(MODEL)
    return f"{path}:factory"


@pytest.mark.parametrize("command", ["check", "train"])
def test_stages_other_than_the_model_files_regions_are_refused(command, three, capsys):
    code = main([command, "--model", three, "--pp", "2", "--stages", "4", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--stages 4: the model has 3 annotated regions" in err and "pass --stages 3" in err
    assert "Traceback" not in err


def test_plan_refuses_them_too(three, tmp_path, capsys):
    code = main(["plan", "--model", three, "--pp", "3", "--stages", "2", "--out", str(tmp_path / "p.json")])
    assert code == 2
    assert "--stages 2: the model has 3 annotated regions" in capsys.readouterr().err


def test_a_strategy_file_run_says_the_files_pipeline_ranks_and_microbatches(three, tmp_path, capsys):
    strategy = tmp_path / "strategy.json"
    strategy.write_text(one_f_one_b(3, 6, stages=3).to_json())
    # --pp and --microbatches say otherwise; the file decides. --stages 2 stops it before Ray.
    code = main(["check", "--model", three, "--strategy", str(strategy), "--pp", "2", "--microbatches", "4",
                 "--stages", "2", "--steps", "1"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "pp=3," in out and "microbatches=6" in out and "pp=2," not in out
    assert "--stages 2: the model has 3 annotated regions" in err
