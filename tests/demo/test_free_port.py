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


def test_a_port_in_use_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every candidate but one taken, that one comes back."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("0.0.0.0", 0))
        busy = taken.getsockname()[1]
        monkeypatch.setattr(embedded_broker, "_LISTEN_PORTS", (busy, busy + 2))
        monkeypatch.setattr(embedded_broker, "_ephemeral_range", lambda: (1, 0))
        assert {free_port() for _ in range(20)} == {busy + 1}
