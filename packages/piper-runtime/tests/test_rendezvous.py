"""The rendezvous: a free port outside the ranges other sockets take ports from, a TCP store
that listens on the rendezvous address only, the interface each rank's sockets use."""

from __future__ import annotations

import socket

import pytest

from piper_runtime import rendezvous
from piper_runtime.rendezvous import (
    LOOPBACK,
    close_listeners,
    ephemeral_ports,
    free_port,
    interface_table,
    make_store,
    match_interface,
    open_listener,
    set_socket_interfaces,
)
from piper_runtime.testing import listening

WILDCARDS = {"0.0.0.0", "::"}


def test_rendezvous_port_is_free_and_not_ephemeral() -> None:
    low, high = ephemeral_ports()
    assert 1024 < low <= high
    for _ in range(20):
        port = free_port()
        assert 20000 <= port < low  # never where outgoing connections get their ports
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # and nothing listens there


def test_the_store_listens_on_the_rendezvous_address_only() -> None:
    before = set(listening())
    port = open_listener("127.0.0.1")
    assert ("127.0.0.1", port) in set(listening()) - before  # listening from the moment it is chosen
    store = make_store(0, 2, "127.0.0.1", port, 10.0)
    client = make_store(1, 2, "127.0.0.1", port, 10.0)
    store.set("k", "v")
    assert client.get("k") == b"v"
    opened = set(listening()) - before
    assert opened == {("127.0.0.1", port)}, opened
    assert not {a for a, _ in opened} & WILDCARDS
    del client, store
    close_listeners()


def test_a_plain_tcpstore_would_listen_on_every_interface() -> None:
    """What make_store avoids (so the test above can fail): torch's own store ignores the
    host for listening."""
    import datetime

    import torch.distributed as dist

    before = set(listening())
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    opened = set(listening()) - before
    assert {a for a, _ in opened} & WILDCARDS, opened
    del store


def test_interfaces_are_matched_by_address_then_by_network() -> None:
    table = {"lo": [("127.0.0.1", 8), ("::1", 128)], "eth0": [("10.1.2.3", 24), ("fd00::2", 64)]}
    assert match_interface("127.0.0.1", table) == "lo"
    assert match_interface("127.0.0.2", table) == "lo"  # in lo's network
    assert match_interface("10.1.2.3", table) == "eth0"
    assert match_interface("10.1.2.99", table) == "eth0"
    assert match_interface("fd00::7", table) == "eth0"
    assert match_interface("::1", table) == "lo"
    assert match_interface("192.168.0.1", table) is None
    assert match_interface("not-an-address", table) is None


def test_this_machine_has_loopback_in_its_table() -> None:
    table = interface_table()
    assert match_interface("127.0.0.1", table) is not None
    # The netmask read from the kernel becomes the prefix length: loopback is 127.0.0.0/8.
    assert ("127.0.0.1", 8) in table[match_interface("127.0.0.1", table)]


def test_socket_interfaces_follow_the_address_unless_the_user_set_them(monkeypatch) -> None:
    table = {"lo": [("127.0.0.1", 8)], "ens5": [("10.0.0.5", 16)]}
    env: dict[str, str] = {}
    assert set_socket_interfaces("127.0.0.1", environ=env, table=table) == {
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    # Several nodes: the interface of the local address that reaches rank 0's.
    monkeypatch.setattr(rendezvous, "local_address_towards", lambda address: "10.0.0.7")
    env = {"NCCL_SOCKET_IFNAME": "ib0"}  # the user's choice stays
    assert set_socket_interfaces("10.0.0.5", environ=env, table=table) == {
        "GLOO_SOCKET_IFNAME": "ens5",
        "NCCL_SOCKET_IFNAME": "ib0",
    }
    env = {}
    monkeypatch.setattr(rendezvous, "local_address_towards", lambda address: "172.16.0.1")
    assert set_socket_interfaces("10.0.0.5", environ=env, table=table) == {}  # nothing owns it: left unset


@pytest.mark.parametrize("address", ["127.0.0.1"])
def test_local_address_towards_loopback_is_loopback(address: str) -> None:
    assert rendezvous.local_address_towards(address) == address


def test_a_port_held_by_something_else_than_a_store_fails_in_bounded_time(monkeypatch) -> None:
    """torch's store client, connected to a server that never answers, would wait forever."""
    import threading
    import time

    import torch.distributed as dist

    silent = socket.socket()
    silent.bind((LOOPBACK, 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    monkeypatch.setattr(rendezvous, "CLIENT_GRACE_S", 0.5)
    started = time.monotonic()
    try:
        with pytest.raises(dist.DistStoreError, match=rf"store at {LOOPBACK}:{port} did not answer within 1.5 s"):
            rendezvous.make_store(1, 2, LOOPBACK, port, 1.0)  # a rank other than 0: a client
    finally:
        for s in (silent, *accepted):
            s.close()
    assert accepted and time.monotonic() - started < 10
