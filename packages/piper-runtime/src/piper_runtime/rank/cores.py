"""Binding each rank's step threads to cores of its own, where its host has enough cores.

Why: a shared-memory message wakes its receiver from the sender's thread, which goes on
computing. Linux places a woken thread on the waker's core ("wake affine") when it finds no
idle core it considers close, and on a virtual machine whose cores share no cache in its
topology it finds none: the receiver then waits behind the sender's computation (0.3-2 ms,
up to the scheduler's time slice) while the other core idles. A scheduler trace of the
``mlp`` model's 1F1B step at pp=2 on a 2-core VM showed rank 0 runnable but not running for
up to 21 ms of 170 ms; torch's ranks, woken by gloo's threads (which sleep at once), waited
0.5 ms of 200 (docs/benchmarks.md). A rank bound to a core of its own is woken there.

What is bound: the thread that runs the rank's steps, from the end of ``RankWorker.setup``
on, and so every thread it starts (the lanes of a step, a channel's sender thread), which
inherit its binding. Ray's threads and the communication library's (started while joining the
world) keep the whole host, as does the driver.

Policy (``core_slices``): the ranks of one host split the cores the host gives its workers
(the worker process's affinity, so a container's or a batch scheduler's cpuset is honoured)
into equal contiguous slices, in rank order, a slice per rank; a host with fewer cores than
ranks binds none of them (round robin measured no faster than floating: two ranks on one
core serialise their computations). DeepSpeed's ``--bind_cores_to_rank`` and torchrun's NUMA
binding do the same for the same reason. ``Runtime(bind_cores=False)`` leaves every thread
where the operating system puts it.

Several jobs on one machine (two runs, or test processes side by side): a bound rank holds a
claim on each of its cores (``CoreClaim``: an exclusive ``flock`` on a file per core in
``claims_dir()``, which the kernel releases when the process dies, however it dies). The
cores a host offers are those no other process claims (``unclaimed``), so a second job splits
what the first left, or binds nothing, instead of stacking its ranks on the first job's
cores. A claim lost to a job that started at the same moment leaves that rank unbound.
Jobs see each other's claims when they run as one user with one temporary directory.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path


def host_cores() -> tuple[int, ...]:
    """The cores this process's workers may use: the affinity of its main thread (never
    bound by us), sorted; empty where the platform cannot say."""
    try:
        return tuple(sorted(os.sched_getaffinity(os.getpid())))
    except (AttributeError, OSError):  # not Linux
        return ()


def thread_cores() -> tuple[int, ...]:
    """The cores the calling thread may run on, sorted; empty where the platform cannot say."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return ()


def core_slices(hosts: Sequence[tuple[str, Sequence[int]]]) -> dict[int, tuple[int, ...]]:
    """Rank -> the cores its step threads are bound to, from each rank's (host id, cores the
    host offers its workers) in rank order (module doc's policy). A host offers the cores
    every one of its ranks saw free. Ranks of a host with fewer cores than ranks are absent."""
    ranks: dict[str, list[int]] = {}
    offered: dict[str, set[int]] = {}
    for rank, (host, available) in enumerate(hosts):
        ranks.setdefault(host, []).append(rank)
        offered[host] = offered[host] & set(available) if host in offered else set(available)
    cores = {host: tuple(sorted(free)) for host, free in offered.items()}
    out: dict[int, tuple[int, ...]] = {}
    for host, members in ranks.items():
        width = len(cores[host]) // len(members)
        if width == 0:
            continue
        for index, rank in enumerate(members):
            out[rank] = cores[host][index * width : (index + 1) * width]
    return out


def bind_this_thread(cores: Sequence[int] | None) -> bool:
    """Bind the calling thread to ``cores``, or give it back every core of the host
    (``None``: a pooled worker may have been bound by an earlier run). Whether it could: a
    sandbox may forbid it, or the cores may have left the process's cpuset since they were
    counted; the thread then stays where it was, which costs speed, not correctness."""
    target = set(cores) if cores else set(host_cores())
    if not target:
        return False
    try:
        os.sched_setaffinity(0, target)  # Linux: pid 0 is the calling thread alone
    except OSError:
        return False
    return True


def claims_dir() -> Path:
    """Where the claims of this user's jobs on this machine live (one file per core)."""
    return Path(tempfile.gettempdir()) / f"piper-cores-{os.getuid()}"


class CoreClaim:
    """This process's exclusive claim on some cores (module doc): held until ``release``, or
    until the process ends."""

    def __init__(self, cores: tuple[int, ...], files: list[int]) -> None:
        self.cores = cores
        self._files = files

    def release(self) -> None:
        for fd in self._files:
            os.close(fd)  # closing the file drops its lock
        self._files = []


def claim(cores: Sequence[int], directory: Path | None = None) -> CoreClaim | None:
    """Claim every core of ``cores`` for this process, or none of them: ``None`` when another
    process holds one. Where no claim can be made at all (no writable temporary directory),
    the claim holds nothing and binding goes ahead, as it did before claims existed."""
    files: list[int] = []
    try:
        for core in cores:
            fd = _open(core, directory)
            files.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another process holds it
        for fd in files:
            os.close(fd)
        return None
    except OSError:
        for fd in files:
            os.close(fd)
        return CoreClaim(tuple(cores), [])
    return CoreClaim(tuple(cores), files)


def unclaimed(cores: Sequence[int], directory: Path | None = None) -> tuple[int, ...]:
    """The cores of ``cores`` no process claims at this moment (a shared lock, taken and
    dropped at once, succeeds only where no claim is held; two processes looking at once do
    not see each other's looks)."""
    free = []
    for core in cores:
        try:
            fd = _open(core, directory)
        except OSError:
            return tuple(cores)  # no claims can be made here: none are held either
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            free.append(core)
        except BlockingIOError:
            pass  # held by another process's claim
        except OSError:
            free.append(core)  # cannot tell: as claim does, take it as free
        finally:
            os.close(fd)  # drops the shared lock too
    return tuple(free)


def _open(core: int, directory: Path | None) -> int:
    directory = directory or claims_dir()
    directory.mkdir(mode=0o700, exist_ok=True)
    return os.open(directory / f"cpu{core}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def host_report() -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """This host, as the machine's name and the cores it gives its workers (the ranks of one
    host share those); then the cores no other job claims now, and those it does."""
    cores = host_cores()
    free = unclaimed(cores)
    return f"{socket.gethostname()}/{','.join(map(str, cores))}", free, tuple(c for c in cores if c not in free)


class StepCores:
    """The cores the thread that runs a worker's steps is bound to, with this process's claim
    on them. Ray may run a worker's calls on another thread than its setup's: ``follow`` binds
    the calling thread too."""

    def __init__(self) -> None:
        self.cores: tuple[int, ...] = ()
        self._claim: CoreClaim | None = None
        self._thread: int | None = None

    def take(self, cores: Sequence[int]) -> None:
        """Claim ``cores`` and bind the calling thread to them (nothing, if empty or another
        job claimed them meanwhile, or the operating system refuses)."""
        self.release()
        self._claim = claim(cores) if cores else None
        if self._claim is not None:
            self._bind(self._claim.cores)

    def follow(self) -> None:
        if self.cores and self._thread != threading.get_ident():
            self._bind(self.cores)

    def release(self) -> None:
        """Unbind (the next run decides anew) and give up the claim (other jobs may have them)."""
        if self.cores:
            bind_this_thread(None)
            self.cores = ()
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def _bind(self, cores: tuple[int, ...]) -> None:
        bound = bind_this_thread(cores)
        self.cores = cores if bound else ()
        self._thread = threading.get_ident()
        if not bound and self._claim is not None:
            self._claim.release()
            self._claim = None


def describe(
    slices: Mapping[int, Sequence[int]],
    world_size: int,
    enabled: bool = True,
    claimed: Mapping[str, Sequence[int]] | None = None,
    planned: Collection[int] = (),
) -> str:
    """One line for the run's log: which rank got which cores, or why none did; ``claimed``:
    by host name, the cores other jobs held when this one looked; ``planned``: the ranks
    given cores then (``core_slices``), of which those not in ``slices`` lost them to another
    job's claim before they could make their own."""
    if not enabled:
        return "cores: not bound (bind_cores=False)"
    held = "".join(
        f"; cores {_span(sorted(cores))} of {host} held by another job"
        for host, cores in sorted((claimed or {}).items()) if cores
    )
    lost = "unbound (another job claimed its cores meanwhile)"
    if not slices:
        if planned:
            return f"cores: not bound (another job claimed the cores meanwhile{held})"
        return f"cores: not bound (no host has a free core for each of its ranks{held})"
    shown = ", ".join(
        f"rank {r}: {_span(slices[r])}" if r in slices else f"rank {r}: {lost if r in planned else 'unbound'}"
        for r in range(world_size)
    )
    return f"cores: each rank's step threads bound to cores of their own ({shown}{held})"


def _span(cores: Sequence[int]) -> str:
    if len(cores) > 1 and list(cores) == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))
