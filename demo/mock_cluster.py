"""librdkafka's mock cluster (from the ``confluent-kafka`` wheel): a second Kafka implementation for the tests.

The mock cluster is a set of Kafka protocol servers on loopback that live inside a librdkafka client handle, so it
runs in a small dedicated child process (``python -m demo.mock_cluster``). The child creates the cluster with
librdkafka's mock API, prints ``bootstrap=<host:port,...>`` on stdout, then serves commands on stdin (one a line,
answered with one ``ok ...`` or ``error ...`` line) until stdin closes or it receives SIGTERM:

``topic <name> <partitions> <replication>``
    create a topic. The mock cluster does not implement the CreateTopics request (nor DescribeConfigs,
    DeleteTopics, ListGroups, DescribeGroups), so topics are created through this command, or auto-created with
    4 partitions when a client asks for their metadata with auto-creation allowed.
``rebalance-delay <ms>``
    the group coordinator's initial rebalance delay (``group.initial.rebalance.delay.ms``, 3000 by default).

``start_mock_cluster()`` returns a :class:`MockCluster` with the surface of
:class:`demo.embedded_broker.EmbeddedBroker` (``url``, ``bootstrap``, ``port``, ``process``, ``stop()``).
Only the tests use it; ``confluent-kafka`` (a dev dependency) is imported in the child only.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rebound.errors import BrokerStartError

BOOTSTRAP_PREFIX = "bootstrap="
DEFAULT_AUTO_CREATE_PARTITIONS = 4  # librdkafka's mock default for auto-created topics
_RD_KAFKA_PRODUCER = 0
_RD_KAFKA_CONF_OK = 0
_TOPIC_ALREADY_EXISTS = 36  # Kafka error code


@dataclass
class MockCluster:
    """A child process holding a librdkafka mock cluster; ``url`` is what ``REBOUND_BROKER`` should be set to."""

    process: subprocess.Popen[bytes]
    brokers: list[str]
    _lines: queue.Queue[str | None] = field(default_factory=queue.Queue, repr=False)
    _reader: threading.Thread | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def bootstrap(self) -> str:
        return ",".join(self.brokers)

    @property
    def url(self) -> str:
        return ",".join(f"kafka://{broker}" for broker in self.brokers)

    @property
    def port(self) -> int:
        """The first broker's port."""
        return int(self.brokers[0].rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        return self.process.pid

    def command(self, line: str, timeout: float = 10.0) -> str:
        """Send one control command to the child and return its answer (without the ``ok`` prefix)."""
        with self._lock:
            if self.process.poll() is not None or self.process.stdin is None:
                raise BrokerStartError(f"the mock cluster exited with code {self.process.returncode}")
            self.process.stdin.write(line.encode() + b"\n")
            self.process.stdin.flush()
            try:
                answer = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise BrokerStartError(f"the mock cluster did not answer {line!r} within {timeout}s") from None
        if answer is None:
            raise BrokerStartError(f"the mock cluster exited while answering {line!r}")
        status, _, detail = answer.partition(" ")
        if status != "ok":
            raise BrokerStartError(f"the mock cluster refused {line!r}: {detail}")
        return detail

    def create_topics(self, topics: list[str], partitions: int, replication: int = 1) -> None:
        """Create topics; an existing topic keeps its partitions (as with CreateTopics, whose error we ignore)."""
        for topic in topics:
            self.command(f"topic {topic} {partitions} {replication}")

    def set_initial_rebalance_delay(self, ms: int) -> None:
        self.command(f"rebalance-delay {ms}")

    def stop(self, timeout: float = 10.0) -> None:
        """Close the child's stdin (its normal way out), then SIGTERM, then SIGKILL."""
        if self.process.poll() is None and self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _terminate(self.process, timeout)
        _close_pipes(self.process, self._reader)


def _terminate(process: subprocess.Popen[bytes], timeout: float) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout)


def _close_pipes(process: subprocess.Popen[bytes], reader: threading.Thread | None) -> None:
    """Once the child is gone: its stdin, and its stdout after the reader thread saw the end of it."""
    if process.stdin is not None:
        with contextlib.suppress(OSError):
            process.stdin.close()
    if reader is not None:
        reader.join(timeout=2)
    if process.stdout is not None and (reader is None or not reader.is_alive()):
        process.stdout.close()


def _read_lines(fd: int, lines: queue.Queue[str | None]) -> None:
    """Put each line read from ``fd`` on ``lines``, then None at end of file.

    Reads the raw descriptor: a daemon thread blocked in a buffered reader's ``readline`` makes the interpreter abort
    at exit (it cannot take the reader's lock), which would turn a clean SIGTERM exit into SIGABRT.
    """
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            lines.put(raw.decode(errors="replace").strip())
    if pending:
        lines.put(pending.decode(errors="replace").strip())
    lines.put(None)


def start_mock_cluster(
    brokers: int = 3, *, startup_timeout: float = 10.0, log_path: Path | None = None, rebalance_delay_ms: int = -1
) -> MockCluster:
    """Start a mock cluster of ``brokers`` brokers in a child process.

    Raises :class:`BrokerStartError` if the child does not announce its bootstrap servers within ``startup_timeout``
    seconds. The child's stderr (librdkafka's own log lines) goes to ``log_path``. ``rebalance_delay_ms`` >= 0 sets
    the group coordinator's initial rebalance delay (librdkafka's default is Kafka's: 3000 ms).
    """
    command = [sys.executable, "-m", "demo.mock_cluster", "--brokers", str(brokers)]
    if rebalance_delay_ms >= 0:
        command += ["--rebalance-delay-ms", str(rebalance_delay_ms)]
    with open(log_path or os.devnull, "ab") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=Path(__file__).resolve().parent.parent,
            start_new_session=True,
        )
    assert process.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(
        target=_read_lines, args=(process.stdout.fileno(), lines), name="mock-cluster-out", daemon=True
    )
    reader.start()
    see_log = f" (see {log_path})" if log_path else ""
    deadline = time.monotonic() + startup_timeout
    line: str | None = ""
    while line is not None and not line.startswith(BOOTSTRAP_PREFIX):
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            _terminate(process, timeout=2)
            _close_pipes(process, reader)
            raise BrokerStartError(
                f"the librdkafka mock cluster did not announce its bootstrap servers within {startup_timeout}s"
                + see_log
            ) from None
    if line is None:
        _terminate(process, timeout=5)
        _close_pipes(process, reader)
        raise BrokerStartError(
            f"the librdkafka mock cluster exited with code {process.returncode} before announcing its bootstrap "
            f"servers{see_log}; it needs confluent-kafka (a dev dependency)"
        )
    servers = [part for part in line[len(BOOTSTRAP_PREFIX) :].split(",") if part]
    cluster = MockCluster(process=process, brokers=servers, _lines=lines, _reader=reader)
    if not servers:
        cluster.stop(timeout=2)
        raise BrokerStartError(f"the librdkafka mock cluster announced no bootstrap servers: {line!r}")
    return cluster


# ---------------------------------------------------------------------------------------------- the child process


def _librdkafka_path() -> str:
    """The librdkafka that ``confluent_kafka`` itself loaded (the wheel bundles its own copy)."""
    import confluent_kafka

    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "librdkafka" in os.path.basename(path) and os.path.exists(path):
                return path
    package = Path(confluent_kafka.__file__).resolve().parent
    for pattern in (
        str(package.parent / "confluent_kafka.libs" / "librdkafka*"),  # Linux wheels (auditwheel)
        str(package / ".dylibs" / "librdkafka*"),  # macOS wheels (delocate)
        str(package.parent / "confluent_kafka.libs" / "librdkafka*.dll"),  # Windows wheels
    ):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    import ctypes.util

    system = ctypes.util.find_library("rdkafka")
    if system is None:
        raise BrokerStartError("cannot find the librdkafka library that confluent-kafka uses")
    return system


class _Librdkafka:
    """The few C functions of librdkafka's mock API (``rdkafka_mock.h``) the child needs."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(_librdkafka_path())
        self.lib: Any = lib
        lib.rd_kafka_version_str.restype = ctypes.c_char_p
        lib.rd_kafka_conf_new.restype = ctypes.c_void_p
        lib.rd_kafka_conf_set.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.rd_kafka_conf_set.restype = ctypes.c_int
        lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.rd_kafka_new.restype = ctypes.c_void_p
        lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
        lib.rd_kafka_mock_cluster_destroy.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
        lib.rd_kafka_mock_topic_create.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        lib.rd_kafka_mock_topic_create.restype = ctypes.c_int
        lib.rd_kafka_mock_group_initial_rebalance_delay_ms.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.rd_kafka_err2str.argtypes = [ctypes.c_int]
        lib.rd_kafka_err2str.restype = ctypes.c_char_p

    def version(self) -> str:
        return bytes(self.lib.rd_kafka_version_str()).decode()

    def error(self, code: int) -> str:
        return bytes(self.lib.rd_kafka_err2str(code)).decode()


class _Cluster:
    def __init__(self, brokers: int) -> None:
        self.rd = _Librdkafka()
        lib = self.rd.lib
        errstr = ctypes.create_string_buffer(512)
        conf = lib.rd_kafka_conf_new()
        # The handle only hosts the cluster; it has no brokers of its own, so keep its logs to real problems.
        for name, value in ((b"log_level", b"4"), (b"client.id", b"rebound-mock-cluster")):
            if lib.rd_kafka_conf_set(conf, name, value, errstr, len(errstr)) != _RD_KAFKA_CONF_OK:
                raise BrokerStartError(f"librdkafka config {name.decode()}: {errstr.value.decode()}")
        self.rk = lib.rd_kafka_new(_RD_KAFKA_PRODUCER, conf, errstr, len(errstr))
        if not self.rk:
            raise BrokerStartError(f"librdkafka handle: {errstr.value.decode()}")
        self.mcluster = lib.rd_kafka_mock_cluster_new(self.rk, brokers)
        if not self.mcluster:
            lib.rd_kafka_destroy(self.rk)
            raise BrokerStartError("rd_kafka_mock_cluster_new failed")

    @property
    def bootstrap(self) -> str:
        return bytes(self.rd.lib.rd_kafka_mock_cluster_bootstraps(self.mcluster)).decode()

    def handle(self, line: str) -> str:
        words = line.split()
        if not words:
            return "error empty command"
        if words[0] == "topic" and len(words) == 4:
            name, partitions, replication = words[1], int(words[2]), int(words[3])
            if partitions < 1 or replication < 1:
                return f"error topic {name}: partitions and replication must be at least 1"
            code = self.rd.lib.rd_kafka_mock_topic_create(self.mcluster, name.encode(), partitions, replication)
            if code == 0:
                return f"ok created {name}"
            if code == _TOPIC_ALREADY_EXISTS:
                return f"ok exists {name}"  # it keeps its partitions, as with CreateTopics
            return f"error topic {name}: {self.rd.error(code)}"
        if words[0] == "rebalance-delay" and len(words) == 2:
            self.rd.lib.rd_kafka_mock_group_initial_rebalance_delay_ms(self.mcluster, int(words[1]))
            return "ok"
        if words[0] == "ping":
            return "ok pong"
        return f"error unknown command {line!r}"

    def close(self) -> None:
        self.rd.lib.rd_kafka_mock_cluster_destroy(self.mcluster)
        self.rd.lib.rd_kafka_destroy(self.rk)


def main(argv: list[str] | None = None) -> int:
    """``python -m demo.mock_cluster``: run a mock cluster until stdin closes or SIGTERM/SIGINT arrives."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--brokers", type=int, default=3)
    parser.add_argument("--rebalance-delay-ms", type=int, default=-1)
    args = parser.parse_args(argv)
    # librdkafka's threads inherit the signal mask of the thread that starts them: with SIGTERM/SIGINT blocked while
    # they start, only the Python main thread receives them. Delivered to librdkafka's mock thread instead, a SIGTERM
    # interrupts its poll ("failed to poll ... Interrupted system call") and rd_kafka_mock_cluster_destroy then waits
    # for that thread for ever (seen in 2 of 20 stops).
    stopping_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stopping_signals)
    try:
        cluster = _Cluster(args.brokers)
    except (BrokerStartError, OSError, AttributeError, ImportError) as exc:
        print(f"mock cluster could not start: {exc!r}", file=sys.stderr, flush=True)
        return 2
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping_signals)
    stop = threading.Event()

    def _stop(*_: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        if args.rebalance_delay_ms >= 0:
            cluster.handle(f"rebalance-delay {args.rebalance_delay_ms}")
        print(f"librdkafka {cluster.rd.version()} mock cluster: {cluster.bootstrap}", file=sys.stderr, flush=True)
        print(f"{BOOTSTRAP_PREFIX}{cluster.bootstrap}", flush=True)
        commands: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_read_lines, args=(sys.stdin.fileno(), commands), daemon=True).start()
        while not stop.is_set():
            try:
                command = commands.get(timeout=0.2)
            except queue.Empty:
                continue
            if command is None:
                break  # the parent closed stdin (or died): shut down
            try:
                answer = cluster.handle(command)
            except ValueError as exc:
                answer = f"error {exc}"
            print(answer, flush=True)
    finally:
        cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
