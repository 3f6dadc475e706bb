"""``piper train`` as a user starts it: what its processes listen on, which processes its
embedded cluster runs, and what its stdout holds when SIGTERM ends it.

The command runs from a stripped environment (``PATH`` and ``HOME``, as ``env -i`` leaves
them, and a Ray temp folder of its own to find its processes by): the test session's settings
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the root conftest, in ``./dev``) hid that an
embedded cluster listened on every interface (``piper_runtime.driver.ray_env``). One run serves both
tests: starting Ray is most of its cost.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import pytest

from piper_runtime.driver import lean_head
from piper_runtime.driver.reaper import descendants
from piper_runtime.testing import listening

pytestmark = [
    pytest.mark.ray,
    pytest.mark.own_process,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

TIMEOUT_S = 240


@attrs.frozen
class Run:
    listeners: dict[int, tuple[str, list[tuple[str, int]]]]  # pid -> (command line, its listening sockets)
    commands: list[str]  # the command line of each process of the command's tree while it trained
    returncode: int
    stdout: str
    stderr: str


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _listeners(pid: int) -> dict[int, tuple[str, list[tuple[str, int]]]]:
    """Every process of ``pid``'s tree that listens on a TCP socket, with those sockets."""
    found = {}
    for p in [pid, *descendants(pid)]:
        try:
            sockets = listening(p)
        except OSError:  # gone meanwhile
            continue
        if sockets:
            found[p] = (_command_line(p), sockets)
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _wait_for_line(stream, prefix: str, deadline: float) -> str:
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(prefix):
            return "".join(seen)
    raise AssertionError(f"no line starting with {prefix!r}; got:\n{''.join(seen)}")


@pytest.fixture(scope="module")
def sigterm_run() -> Run:
    """``piper train --json`` (the installed script) from a stripped environment: its listeners
    once it trains, then a SIGTERM (it stops at a step boundary, exit 143)."""
    ray_tmp = tempfile.mkdtemp(prefix="piper-ls-")  # short: Ray's socket paths must fit 107 bytes
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", ray_tmp),
           "RAY_TMPDIR": ray_tmp}
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("piper")), "train", "--model", "mlp", "--pp", "2", "--microbatches", "2",
         "--steps", "100000", "--no-progress-bar", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ray_tmp,
    )
    try:
        head = _wait_for_line(proc.stderr, "step ", time.monotonic() + TIMEOUT_S)  # progress: stderr with --json
        listeners = _listeners(proc.pid)
        commands = [_command_line(p) for p in descendants(proc.pid)]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT_S)
        leftover = subprocess.run(["pgrep", "-af", ray_tmp], capture_output=True, text=True).stdout
        assert not leftover, f"the command left Ray processes behind: {leftover}"
    finally:
        proc.kill()
        proc.communicate()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return Run(listeners, commands, proc.returncode, out, head + err)


def test_an_embedded_cluster_listens_on_loopback_only(sigterm_run: Run) -> None:
    """Ray's GCS, raylet, runtime-env agent and core workers (the driver's, every rank's), and
    the ranks' rendezvous store and gloo pairs."""
    listeners = sigterm_run.listeners
    commands = " ".join(command for command, _ in listeners.values())
    for expected in ("gcs_server", "raylet", "RankWorker"):  # we looked at Ray's processes and the ranks
        assert expected in commands, listeners
    beyond = {pid: (command[:80], [s for s in sockets if not _loopback(s[0])])
              for pid, (command, sockets) in listeners.items()}
    beyond = {pid: found for pid, found in beyond.items() if found[1]}
    assert not beyond, f"listening beyond loopback: {beyond}"


def test_an_embedded_cluster_starts_no_api_server_autoscaler_or_log_monitor(sigterm_run: Run) -> None:
    """``piper_runtime.driver.lean_head``: Ray's head runs its GCS and raylet (and the raylet
    its agents and the rank workers), not the three Python processes Piper has no use for."""
    commands = "\n".join(sigterm_run.commands)
    for expected in ("gcs_server", "raylet", "RankWorker"):
        assert expected in commands, commands
    for skipped in ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "_private/log_monitor.py"):
        assert skipped not in commands, commands


def test_an_embedded_cluster_tries_its_sockets_every_50_ms(sigterm_run: Run) -> None:
    """``lean_head.SYSTEM_CONFIG``, as the GCS was given it (``--config_list``: base64 JSON),
    from which the raylet and the workers read it."""
    gcs = next(command for command in sigterm_run.commands if "gcs_server" in command.split(" ", 1)[0])
    encoded = next(arg.split("=", 1)[1] for arg in gcs.split() if arg.startswith("--config_list="))
    config = json.loads(base64.b64decode(encoded))
    assert {name: config.get(name) for name in lean_head.SYSTEM_CONFIG} == lean_head.SYSTEM_CONFIG


def test_sigterm_leaves_one_json_document_on_stdout(sigterm_run: Run) -> None:
    assert sigterm_run.returncode == 143, sigterm_run.stderr[-4000:]
    assert sigterm_run.stdout.count("\n") == 1, sigterm_run.stdout
    doc = json.loads(sigterm_run.stdout)
    assert (doc["command"], doc["ok"], doc["exit_code"], doc["stopped"]) == ("train", False, 143, "SIGTERM")
    assert doc["steps"] >= 1 and len(doc["losses"]) == doc["steps"]
    assert doc["error"].startswith("piper train: stopped on SIGTERM after step")
    assert doc["error"] in sigterm_run.stderr and "Traceback" not in sigterm_run.stderr
