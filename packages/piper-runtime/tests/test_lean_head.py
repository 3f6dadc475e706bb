"""``piper_runtime.driver.lean_head``: Ray's head-process starters are stood in for only while
an embedded cluster starts, and only with a Ray the start was measured with. (That the
processes are then missing, and the cluster works without them: integration/test_listeners.py,
which runs ``piper train`` from a stripped environment.)"""

from __future__ import annotations

import pytest
import ray
from ray._private.node import Node

from piper_runtime.driver import lean_head


def _methods() -> dict[str, object]:
    return {name: Node.__dict__.get(name) for name in lean_head.SKIPPED}


def test_the_starters_are_stood_in_for_while_open_and_put_back_after() -> None:
    before = _methods()
    assert all(before.values())  # this Ray defines all three on Node itself
    with lean_head.lean_start() as lean:
        assert lean
        assert all(getattr(Node, name) is lean_head._skip for name in lean_head.SKIPPED)
    assert _methods() == before


def test_the_starters_are_put_back_when_the_start_fails() -> None:
    before = _methods()
    with pytest.raises(RuntimeError, match="ray.init failed"), lean_head.lean_start():
        raise RuntimeError("ray.init failed")
    assert _methods() == before


def test_another_ray_starts_its_cluster_as_it_always_did(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _methods()
    monkeypatch.setattr(ray, "__version__", "2.59.0")
    with lean_head.lean_start() as lean:
        assert not lean
        assert _methods() == before


def test_the_socket_settings_are_given_only_to_a_ray_that_knows_them(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lean_head.system_config() == lean_head.SYSTEM_CONFIG
    monkeypatch.setattr(ray, "__version__", "2.59.0")
    assert lean_head.system_config() == {}
