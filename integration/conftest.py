"""Fixtures shared by the integration tests (the Ray cluster fixture is in the root conftest).

Runtimes: the integration tests run on the ``local`` runtime (every rank a thread of this
process: no worker processes to start), which computes what the ``ray`` runtime computes,
bit for bit (``test_runtimes.py`` holds the two equal on every schedule and parallelism).
Tests of what only Ray does (actors killed, placement groups, worker pools, several nodes)
are marked ``ray`` and run on it. ``PIPER_RUNTIME=ray ./dev test`` puts the others on Ray too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import attrs
import pytest
import ray
import torch

from piper_train.cli import main

_CHOSEN = os.environ.get("PIPER_RUNTIME")  # what the whole run asked for, if anything


@pytest.fixture(autouse=True)
def runtime(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The runtime this test's runs start by default (``PIPER_RUNTIME``; module doc)."""
    name = "ray" if request.node.get_closest_marker("ray") else _CHOSEN or "local"
    monkeypatch.setenv("PIPER_RUNTIME", name)
    yield name


@attrs.frozen
class Done:
    """What a run of the ``piper`` command gave: its exit code and its output."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def piper(capsys: pytest.CaptureFixture[str], ray_cluster: None) -> Callable[..., Done]:
    """``piper ARGS`` in this process: ``main``'s return value (argparse's exit code for a
    usage error) and what it printed. ``main`` must raise nothing else, print no traceback
    and leave the session's Ray running (``ray_cluster`` starts it first: a command that
    started Ray itself would give it too few CPUs for the tests after it)."""

    def run(*args: str) -> Done:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse: usage errors
            code = exit_.code
        assert ray.is_initialized(), "the command shut down the session's Ray"
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return Done(code, out, err)

    return run


def router_counts(workload) -> list[list[int]]:  # a piper_train ModelSpec
    """Tokens per expert in every MoE layer of the built-in MoE model on the first batch
    (top-2: 2 per token)."""
    counts: list[list[int]] = []
    hooks = [
        block["moe"].experts.register_forward_hook(
            lambda mod, args, out: counts.append(torch.bincount(args[1], minlength=mod.num_experts).tolist())
        )
        for block in workload.model.blocks
    ]
    try:
        with torch.no_grad():
            workload.model(*workload.example_inputs)
    finally:
        for h in hooks:
            h.remove()
    return counts


def _assert_uneven(workload) -> None:
    for layer in router_counts(workload):
        assert len(set(layer)) > 1, f"routing is even: {layer}"
        # Per destination rank of an EP=2 group (experts 0-1 on one rank, 2-3 on the other).
        assert layer[0] + layer[1] != layer[2] + layer[3], layer


@pytest.fixture
def assert_uneven() -> Callable[..., None]:
    """Asserts that the router sends different token counts to each expert and to each rank
    of an EP=2 group, so the all-to-alls are genuinely uneven."""
    return _assert_uneven


