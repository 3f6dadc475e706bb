"""The rendezvous port: free, and outside the ranges other sockets take ports from."""

from __future__ import annotations

import socket

from piper_runtime.runtime import _ephemeral_ports, _free_port


def test_rendezvous_port_is_free_and_not_ephemeral() -> None:
    low, high = _ephemeral_ports()
    assert 1024 < low <= high
    for _ in range(20):
        port = _free_port()
        assert 20000 <= port < low  # never where outgoing connections get their ports
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # and nothing listens there
