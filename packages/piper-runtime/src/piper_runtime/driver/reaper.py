"""The reaper: the embedded Ray cluster's processes die with the driver, even a SIGKILLed one.

Ray's own fate-sharing stops most of its processes when the driver dies, but its dashboard
and runtime-env agents notice late and then spend a minute trying to report to the dead GCS
(measured: 64 s; docs/reliability.md). When ``piper_runtime.driver.cluster.ensure_ray`` starts the
embedded cluster (never when it connects to someone else's), it starts this watcher as a
process of its own session (a bare interpreter running this file: it starts in milliseconds,
importing neither torch nor Ray), holding the write end of a pipe whose read end is the
watcher's stdin. The watcher records the driver's descendant processes (Ray's) every
``REFRESH_S``, backing off to ``MAX_REFRESH_S`` while they stay the same (Ray starts its
processes in the cluster's first seconds; a scan reads every ``/proc/PID/stat``, and every
0.5 s that cost 1% of a core); when stdin reaches end-of-file, which happens the moment the driver exits in
any way, it SIGKILLs those it recorded that are still the same processes (same start time),
and exits. Linux only (``/proc``); elsewhere ``start`` does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import sys

REFRESH_S = 0.5
MAX_REFRESH_S = 4.0
_watcher: tuple[int, int] | None = None  # (pid, the write end of its stdin)


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (field 3 onwards), ``None`` if
    the process is gone. Raw ``os`` calls: a scan reads hundreds of these."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    return stat.rsplit(b")", 1)[1].split()


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of ``/proc/PID/stat``), ``None`` if it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[19].decode()


def _children() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, for every process we can see."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        if fields is not None:
            tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def descendants(pid: int) -> dict[int, str]:
    """Every descendant of ``pid`` (not itself) with its start time."""
    tree = _children()
    found: dict[int, str] = {}
    todo = list(tree.get(pid, ()))
    while todo:
        child = todo.pop()
        started = _start_time(child)
        if started is not None and child not in found:
            found[child] = started
            todo.extend(tree.get(child, ()))
    return found


def watch(driver: int) -> None:
    """Record ``driver``'s descendants until stdin ends, then kill them (module doc)."""
    me = os.getpid()
    known: dict[int, str] = {}
    wait = REFRESH_S
    while True:
        before = len(known)
        known.update(descendants(driver))  # first, before the driver may be gone
        known.pop(me, None)
        wait = REFRESH_S if len(known) != before else min(2 * wait, MAX_REFRESH_S)
        ready, _, _ = select.select([sys.stdin], [], [], wait)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the driver is gone (or closed the pipe after shutting Ray down)
    for pid, started in known.items():
        if _start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def start() -> None:
    """Start the watcher for this process (once; Linux only). ``posix_spawn``, not
    ``subprocess``: the watcher outlives a driver that exits without ``stop``, and a ``Popen``
    object would then warn about a child still running."""
    global _watcher
    if _watcher is not None or not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        return
    read, write = os.pipe()  # neither end is inherited by Ray's later children
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        # The file itself, without site packages: ``-m piper_runtime.driver.reaper`` would import
        # the package (torch, ray) first, seconds during which the watcher watches nothing.
        pid = os.posix_spawn(
            sys.executable,
            [sys.executable, "-S", os.path.abspath(__file__), str(os.getpid())],
            dict(os.environ),
            file_actions=[(os.POSIX_SPAWN_DUP2, read, 0), (os.POSIX_SPAWN_DUP2, devnull, 1),
                          (os.POSIX_SPAWN_DUP2, devnull, 2)],
            setsid=True,  # a Ctrl-C meant for the driver does not stop the watcher first
        )
    finally:
        os.close(read)
        os.close(devnull)
    _watcher = (pid, write)


def stop() -> None:
    """After Ray was shut down cleanly: let the watcher go (it kills whatever is left)."""
    global _watcher
    if _watcher is not None:
        pid, write = _watcher
        _watcher = None
        os.close(write)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]))
