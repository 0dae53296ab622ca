"""The contract with aiohttp for the HTTP push handler's idle probe (``app/http_handler.py``, ``_probe``).

The probe opens a connection the way a call does and sends nothing, so it builds a bare ``aiohttp.ClientRequest`` and
hands it to the calls' connector (``BaseConnector.connect``). aiohttp documents neither for direct use; they hold in the
release the constraints pin (3.14). A failure here names what changed: see docs/upgrading.md, and docs/push-handlers.md for the probe.
"""

from __future__ import annotations

import asyncio
import inspect
from importlib.metadata import version

import aiohttp
import pytest
import yarl


def _broken(what: str, detail: str) -> str:
    return (
        f"{what} changed in aiohttp {version('aiohttp')} ({detail}): the push handler's idle probe "
        "(app/http_handler.py, _probe) relies on it. See docs/upgrading.md."
    )


def test_connector_connect_takes_a_request_its_traces_and_a_timeout() -> None:
    connect = aiohttp.BaseConnector.connect
    params = list(inspect.signature(connect).parameters)[1:]
    assert params[:3] == ["req", "traces", "timeout"], _broken("BaseConnector.connect", f"parameters {params}")
    assert inspect.iscoroutinefunction(connect), _broken("BaseConnector.connect", "no longer a coroutine function")


async def test_a_bare_client_request_carries_what_the_connector_reads() -> None:
    url = "https://service.example:8443/deliver?token=x"
    try:
        request = aiohttp.ClientRequest("GET", yarl.URL(url), loop=asyncio.get_running_loop())
    except TypeError as exc:
        pytest.fail(_broken("ClientRequest(method, url, loop=...)", str(exc)))
    assert (request.host, request.port, request.is_ssl()) == ("service.example", 8443, True), _broken(
        "ClientRequest's host, port or is_ssl()", f"{request.host}, {request.port}, {request.is_ssl()}"
    )
    assert request.ssl is True, _broken("ClientRequest.ssl default", repr(request.ssl))
