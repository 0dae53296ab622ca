"""A stopping job's JVM closing the accumulator connection prints no traceback (pipeline/common.py)."""

from __future__ import annotations

import pytest

from pipeline.common import quiet_accumulator_disconnects


def _report(error: BaseException) -> None:
    from pyspark.accumulators import AccumulatorTCPServer

    server = AccumulatorTCPServer.__new__(AccumulatorTCPServer)  # no socket: only its error report is exercised
    try:
        raise error
    except BaseException:
        server.handle_error(None, ("127.0.0.1", 1))


def test_a_connection_closed_by_the_jvm_is_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from pyspark.accumulators import AccumulatorTCPServer

    if not getattr(AccumulatorTCPServer, "_rebound_quiet_disconnects", False):  # this process has not quieted it yet
        _report(EOFError())
        assert "Traceback" in capsys.readouterr().err, "PySpark's own report, before the change"
    quiet_accumulator_disconnects()
    quiet_accumulator_disconnects()  # once is enough; twice changes nothing
    _report(EOFError())
    _report(ConnectionResetError(104, "reset"))
    assert capsys.readouterr().err == ""


def test_other_errors_are_still_reported(capsys: pytest.CaptureFixture[str]) -> None:
    quiet_accumulator_disconnects()
    _report(ValueError("an accumulator bug"))
    err = capsys.readouterr().err
    assert "Traceback" in err and "an accumulator bug" in err
