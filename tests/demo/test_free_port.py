"""The ports the project's servers are started on (a broker, a worker's web server, a reference service)."""

from __future__ import annotations

import socket

import pytest

from demo import embedded_broker
from demo.embedded_broker import free_port


def test_a_free_port_is_outside_the_ephemeral_range_and_bindable_on_every_address() -> None:
    """A port from the ephemeral range can be an outgoing connection's the moment after it is picked (a worker's web
    server failed to bind in CI: ``address already in use``)."""
    low, high = embedded_broker._ephemeral_range()
    for _ in range(50):
        port = free_port()
        assert not low <= port <= high, port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("0.0.0.0", port))


def _taken_and_free_neighbour() -> tuple[socket.socket, int]:
    """A bound socket on a port outside the ephemeral range whose next port is free too.

    Outside the range on purpose: in CI a neighbour of a port from ``bind(0)`` was some Kafka client's outgoing
    connection at that moment (the test failed there), and only explicit binds take ports outside it.
    """
    low, high = embedded_broker._ephemeral_range()
    for _ in range(100):
        port = free_port()
        neighbour = port + 1
        if low <= neighbour <= high or not embedded_broker._bindable(neighbour):
            continue
        taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            taken.bind(("0.0.0.0", port))
        except OSError:
            taken.close()
            continue
        return taken, neighbour
    raise AssertionError("no two neighbouring free ports outside the ephemeral range")


def test_a_port_in_use_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every candidate but one taken, that one comes back."""
    taken, neighbour = _taken_and_free_neighbour()
    with taken:
        busy = taken.getsockname()[1]
        monkeypatch.setattr(embedded_broker, "_LISTEN_PORTS", (busy, busy + 2))
        assert {free_port() for _ in range(20)} == {neighbour}
