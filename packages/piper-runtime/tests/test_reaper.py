"""The reaper's view of the process tree: what it records is what it later kills."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from piper_runtime.driver import reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_descendants_finds_children_and_grandchildren_with_their_start_times():
    # A shell that starts a sleep of its own: the grandchild must be found through the shell.
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        for _ in range(500):
            found = reaper.descendants(os.getpid())
            grandchildren = [pid for pid in found if reaper._stat_fields(pid)[1] == str(shell.pid).encode()]
            if grandchildren:
                break
            time.sleep(0.01)
        assert shell.pid in found
        assert grandchildren, found
        for pid, started in found.items():
            assert started == reaper._start_time(pid)
    finally:
        subprocess.run(["pkill", "-P", str(shell.pid)])
        shell.kill()
        shell.wait()
    assert reaper._start_time(shell.pid) is None  # reaped: gone from /proc


def test_a_missing_process_has_no_start_time():
    assert reaper._start_time(2**22 + 1) is None  # above Linux's largest pid
