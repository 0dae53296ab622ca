"""Spark's JVM going away under a stopping stream prints no py4j traceback (pipeline/common.py).

py4j reports a failed command with ``logging.exception`` on the root logger (``java_gateway.py``, ``send_command``)
and then raises the error; the facts stream either reports that error itself or takes it as Spark's shutdown under a
requested stop. The traceback on stderr was a failure's look on a clean stop (seen in CI: a SIGTERM to the whole
process group, the JVM gone between two polls of the query).
"""

from __future__ import annotations

import logging
import sys

import pytest

from pipeline.common import quiet_py4j_disconnects


def _py4j_report(error: BaseException) -> logging.LogRecord:
    from py4j import java_gateway

    try:
        raise error
    except BaseException:
        exc_info = sys.exc_info()
    return logging.getLogger().makeRecord(
        "root", logging.ERROR, java_gateway.__file__, 1060, "Exception while sending command.", (), exc_info
    )


def _emitted(record: logging.LogRecord, caplog: pytest.LogCaptureFixture) -> bool:
    caplog.clear()
    logging.getLogger().handle(record)
    return any(r.getMessage() == record.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def test_py4j_network_errors_are_one_debug_line_while_quieted(caplog: pytest.LogCaptureFixture) -> None:
    from py4j.protocol import Py4JNetworkError

    caplog.set_level(logging.DEBUG)
    reset = _py4j_report(Py4JNetworkError("Error while sending or receiving"))
    refused = _py4j_report(ConnectionRefusedError(111, "Connection refused"))
    assert _emitted(reset, caplog), "py4j's own report, outside the quieted scope"
    with quiet_py4j_disconnects():
        assert not _emitted(reset, caplog)
        assert any("py4j" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
        assert not _emitted(refused, caplog)
    assert _emitted(reset, caplog), "the filter is removed when the scope ends"


def test_other_py4j_errors_and_other_loggers_are_untouched(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with quiet_py4j_disconnects():
        assert _emitted(_py4j_report(ValueError("a bug in a command")), caplog)
        record = _py4j_report(ConnectionResetError(104, "reset"))
        record.pathname = __file__  # the same error from somewhere else than py4j
        assert _emitted(record, caplog)
