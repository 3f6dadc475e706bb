"""Point-to-point channels through shared memory, for two ranks on one host.

Why: a gloo transfer between two processes on one host crosses the loopback TCP stack and
is handed on three times (the sending thread to gloo's worker, to the receiver's gloo loop,
to the thread that waits); on a loaded host each hand-over waits for a core. Here the
sending thread copies the tensor into a ring the receiver mapped, and the receiving thread
wakes on a pipe: one hand-over. On this project's 2-core machines a round trip takes
0.35-0.75x of gloo's (128 KiB: 60-131 us against 199-272 us; ``benchmarks/bench_shm.py``).

One channel carries one direction between two ranks (``ShmSender`` on one end,
``ShmReceiver`` on the other). Its files, made by ``open_channels``:

- the *ring* (``CAPACITY`` bytes, made, reserved and mapped by the receiver, mapped by the
  sender);
- the *data pipe* (a FIFO, receiver reads): after copying a chunk into the ring, the sender
  writes a token, the chunk's length;
- the *credit pipe* (a FIFO, sender reads): after copying a chunk out, the receiver writes
  the ring's new tail, so the sender knows the space is free.

The pipes order the memory: a token is written after its chunk and read before it, and a
pipe's write and read are kernel calls that act as barriers on every architecture.

Messages are a byte stream in issue order; the receiver posts receives of the sizes the
sender sends (the plan's verifier proves the order; a size that does not match is an
error, not a silent mix-up). A message is cut into chunks that end at the ring's end at the
latest, and each chunk starts on an ``ALIGN`` boundary. That bounds the tokens in flight by
``CAPACITY / ALIGN`` in either pipe, below what a pipe holds, so no token write ever blocks.

A send copies what fits at once and returns; the rest is written by the channel's sender
thread as the receiver frees space (a receive that waits on that data then proceeds), like
gloo's asynchronous send. A receive copies its chunks when it is waited for. Every wait is
bounded by the timeout given to ``connect``; a peer that exits closes its pipe ends, which
the other end sees at once (end of file or a broken pipe) and reports as an error; what
the peer sent before it exited is still received. A channel whose wait raised is not used
again (the run it belongs to has failed).

All files are unlinked once both ends have opened them, so nothing is left in ``/dev/shm``
even when a process is killed. A ring's pages are reserved when it is made: a full
``/dev/shm`` (docker gives 64 MiB) is then a failure at setup, which the ranks agree on so
that none of them uses the channels (``open_channels`` returns ``None`` and the backend
sends through gloo), instead of a SIGBUS in the middle of a run.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import mmap
import os
import select
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
CAPACITY = 4 << 20  # bytes of ring per channel
ALIGN = 1024  # chunks start on this boundary: at most CAPACITY / ALIGN tokens in flight
PIPE_BYTES = 65536  # what a Linux pipe holds by default
_TOKEN = struct.Struct("<I")  # a chunk's length
_POLL_S = 0.5  # how often a blocked sender thread looks whether its channel closed
_CREDIT = struct.Struct("<Q")  # the receiver's tail, in bytes since the start
assert CAPACITY // ALIGN * max(_TOKEN.size, _CREDIT.size) <= PIPE_BYTES // 2


class ChannelError(RuntimeError):
    """A channel's peer went away, a wait timed out, or a message had the wrong size."""


def shm_available() -> bool:
    """Whether this host can make the channels' files (Linux's ``/dev/shm``, FIFOs)."""
    return hasattr(os, "mkfifo") and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The address and length in bytes of a contiguous host tensor's data."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("shared-memory channels carry contiguous host tensors only")
    return tensor.data_ptr(), tensor.nbytes


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _wait_readable(fd: int, deadline: float, what: str, cancelled: Callable[[], bool] = lambda: False) -> None:
    """Block until ``fd`` has data (or its writer is gone), at most until ``deadline``, or
    until ``cancelled()`` (checked every ``_POLL_S``)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not cancelled():
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelError(f"timed out waiting for {what}")
        if poller.poll(min(left, _POLL_S) * 1000):
            return


def _read_some(fd: int, what: str) -> bytes:
    """What a non-blocking pipe holds now (``b""`` if nothing); an error if its writer left."""
    try:
        data = os.read(fd, PIPE_BYTES)
    except BlockingIOError:
        return b""
    if not data:
        raise ChannelError(f"{what}: the peer closed the channel (did its process exit?)")
    return data


def _close_all(*fds: int) -> None:
    """Close the descriptors that were opened (``-1``: never was)."""
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def _write_all(fd: int, data: bytes, what: str) -> None:
    try:
        os.write(fd, data)  # below PIPE_BUF: atomic, and the bound above keeps room for it
    except BrokenPipeError:
        raise ChannelError(f"{what}: the peer closed the channel (did its process exit?)") from None


class _Ring:
    """The shared bytes of one channel, mapped into this process."""

    def __init__(self, path: Path, create: bool) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                try:  # reserve the pages now: a full /dev/shm would otherwise kill us with SIGBUS
                    os.posix_fallocate(fd, 0, CAPACITY)
                except OSError as exc:
                    raise ChannelError(
                        f"cannot reserve {CAPACITY >> 20} MiB in {SHM_DIR} for a ring ({exc.strerror}); "
                        "a container may need more (docker --shm-size)"
                    ) from None
            self.map = mmap.mmap(fd, CAPACITY)
        except BaseException:
            if create:
                path.unlink()
            raise
        finally:
            os.close(fd)
        self._view = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(self._view)

    def close(self) -> None:
        del self._view
        self.map.close()


class _Done:
    """The ``Work`` of a send that was copied out in full when it was issued."""

    def wait(self) -> None:
        pass


DONE = _Done()


class _Outgoing:
    """A send the ring had no room for yet (``Work``): done once every byte is in the ring."""

    def __init__(self, tensor: torch.Tensor, sent: int, timeout_s: float, what: str) -> None:
        self.tensor = tensor  # keeps the data alive while the sender thread copies it
        self.address, self.nbytes = _extent(tensor)
        self.sent = sent
        self.timeout_s = timeout_s
        self.what = what
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        if not self.done.wait(self.timeout_s):
            raise ChannelError(f"{self.what}: timed out after {self.timeout_s:.0f} s sending")
        if self.error is not None:
            raise ChannelError(str(self.error)) from self.error


class ShmSender:
    """The sending end of one channel (module doc)."""

    def __init__(self, ring: _Ring, data_fd: int, credit_fd: int, timeout_s: float, what: str) -> None:
        self.ring = ring
        self.data_fd = data_fd  # we write tokens
        self.credit_fd = credit_fd  # we read the receiver's tail (non-blocking)
        self.timeout_s = timeout_s
        self.what = what
        self.head = 0  # bytes of the stream written, padding included
        self.tail = 0  # the receiver's tail, as last read
        self.queue: collections.deque[_Outgoing] = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.thread: threading.Thread | None = None
        self.closed = False

    def send(self, tensor: torch.Tensor) -> _Done | _Outgoing:
        """Copy ``tensor`` into the ring, or as much as fits and the rest on the sender thread."""
        address, nbytes = _extent(tensor)
        if nbytes == 0:
            return DONE
        with self.lock:
            sent = self._write(address, nbytes, 0) if not self.queue else 0
            if sent == nbytes:
                return DONE
            out = _Outgoing(tensor, sent, self.timeout_s, self.what)
            self.queue.append(out)
            if self.thread is None:
                self.thread = threading.Thread(target=self._drain, name=f"piper-shm-send {self.what}", daemon=True)
                self.thread.start()
            self.wake.notify()
        return out

    def _write(self, address: int, nbytes: int, sent: int) -> int:
        """Copy bytes ``sent:`` of the message at ``address`` while the ring has room (lock
        held); how many are sent now."""
        credits = _read_some(self.credit_fd, self.what)
        if credits:
            (self.tail,) = _CREDIT.unpack_from(credits, len(credits) - _CREDIT.size)
        while sent < nbytes:
            at = self.head % CAPACITY
            # head and tail are ALIGN-aligned, so both bounds are whole ALIGN blocks
            n = min(nbytes - sent, CAPACITY - at, CAPACITY - (self.head - self.tail))
            if n <= 0:
                break
            ctypes.memmove(self.ring.address + at, address + sent, n)
            _write_all(self.data_fd, _TOKEN.pack(n), self.what)
            self.head += _round_up(n)
            sent += n
        return sent

    def _progress(self) -> None:
        """Copy as much of the queue as the ring has room for (lock held)."""
        while self.queue:
            out = self.queue[0]
            out.sent = self._write(out.address, out.nbytes, out.sent)
            if out.sent < out.nbytes:
                return
            self.queue.popleft()
            out.tensor = None  # the caller keeps its tensor until it waited; we are done with it
            out.done.set()

    def _drain(self) -> None:
        """The sender thread: writes what did not fit as the receiver frees space."""
        with self.lock:
            while not self.closed:
                if not self.queue:
                    self.wake.wait()
                    continue
                try:
                    self._progress()
                    if self.queue:
                        self.lock.release()
                        try:
                            _wait_readable(
                                self.credit_fd,
                                time.monotonic() + self.timeout_s,
                                f"{self.what}: free space",
                                lambda: self.closed,
                            )
                        finally:
                            self.lock.acquire()
                except BaseException as exc:  # handed to every waiting send
                    for out in self.queue:
                        out.error = exc
                        out.done.set()
                    self.queue.clear()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.wake.notify()
        if self.thread is not None:
            self.thread.join(timeout=2 * _POLL_S)
        _close_all(self.data_fd, self.credit_fd)
        self.ring.close()


class _Incoming:
    """A posted receive (``Work``): done once its bytes are copied out of the ring."""

    def __init__(self, channel: ShmReceiver, tensor: torch.Tensor) -> None:
        self.channel = channel
        self.tensor = tensor
        self.address, self.nbytes = _extent(tensor)
        self.filled = 0
        self.done = self.nbytes == 0

    def wait(self) -> None:
        if not self.done:
            self.channel.complete(self)


class ShmReceiver:
    """The receiving end of one channel (module doc)."""

    def __init__(self, ring: _Ring, data_fd: int, credit_fd: int, timeout_s: float, what: str) -> None:
        self.ring = ring
        self.data_fd = data_fd  # we read tokens (non-blocking)
        self.credit_fd = credit_fd  # we write our tail
        self.timeout_s = timeout_s
        self.what = what
        self.tail = 0
        self.tokens = b""  # read from the data pipe, not yet used from ``token_at`` on
        self.token_at = 0
        self.sender_gone = False
        self.posted: collections.deque[_Incoming] = collections.deque()
        self.lock = threading.Lock()

    def recv(self, tensor: torch.Tensor) -> _Incoming:
        incoming = _Incoming(self, tensor)
        if not incoming.done:
            with self.lock:
                self.posted.append(incoming)
        return incoming

    def complete(self, incoming: _Incoming) -> None:
        """Copy chunks into the posted receives, in order, until ``incoming`` is full."""
        deadline = time.monotonic() + self.timeout_s
        if not self.lock.acquire(timeout=self.timeout_s):
            raise ChannelError(f"{self.what}: timed out after {self.timeout_s:.0f} s receiving")
        try:
            while not incoming.done:
                if self.token_at == len(self.tokens):  # tokens are whole: pipe writes are atomic
                    more = _read_some(self.data_fd, self.what)
                    if not more:
                        _wait_readable(self.data_fd, deadline, f"{self.what}: a message")
                        continue
                    self.tokens, self.token_at = more, 0
                (n,) = _TOKEN.unpack_from(self.tokens, self.token_at)
                self.token_at += _TOKEN.size
                front = self.posted[0]
                if n > front.nbytes - front.filled:
                    raise ChannelError(
                        f"{self.what}: the sender's message is longer than the posted receive "
                        f"({front.nbytes} bytes): the two ends disagree on the plan"
                    )
                ctypes.memmove(front.address + front.filled, self.ring.address + self.tail % CAPACITY, n)
                self.tail += _round_up(n)
                self._credit()
                front.filled += n
                if front.filled == front.nbytes:
                    self.posted.popleft()
                    front.done = True
        finally:
            self.lock.release()

    def _credit(self) -> None:
        """Tell the sender our tail; a sender that has exited (after its last send) needs
        no more credit, while its messages remain readable."""
        if self.sender_gone:
            return
        try:
            os.write(self.credit_fd, _CREDIT.pack(self.tail))
        except BrokenPipeError:
            self.sender_gone = True

    def close(self) -> None:
        _close_all(self.data_fd, self.credit_fd)
        self.ring.close()


def channel_paths(prefix: str, sender: int, receiver: int) -> tuple[Path, Path, Path]:
    """The ring, data pipe and credit pipe of the channel ``sender -> receiver``."""
    base = SHM_DIR / f"{prefix}-{sender}-{receiver}"
    return base.with_suffix(".ring"), base.with_suffix(".data"), base.with_suffix(".credit")


def _open_reader(path: Path, made: list[Path]) -> int:
    """Make the FIFO ``path`` (noted in ``made``) and open its reading end."""
    os.mkfifo(path, 0o600)
    made.append(path)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # needs no writer yet


def _open_writer(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # the reader opened before the barrier
    os.set_blocking(fd, True)
    return fd


def open_channels(
    prefix: str,
    rank: int,
    pairs: list[tuple[int, int]],
    agree: Callable[[bool], bool],
    timeout_s: float,
) -> tuple[dict[int, ShmSender], dict[int, ShmReceiver]] | None:
    """Open this rank's ends of the channels ``pairs`` ((sender, receiver), all on this host).

    Every rank of the pairs calls this with the same arguments but ``rank``. ``agree(ok)``
    synchronises them and says whether every one of them passed ``True``: first after each
    end made what it reads (``ok``: whether this rank could; a ``/dev/shm`` without room, for
    one), then after each opened its peers' files (which fails where two processes thought
    to share a ``/dev/shm`` do not). Returns the senders by receiver and the receivers by
    sender, or ``None`` on every rank when one could not make its part (nothing is left
    open or on disk; the caller sends through something else)."""
    made: list[Path] = []
    rings: list[_Ring] = []
    fds: list[int] = []
    try:
        ok = True
        try:
            for s, r in pairs:
                ring, data, credit = channel_paths(prefix, s, r)
                if r == rank:
                    rings.append(_Ring(ring, create=True))  # unlinks its file itself if it fails
                    made.append(ring)
                    fds.append(_open_reader(data, made))
                elif s == rank:
                    fds.append(_open_reader(credit, made))
        except (OSError, ChannelError) as exc:
            log.warning("rank %d: no shared-memory channels for %s, the caller's fallback carries them: %s",
                        rank, prefix, exc)
            ok = False
        if not agree(ok):
            for mapped in rings:
                mapped.close()
            for fd in fds:
                os.close(fd)
            return None
        senders: dict[int, ShmSender] = {}
        receivers: dict[int, ShmReceiver] = {}
        opened = iter(fds)  # in the order of ``pairs``, as made above
        mapped_rings = iter(rings)
        try:
            for s, r in pairs:
                ring, data, credit = channel_paths(prefix, s, r)
                what = f"shm {s}->{r}"
                if r == rank:
                    receivers[s] = ShmReceiver(next(mapped_rings), next(opened), -1, timeout_s, what)
                    receivers[s].credit_fd = _open_writer(credit)
                elif s == rank:
                    sender = ShmSender(_Ring(ring, create=False), -1, next(opened), timeout_s, what)
                    senders[r] = sender
                    sender.data_fd = _open_writer(data)
        except OSError as exc:  # the peer's files are not here: not one /dev/shm after all
            log.warning("rank %d: cannot open its peers' ends of %s: %s", rank, prefix, exc)
            ok = False
        if not agree(ok):
            for end in (*senders.values(), *receivers.values()):
                end.close()
            for mapped in mapped_rings:
                mapped.close()
            for fd in opened:
                os.close(fd)
            return None
        return senders, receivers
    finally:
        for path in made:
            try:
                path.unlink()
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
