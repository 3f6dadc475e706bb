import pytest
import torch
from torch import nn

from piper_directives import annotate, capture


class ThreeStage(nn.Module):
    """Three annotated stages with a skip connection from stage 0 into stage 2."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        with annotate("PP"):
            h = torch.tanh(self.a(x))
        with annotate("PP"):
            g = torch.tanh(self.b(h))
        with annotate("PP"):
            return self.c(g + h)


@pytest.fixture
def three_stage():
    torch.manual_seed(0)
    return capture(ThreeStage(), (torch.randn(8, 4),), (torch.randn(8, 2),), nn.functional.mse_loss)
