"""``piper tune``'s link measurement (``tuning.profiler``): the ping-pong runs through the
runtime's own CPU transport between two processes, and the profile cache tells the
transports apart."""

from __future__ import annotations

import textwrap

import pytest

from piper_directives import capture
from piper_runtime import InstructionTiming
from piper_runtime.testing import ranks_as_processes
from piper_train.models import build_model
from piper_train.tuning.profiler import gaps_and_tail, link_costs, profile_key

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


def test_gaps_start_at_the_latest_end_so_far() -> None:
    """A window's ``B`` is timed until its weight products are in, around the no-op ``B``
    and the send inside it (``piper_runtime.rank.input_grads_first``): the time its products take
    is the ``B``'s, not a gap before the next instruction."""
    timings = [
        InstructionTiming(1, "F", 0.0, 1.0),
        InstructionTiming(1, "B.loss", 1.5, 5.0),  # its window ends at 5.0
        InstructionTiming(1, "B.stage", 3.0, 3.1),  # inside it
        InstructionTiming(1, "F.next", 5.25, 6.0),
    ]
    gaps, tail = gaps_and_tail(timings, 6.5)
    assert gaps == [0.5, 0.0, 0.25] and tail == 0.5
    assert gaps_and_tail([], 1.0) == ([], 1.0)


@pytest.mark.parametrize("text", ["[1]", "{", "[" * 100_000 + "]" * 100_000, '{"compute": 3}', "\udcff"])
def test_a_damaged_profile_cache_is_measured_again(tmp_path, text: str) -> None:
    from piper_train.tuning.profiler import read_cached

    said: list[str] = []
    path = tmp_path / "p.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert read_cached(path, said.append) is None
    assert said == [f"profile: ignoring unreadable cache {path}"]
    assert read_cached(tmp_path / "none.json", said.append) is None
