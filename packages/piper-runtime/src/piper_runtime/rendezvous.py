"""Where the ranks of one world meet, and which network interface their sockets use.

- **Address.** All ranks on one node: ``127.0.0.1``, so nothing we open listens beyond
  loopback. Ranks on several nodes: the address Ray reports for the node hosting rank 0
  (``piper_runtime.driver.placement`` knows it); never a hard-coded loopback.
- **Port.** Chosen *on rank 0's node*, by rank 0's own process (``open_listener``): it binds
  a socket to the address, outside the kernel's ephemeral range, listens at once and keeps
  it until its TCP store takes it over. Nothing can take the port in between (a port merely
  found free could be taken by any outgoing connection before rank 0 listened).
- **Store.** torch's ``TCPStore`` alone listens on every interface (``::``) whatever host it
  is given. ``make_store`` hands it the socket above (``master_listen_fd``), so the store
  listens on that one address only; backends pass the store to ``init_process_group(store=)``.
  Under a launcher that already serves a store (torchrun's agent: ``driver.spmd_ranks``), the
  runtime ``attach_store``s that address and port first: then every rank, rank 0 included, is
  a client there, in a namespace of the launch's own, and nothing is opened here.
- **Clients.** torch's store client retries connecting for the timeout, but once connected it
  waits for the server's first answer without any bound: a port held by something that is not
  a store (a user's ``MASTER_PORT`` naming another service) hung a rank forever.
  ``store_client`` makes it on a thread of its own and gives up after the timeout and
  ``CLIENT_GRACE_S``, naming the address.
- **Interfaces.** gloo and NCCL bind their own sockets to an interface named by
  ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``. ``set_socket_interfaces`` sets them, unless the
  user did, to the interface owning this rank's address: loopback (``lo``) on one node, else
  the local address this node uses to reach rank 0 (on rank 0's node, that address itself).
  Interface names differ between machines, so each rank finds its own.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import random
import socket
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
PORTS_FROM = 20000  # above Ray's worker ports (10002-19999), below the ephemeral range
SOCKET_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

CLIENT_GRACE_S = 5.0  # past a store client's own timeout, before it is given up (module doc)

_LISTENERS: dict[tuple[str, int], socket.socket] = {}  # opened here, not yet taken by a store
_ATTACHED: dict[tuple[str, int], str] = {}  # served by a launcher: every rank a client, under this prefix
_LOCK = threading.Lock()


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux; the usual default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bind(address: str) -> socket.socket:
    """A TCP socket bound to ``address`` on a free port outside the ephemeral range (where
    every outgoing connection, gloo's pairs and Ray's, takes its local port) and outside Ray's
    worker ports; any free port if there is no room there."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    low = ephemeral_ports()[0]
    candidates = random.sample(range(PORTS_FROM, low), min(64, max(0, low - PORTS_FROM)))
    for port in [*candidates, 0]:
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.bind((address, port))
        except OSError:
            s.close()
            continue
        return s
    raise OSError(f"no free port on {address}")


def free_port(address: str = LOOPBACK) -> int:
    """A port that was free on ``address`` a moment ago (for tests and tools; the runtime
    keeps the socket instead, ``open_listener``)."""
    with _bind(address) as s:
        return s.getsockname()[1]


def open_listener(address: str) -> int:
    """Bind and listen on ``address`` (a free port, see ``_bind``) in this process, keep the
    socket for ``make_store`` on this process's rank 0, and return the port."""
    s = _bind(address)
    s.listen(1024)
    port = s.getsockname()[1]
    with _LOCK:
        _LISTENERS[(address, port)] = s
    return port


def close_listeners() -> None:
    """Close the sockets ``open_listener`` opened that no store took over."""
    with _LOCK:
        sockets = list(_LISTENERS.values())
        _LISTENERS.clear()
    for s in sockets:
        s.close()


def attach_store(address: str, port: int, prefix: str) -> None:
    """Say that a launcher serves the store at ``address:port`` (torchrun's agent): from now on
    ``make_store`` connects every rank there as a client, its keys under ``prefix`` (a launch
    and a runtime of its own: the store outlives both)."""
    with _LOCK:
        _ATTACHED[(address, port)] = prefix


def make_store(rank: int, world_size: int, address: str, port: int, timeout_s: float) -> Any:
    """The world's TCP store: on rank 0 a server listening on ``address`` only (on the socket
    ``open_listener`` kept, or one bound here), elsewhere a client of it; where a launcher
    serves it (``attach_store``), a client on every rank."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    with _LOCK:
        prefix = _ATTACHED.get((address, port))
    if prefix is not None:
        return dist.PrefixStore(prefix, store_client(address, port, world_size, timeout_s))
    if rank != 0:
        return store_client(address, port, world_size, timeout_s)
    with _LOCK:
        sock = _LISTENERS.pop((address, port), None)
    if sock is None:
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((address, port))
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
    try:
        store = dist.TCPStore(
            address, port, world_size, True, timeout=timeout, wait_for_workers=False, master_listen_fd=sock.fileno()
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it when it goes
    return store


def store_client(address: str, port: int, world_size: int, timeout_s: float) -> Any:
    """A client of the TCP store at ``address:port``, or ``DistStoreError`` within ``timeout_s``
    and ``CLIENT_GRACE_S`` (module doc). The thread of a client given up stays blocked; it is a
    daemon, and the run fails."""
    import torch.distributed as dist

    made: dict[str, Any] = {}

    def make() -> None:
        try:
            made["store"] = dist.TCPStore(address, port, world_size, False,
                                          timeout=datetime.timedelta(seconds=timeout_s))
        except BaseException as exc:  # raised on the caller's thread below
            made["error"] = exc

    thread = threading.Thread(target=make, name=f"piper-store-client-{address}:{port}", daemon=True)
    thread.start()
    thread.join(timeout_s + CLIENT_GRACE_S)
    if "error" in made:
        raise made["error"]
    if "store" not in made:
        raise dist.DistStoreError(
            f"the TCP store at {address}:{port} did not answer within {timeout_s + CLIENT_GRACE_S:g} s: the connection "
            "was accepted, but by no store (is another service on that port?)"
        )
    return made["store"]


# -- interfaces ---------------------------------------------------------------------------------

Table = Mapping[str, Sequence[tuple[str, int]]]  # interface -> (address, prefix length)


def match_interface(address: str, table: Table) -> str | None:
    """The interface in ``table`` that owns ``address``: the one holding it exactly, else the
    one whose network contains it (e.g. 127.0.0.2 on ``lo``); ``None`` if none does."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, entries in table.items():
        if any(ipaddress.ip_address(a) == wanted for a, _ in entries):
            return name
    for name, entries in table.items():
        for a, prefix in entries:
            net = ipaddress.ip_network(f"{a}/{prefix}", strict=False)
            if net.version == wanted.version and wanted in net:
                return name
    return None


def interface_table() -> dict[str, list[tuple[str, int]]]:
    """This machine's interfaces and their addresses (Linux: IPv4 by ioctl, IPv6 from
    /proc/net/if_inet6); empty where neither is available."""
    table: dict[str, list[tuple[str, int]]] = {}
    with contextlib.suppress(ImportError, OSError):
        import fcntl

        siocgifaddr, siocgifnetmask = 0x8915, 0x891B
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                packed = struct.pack("256s", name.encode()[:15])
                try:
                    addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, packed)[20:24])
                    mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifnetmask, packed)[20:24])
                except OSError:
                    continue  # no IPv4 address on this interface
                prefix = ipaddress.ip_interface(f"{addr}/{mask}").network.prefixlen  # netmask -> /bits
                table.setdefault(name, []).append((addr, prefix))
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            hexaddr, _index, prefix, _scope, _flags, name = line.split()
            addr = str(ipaddress.ip_address(bytes.fromhex(hexaddr)))
            table.setdefault(name, []).append((addr, int(prefix, 16)))
    return table


def local_address_towards(address: str) -> str:
    """The local address this machine uses to reach ``address`` (no packet is sent: a UDP
    socket's ``connect`` only picks the route)."""
    if is_loopback(address):
        return address
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return s.getsockname()[0]


def set_socket_interfaces(
    master_address: str,
    names: Sequence[str] = SOCKET_ENV,
    environ: dict[str, str] | None = None,
    table: Table | None = None,
) -> dict[str, str]:
    """Set each of ``names`` that is not set yet to the interface owning this rank's address
    (module doc); returns what they are now. Leaves them unset where no interface owns it
    (gloo and NCCL then choose by themselves)."""
    import os

    env = os.environ if environ is None else environ
    missing = [n for n in names if not env.get(n)]
    if missing:
        try:
            own = local_address_towards(master_address)
        except OSError:
            own = master_address
        name = match_interface(own, interface_table() if table is None else table)
        if name is not None:
            for n in missing:
                env[n] = name
    return {n: env[n] for n in names if env.get(n)}
