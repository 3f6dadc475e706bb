"""``piper tune``'s link measurement (``tuning.profiler``): the ping-pong runs through the
runtime's own CPU transport between two processes, and the profile cache tells the
transports apart."""

from __future__ import annotations

import textwrap

import pytest

from piper_directives import capture
from piper_runtime.testing import ranks_as_processes
from piper_train.models import build_model
from piper_train.tuning.profiler import link_costs, profile_key

# One end of the ping-pong (what each Ray actor runs), in a process of its own.
END = textwrap.dedent(
    """
    import json, sys
    from piper_train.tuning.profiler import _PingPong
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    print(json.dumps(_PingPong().run(rank, port, reps=3, timeout_s=30.0)))
    """
)


@pytest.mark.parametrize("disable", ["0", "1"])
def test_the_ping_pong_measures_each_transport_between_two_processes(disable: str) -> None:
    ends = ranks_as_processes(END, 2, env={"PIPER_SHM_DISABLE": disable})
    one_way = {int(k): v for k, v in ends[0].items()}
    assert sorted(one_way) == [4, 16 * 1024, 256 * 1024, 2 * 1024 * 1024]
    latency, bandwidth = link_costs(one_way)
    assert 0 < latency < 1.0 and bandwidth > 1e6  # bounds on sanity, not on speed


def test_link_costs_are_the_smallest_time_and_the_slope() -> None:
    latency, bandwidth = link_costs({4: 1e-4, 1_000_004: 1.1e-3, 64: 2e-4})
    assert latency == 1e-4
    assert bandwidth == pytest.approx(1_000_000 / 1e-3)


def test_the_cache_key_tells_shared_memory_from_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = build_model("mlp", stages=2)
    captured = capture(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn)
    monkeypatch.setenv("PIPER_SHM_DISABLE", "1")
    gloo = profile_key("mlp", captured, "cpu")
    monkeypatch.setenv("PIPER_SHM_DISABLE", "0")
    default = profile_key("mlp", captured, "cpu")
    assert profile_key("mlp", captured, "cpu") == default
    from piper_runtime.backends.shm import shm_available

    assert (gloo != default) == shm_available()
