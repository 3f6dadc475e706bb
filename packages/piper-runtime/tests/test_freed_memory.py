"""``piper_runtime.rank.freed_memory``: glibc's malloc told to keep freed memory, once per
process, for compiled segments."""

from __future__ import annotations

import subprocess
import sys

import pytest

from piper_runtime.rank import freed_memory


class _Recording:
    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


def test_it_sets_glibcs_two_thresholds_once(monkeypatch):
    recording = _Recording()
    monkeypatch.setattr(freed_memory, "_mallopt", lambda: recording)
    monkeypatch.setattr(freed_memory, "_done", None)
    assert freed_memory.keep_freed_memory()
    assert freed_memory.keep_freed_memory()
    assert recording.calls == [(-3, 32 << 20), (-1, 1 << 30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


@pytest.mark.parametrize("mallopt", [None, _Recording(answer=0)], ids=["not glibc", "refused"])
def test_without_glibcs_mallopt_it_says_it_did_nothing(monkeypatch, mallopt):
    monkeypatch.setattr(freed_memory, "_mallopt", lambda: mallopt)
    monkeypatch.setattr(freed_memory, "_done", None)
    assert not freed_memory.keep_freed_memory()


def test_glibcs_mallopt_takes_the_values_here():
    # In a process of its own: the settings are process-wide.
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc: Linux")
    code = "from piper_runtime.rank.freed_memory import keep_freed_memory; print(keep_freed_memory())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "True", done.stderr


def test_a_compiled_segment_keeps_freed_memory(monkeypatch):
    import torch
    from torch import nn

    from piper_runtime.rank import compiled

    calls: list[bool] = []
    monkeypatch.setattr(compiled, "keep_freed_memory", lambda: calls.append(True) or True)
    compiled.CompiledSegment("s0", nn.Linear(4, 4), [torch.randn(2, 4)], [True], "aot_eager", compiled.CompileStats())
    assert calls == [True]
