"""A configuration mistake stops ``faust -A app worker`` cleanly, before anything connects (issue 24, item 4).

Each case must end the process with exit status 78 (``EX_CONFIG``, ``app/startup.py``) and one line naming the
variable and saying how to fix it, with no traceback, and before the worker connects anywhere: ``REBOUND_BROKER``
points at a listening socket of the test's own, which must see no connection. No broker is needed.

The same cases run twice: in this process, through ``app.app`` as Faust's command line reads it (fast, no child
process), and through the real entry point ``.venv/bin/faust -A app worker`` in a subprocess. A control run with
valid settings shows the socket does catch a worker's connection, so "no connection" is a finding, not a blind spot.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from json import JSONDecodeError
from pathlib import Path

import pytest

import app as app_package
from app import provisioning
from app.cli import cli_app
from app.handlers import HandlerImportError, HandlerStartError, load_handler
from app.provisioning import BrokerUnavailableError
from app.startup import EX_CONFIG, EX_TEMPFAIL, debug_requested
from rebound.errors import ConfigurationError
from rebound.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
FAUST = Path(sys.executable).parent / "faust"
WORKER = [str(FAUST), "-A", "app", "worker"]  # the Procfile's command, as the console script's argv
HANDLERS = """
async def handle(event):
    return None


def not_async(event):
    return None


async def two_arguments(event, other):
    return None


NOT_A_FUNCTION = 3
"""
GOOD = "startup_handlers:handle"
# Handler modules that are found but fail while they are imported: one line naming the exception and where it was
# raised, exit 78 for an ImportError or SyntaxError (the code or its dependencies are broken), 1 for any other
# exception (it may be transient: a restart may help); the traceback only with -l debug. Paths in the handlers folder.
BROKEN_MODULES = {
    "broken_from_import.py": "from os import no_such_name\n",
    "broken_dependency.py": "import json\nimport no_such_dependency_of_the_handler\n",
    "broken_syntax.py": "import json\n\n\nasync def handle(event:\n",
    "broken_at_import.py": "import json\n\nraise RuntimeError('the handler module failed at import')\n",
    "broken_in_a_call.py": "import json\n\n\ndef setup():\n    return json.loads('{bad')\n\n\nCONFIG = setup()\n",
    "broken_null.py": "import json\nx = 1\0\n",
    "broken_str.py": "class Odd(Exception):\n    def __str__(self):\n        raise ValueError('no str')\n\n\nraise Odd()\n",
    "broken_escape.py": "raise RuntimeError('vault \\x1b[2J\\x1b[31munreachable')\n",
    "brokenpkg/__init__.py": "",
    "brokenpkg/db.py": "import os\nraise ConnectionRefusedError('the database at db:5432 refused')\n",
    "brokenpkg/items.py": "import json\nimport brokenpkg.db\n",
    "brokenpkg/bad_syntax.py": "x = (\n",
    "brokenpkg/imports_bad_syntax.py": "import json\nimport brokenpkg.bad_syntax\n",
    "brokenpkg/null.py": "x = 1\0\n",
    "brokenpkg/imports_null.py": "import json\nimport brokenpkg.null\n",
    "brokenpkg/calls_db.py": "from brokenpkg import connect\n\nCONN = connect.open()\n",
    "brokenpkg/connect.py": "def open():\n    raise TimeoutError('secret store timed out')\n",
}
NULL_BYTES = "source code string cannot contain null bytes"
# (module, class, message, where it was raised, exit status)
BROKEN = [
    pytest.param(
        "broken_from_import", ImportError, "cannot import name 'no_such_name'", "broken_from_import.py:1", 78,
        id="own-import-error",
    ),
    pytest.param(
        "broken_dependency",
        ModuleNotFoundError,
        "No module named 'no_such_dependency_of_the_handler'",
        "broken_dependency.py:2",
        78,
        id="dependency",
    ),
    pytest.param("broken_syntax", SyntaxError, "'(' was never closed", "broken_syntax.py:4", 78, id="syntax-error"),
    pytest.param(
        "brokenpkg.imports_bad_syntax",
        SyntaxError,
        "'(' was never closed",
        "brokenpkg/bad_syntax.py:1 (imported from brokenpkg/imports_bad_syntax.py:2)",
        78,
        id="syntax-error-in-an-imported-module",
    ),
    pytest.param("broken_null", SyntaxError, NULL_BYTES, "broken_null.py", 78, id="null-byte"),
    pytest.param(
        "brokenpkg.imports_null",
        SyntaxError,
        NULL_BYTES,
        "brokenpkg/imports_null.py:2 (in a module imported there)",
        78,
        id="null-byte-in-an-imported-module",
    ),
    pytest.param(
        "broken_at_import", RuntimeError, "the handler module failed at import", "broken_at_import.py:3", 1,
        id="raises-at-import",
    ),
    pytest.param(
        "broken_in_a_call",
        JSONDecodeError,
        "Expecting property name enclosed in double quotes",
        "broken_in_a_call.py:5",  # inside json, called from the module's setup(): its line
        1,
        id="raises-in-a-call",
    ),
    pytest.param(
        "brokenpkg.items",
        ConnectionRefusedError,
        "the database at db:5432 refused",
        "brokenpkg/db.py:2 (imported from brokenpkg/items.py:2)",
        1,
        id="raised-in-an-imported-module",
    ),
    pytest.param(
        "brokenpkg.calls_db",
        TimeoutError,
        "secret store timed out",
        "brokenpkg/connect.py:2 (called from brokenpkg/calls_db.py:3)",
        1,
        id="raised-in-a-call-to-another-module",
    ),
    pytest.param("broken_str", "Odd", None, "broken_str.py:6", 1, id="str-raises"),
    pytest.param(
        "broken_escape", RuntimeError, r"vault \x1b[2J\x1b[31munreachable", "broken_escape.py:1", 1,
        id="control-characters-escaped",
    ),
]  # fmt: skip
CLOSED_BROKER = "kafka://127.0.0.1:1"  # nothing listens on port 1: the connection is refused at once

# (environment, what the one line must contain): the variable, and the part that says what is wrong or what to do.
CASES = [
    pytest.param(
        {"REBOUND_HANDLER": GOOD, "REBOUND_RETRY_SEQUENCE": "5x"},
        ["REBOUND_RETRY_SEQUENCE", "'5x' is not a duration", "e.g. 30s or 5m"],
        id="bad-sequence",
    ),
    pytest.param(
        {"REBOUND_HANDLER": GOOD, "REBOUND_CONCURRENCY": "-3"},
        ["REBOUND_CONCURRENCY='-3'", "must be greater than or equal to 1"],
        id="bad-concurrency",
    ),
    pytest.param(
        {"REBOUND_HANDLER": "nosuch.mod:fn"},
        ["REBOUND_HANDLER=nosuch.mod:fn", "no module named 'nosuch'", "PYTHONPATH"],
        id="unknown-module",
    ),
    pytest.param(
        {"REBOUND_HANDLER": "startup_handlers:missing"},
        ["REBOUND_HANDLER=startup_handlers:missing", "has no 'missing'"],
        id="missing-attribute",
    ),
    pytest.param(
        {"REBOUND_HANDLER": "startup_handlers:not_async"},
        ["REBOUND_HANDLER=startup_handlers:not_async", "not an async function", "async def not_async(event)"],
        id="not-async",
    ),
    pytest.param(
        {"REBOUND_HANDLER": "startup_handlers:two_arguments"},
        ["REBOUND_HANDLER=startup_handlers:two_arguments", "exactly one argument"],
        id="two-arguments",
    ),
    pytest.param(
        {"REBOUND_HANDLER": "startup_handlers:NOT_A_FUNCTION"},
        ["REBOUND_HANDLER=startup_handlers:NOT_A_FUNCTION", "not callable"],
        id="not-callable",
    ),
    pytest.param(
        {"REBOUND_HANDLER": "startup_handlers.handle"},
        ["REBOUND_HANDLER='startup_handlers.handle'", "package.module:callable"],
        id="malformed-handler",
    ),
    pytest.param(
        {"REBOUND_HANDLER": ".startup_handlers:handle"},
        ["REBOUND_HANDLER='.startup_handlers:handle'", "package.module:callable"],
        id="relative-handler",
    ),
    pytest.param(
        {"REBOUND_HANDLER": "startup_handlers..x:handle"},
        ["REBOUND_HANDLER='startup_handlers..x:handle'", "package.module:callable"],
        id="empty-module-part",
    ),
    pytest.param(
        {"REBOUND_HANDLER": GOOD, "REBOUND_STORE": "bogus://"},
        ["REBOUND_STORE='bogus://'", "rocksdb://", "memory://"],
        id="unknown-store",
    ),
    pytest.param(
        {"REBOUND_HANDLER": "https:/orders.internal/events"},
        ["REBOUND_HANDLER='https:/orders.internal/events'", "not a valid URL", "https://host[:port]/path"],
        id="malformed-handler-url",
    ),
    pytest.param(
        {"REBOUND_HANDLER": "ftp://orders.internal/events"},
        ["REBOUND_HANDLER='ftp://orders.internal/events'", "scheme 'ftp' is not supported", "http:// or https://"],
        id="non-http-handler-url",
    ),
    pytest.param(
        {"REBOUND_HANDLER": "https://orders.internal/events", "REBOUND_HTTP_PERMANENT_STATUSES": "4xx,503x"},
        ["REBOUND_HTTP_PERMANENT_STATUSES", "'503x' is not an HTTP status"],
        id="bad-status-list",
    ),
    pytest.param({}, ["REBOUND_HANDLER is not set", "set REBOUND_HANDLER=package.module:callable"], id="no-handler"),
    pytest.param(
        {"REBOUND_HANDLER": " "}, ["REBOUND_HANDLER is not set", "package.module:callable"], id="empty-handler"
    ),
]


class Listener:
    """A TCP socket standing in for the broker: it only records whether anything connected."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = int(self.sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"kafka://127.0.0.1:{self.port}"

    def connected(self, wait_s: float = 0.0) -> bool:
        """Whether a connection arrived (the kernel completes it in the backlog, accepted or not), within ``wait_s``."""
        self.sock.settimeout(wait_s if wait_s > 0 else 0.0)  # 0: non-blocking, only what already arrived
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, TimeoutError):
            return False
        conn.close()
        return True


@pytest.fixture
def listener() -> Iterator[Listener]:
    made = Listener()
    try:
        yield made
    finally:
        made.sock.close()


@pytest.fixture
def handlers_dir(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "handlers"
    folder.mkdir()
    (folder / "startup_handlers.py").write_text(HANDLERS)
    for name, text in BROKEN_MODULES.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    forget_broken_modules()
    yield folder
    forget_broken_modules()


def forget_broken_modules() -> None:
    """A package imported once stays imported (``brokenpkg``, from another test's folder): imported again here."""
    for name in [name for name in sys.modules if name.split(".")[0] == "brokenpkg" or name.startswith("broken_")]:
        del sys.modules[name]


def worker_settings(listener: Listener, tmp_path: Path, **settings: str) -> dict[str, str]:
    """The listener as the broker and a data directory that must never be made, then ``settings``."""
    return {"REBOUND_BROKER": listener.url, "REBOUND_DATA_DIR": str(tmp_path / "data"), **settings}


CONFIGURATION = "rebound: configuration error, not started: "
BROKER_DOWN = "rebound: broker unavailable, not started (temporary: a restart retries): "
HANDLER_FAILED = "rebound: handler module failed while imported, not started (may be temporary: a restart retries): "


def check_message(output: str, expected: list[str], prefix: str = CONFIGURATION, max_chars: int = 300) -> None:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{output}"
    assert lines[0].startswith(prefix), lines[0]
    for fragment in expected:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert "Traceback" not in output
    assert len(lines[0]) < max_chars


# ---------------------------------------------------------------------------------------------------- in process


@pytest.fixture
def worker_command_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, handlers_dir: Path, listener: Listener
) -> Listener:
    """This process as ``faust -A app worker`` sees it: no inherited REBOUND_* setting, no .env, no app built yet."""
    for name in list(os.environ):
        if name.upper().startswith("REBOUND_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(handlers_dir))
    for name, value in worker_settings(listener, tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [*WORKER, "-l", "info"])
    monkeypatch.setattr(app_package, "_runtime", None)
    return listener


@pytest.mark.parametrize(("environment", "expected"), CASES)
def test_faust_command_line_exits_78_with_one_line(
    worker_command_line: Listener,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    environment: dict[str, str],
    expected: list[str],
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        app_package.__getattr__("app")
    assert exited.value.code == EX_CONFIG == 78
    out, err = capsys.readouterr()
    assert out == ""
    check_message(err, expected)
    assert not worker_command_line.connected(), "the worker connected before its configuration was checked"
    assert not (tmp_path / "data").exists()  # nothing was built either
    assert app_package._runtime is None


def test_outside_fausts_command_line_the_error_is_raised(
    worker_command_line: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test or a script reading ``app.app`` gets the exception, not an exit of its process."""
    monkeypatch.setattr(sys, "argv", ["pytest"])
    monkeypatch.setenv("REBOUND_HANDLER", "nosuch.mod:fn")
    with pytest.raises(ConfigurationError, match="no module named 'nosuch'"):
        app_package.__getattr__("app")
    assert not worker_command_line.connected()


def test_a_dotenv_file_that_is_not_utf8_exits_78_with_one_line_naming_it(
    worker_command_line: Listener, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Review: a ``.env`` saved as Latin-1 ended the worker with a ``UnicodeDecodeError`` traceback."""
    monkeypatch.setenv("REBOUND_HANDLER", GOOD)
    (tmp_path / ".env").write_bytes("REBOUND_APP_ID=caf\u00e9\n".encode("latin-1"))
    with pytest.raises(SystemExit) as exited:
        app_package.__getattr__("app")
    assert exited.value.code == EX_CONFIG == 78
    check_message(capsys.readouterr().err, [f"{(tmp_path / '.env').resolve()} is not UTF-8 text (byte 0xe9 on line 1)"])
    assert not worker_command_line.connected()


def broken_line(module: str, error: type[Exception] | str, text: str | None, where: str) -> list[str]:
    """What the one line of a handler module failing at import says: the spec, the class, where, the message."""
    name = error if isinstance(error, str) else error.__name__
    return [
        f"REBOUND_HANDLER={module}:handle: module '{module}' raised {name} at {where} while imported"
        + (f": {text}" if text else " (the traceback"),
        "(the traceback: run the worker with -l debug)",
    ]


def broken_prefix(status: int) -> str:
    return CONFIGURATION if status == EX_CONFIG else HANDLER_FAILED


@pytest.mark.parametrize(("module", "error", "text", "where", "status"), BROKEN)
def test_a_handler_module_failing_at_import_exits_with_one_line_saying_where(
    worker_command_line: Listener,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    handlers_dir: Path,
    module: str,
    error: type[Exception] | str,
    text: str | None,
    where: str,
    status: int,
) -> None:
    """Found but failing while imported: one line naming the spec, the exception's class and message and the file and
    line where it was raised (it was Faust's 42-line traceback and exit 1); exit 78 for an ImportError or SyntaxError,
    1 for any other exception (a restart may help); outside Faust's command line a HandlerImportError (a
    ConfigurationError) or a HandlerStartError, whose cause is the module's exception."""
    monkeypatch.setenv("REBOUND_HANDLER", f"{module}:handle")
    monkeypatch.chdir(handlers_dir)  # the file is shown relative to the working directory
    with pytest.raises(SystemExit) as exited:
        app_package.__getattr__("app")
    assert exited.value.code == status
    out, err = capsys.readouterr()
    assert out == ""
    check_message(err, broken_line(module, error, text, where), broken_prefix(status), max_chars=400)
    assert not worker_command_line.connected()

    monkeypatch.setattr(sys, "argv", ["pytest"])
    forget_broken_modules()
    with pytest.raises(HandlerImportError if status == EX_CONFIG else HandlerStartError) as raised:
        app_package.__getattr__("app")
    cause = raised.value.__cause__
    assert type(cause).__name__ == error if isinstance(error, str) else type(cause) is error
    assert isinstance(raised.value, ConfigurationError) == (status == EX_CONFIG)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("module", "status", "frame", "last"),
    [
        ("broken_in_a_call", 1, 'broken_in_a_call.py", line 5, in setup', "json.decoder.JSONDecodeError: Expecting"),
        (
            "broken_dependency",
            EX_CONFIG,
            'broken_dependency.py", line 2, in <module>',
            "ModuleNotFoundError: No module",
        ),
    ],
)
def test_at_log_level_debug_the_traceback_comes_before_the_line(
    worker_command_line: Listener,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    handlers_dir: Path,
    module: str,
    status: int,
    frame: str,
    last: str,
) -> None:
    """The line then does not tell to run the worker with -l debug: it already does."""
    monkeypatch.setenv("REBOUND_HANDLER", f"{module}:handle")
    monkeypatch.setattr(sys, "argv", [*WORKER, "-l", "debug"])
    with pytest.raises(SystemExit) as exited:
        app_package.__getattr__("app")
    assert exited.value.code == status
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Traceback (most recent call last):"
    assert any(frame in line for line in err)
    assert err[-2].startswith(last)
    assert err[-1].startswith(broken_prefix(status) + f"REBOUND_HANDLER={module}:handle: module")
    assert "-l debug" not in err[-1]


def test_log_level_debug_is_read_from_faust_s_arguments() -> None:
    for argv in (
        [*WORKER, "-l", "debug"],
        [*WORKER, "-lDEBUG"],
        ["faust", "-A", "app", "--loglevel=debug", "worker"],
        ["faust", "--loglevel", "Debug", "-A", "app", "worker"],
    ):
        assert debug_requested(argv), argv
    for argv in (
        [*WORKER],
        [*WORKER, "-l", "info"],
        [*WORKER, "-l"],
        [*WORKER, "--", "-l", "debug"],
        ["faust", "-A", "debug", "worker"],
    ):
        assert not debug_requested(argv), argv


def test_a_broker_that_refuses_exits_75_with_one_line(
    worker_command_line: Listener, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Not a configuration error (78: a restart will not fix it) but a temporary one: 75, restart."""
    monkeypatch.setenv("REBOUND_HANDLER", GOOD)
    monkeypatch.setenv("REBOUND_BROKER", CLOSED_BROKER)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exited:
        app_package.__getattr__("app")
    assert exited.value.code == EX_TEMPFAIL == 75
    check_message(
        capsys.readouterr().err, [f"REBOUND_BROKER={CLOSED_BROKER}", "KafkaConnectionError"], BROKER_DOWN, 400
    )
    assert time.monotonic() - started < 20
    assert not (tmp_path / "data").exists()
    monkeypatch.setattr(sys, "argv", ["pytest"])  # outside Faust's command line: raised, and not as a setting
    with pytest.raises(BrokerUnavailableError) as raised:
        app_package.__getattr__("app")
    assert not isinstance(raised.value, ConfigurationError)


def test_a_broker_that_does_not_answer_in_time_is_temporary_too(
    listener: Listener, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The listener accepts and never answers: after the provisioning timeout (shortened here), 75 as well."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(provisioning, "PROVISION_TIMEOUT_S", 0.5)
    settings = load_settings(broker=listener.url, handler=GOOD, data_dir=str(tmp_path / "data"))
    with pytest.raises(BrokerUnavailableError, match=rf"REBOUND_BROKER={listener.url}: no answer within 0.5s"):
        provisioning.provision(settings)
    assert listener.connected()


def test_worker_help_is_answered_by_the_light_app(
    worker_command_line: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``faust -A app worker --help`` only prints options: no settings read, no handler, no topics provisioned."""
    monkeypatch.setattr(sys, "argv", [*WORKER, "--help"])
    assert app_package.__getattr__("app") is cli_app()
    assert app_package._runtime is None
    assert cli_app([*WORKER, "--", "--help"]) is None  # an argument after --, not help
    assert not worker_command_line.connected()


def test_a_handler_in_the_working_directory_is_found_after_installed_modules(
    monkeypatch: pytest.MonkeyPatch, handlers_dir: Path, tmp_path: Path
) -> None:
    """The console script's sys.path has neither "" nor the working directory: it is appended (never inserted, so a
    file there cannot hide an installed package), and kept."""
    path = [entry for entry in sys.path if entry not in ("", str(handlers_dir), os.getcwd())]
    monkeypatch.setattr(sys, "path", list(path))
    monkeypatch.chdir(handlers_dir)
    sys.modules.pop("startup_handlers", None)
    assert load_handler(GOOD).__name__ == "handle"
    assert sys.path == [*path, str(handlers_dir)]
    load_handler(GOOD)
    assert sys.path.count(str(handlers_dir)) == 1
    monkeypatch.setattr(sys, "path", ["", *path])
    load_handler(GOOD)
    assert sys.path == ["", *path]  # "" already means the working directory


# ---------------------------------------------------------------------------------------------------- entry point


def worker_env(settings: dict[str, str]) -> dict[str, str]:
    """This process's environment without its REBOUND_* variables, with ``settings``."""
    env = {name: value for name, value in os.environ.items() if not name.upper().startswith("REBOUND_")}
    env.update(settings)
    return env


def run_faust(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``faust -A app worker`` with ``args``, run to its end."""
    return subprocess.run(
        [*WORKER, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def pythonpath(handlers_dir: Path) -> str:
    """The handlers, then this checkout: the console script would otherwise import ``app`` through the editable
    install, which may be another checkout (a worktree's ``.venv`` shared with the main one)."""
    return os.pathsep.join([str(handlers_dir), str(ROOT)])


def run_worker(environment: dict[str, str], cwd: Path, handlers_dir: Path, *, timeout: float = 60) -> tuple[int, str]:
    completed = run_faust(
        ["-l", "info"], worker_env({**environment, "PYTHONPATH": pythonpath(handlers_dir)}), cwd, timeout
    )
    return completed.returncode, completed.stdout + completed.stderr


# tests/conftest.py's guard counts every `faust ... worker` child as a broker start: marked so, although these
# workers never reach one (the listener proves it).
@pytest.mark.broker
@pytest.mark.parametrize(("environment", "expected"), CASES)
def test_entry_point_exits_78_with_one_line_before_connecting(
    listener: Listener, handlers_dir: Path, tmp_path: Path, environment: dict[str, str], expected: list[str]
) -> None:
    started = time.monotonic()
    status, output = run_worker(worker_settings(listener, tmp_path, **environment), tmp_path, handlers_dir)
    elapsed = time.monotonic() - started
    assert status == 78, output
    check_message(output, expected)
    assert not listener.connected(), "the worker connected before its configuration was checked"
    assert not (tmp_path / "data").exists()
    assert elapsed < 20, f"took {elapsed:.1f}s"


def start_worker(env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        return subprocess.Popen(
            [*WORKER, "-l", "info"],
            env=env,
            cwd=cwd,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def connects(listener: Listener, process: subprocess.Popen[bytes], wait_s: float = 30) -> bool:
    """Whether the worker connects to the listener within ``wait_s``; False at once if it exits first."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if listener.connected(wait_s=0.2):
            return True
        if process.poll() is not None:
            return listener.connected()
    return False


@pytest.mark.broker
@pytest.mark.parametrize("where", ["pythonpath", "working-directory"])
def test_control_a_valid_worker_does_connect(
    listener: Listener, handlers_dir: Path, tmp_path: Path, where: str
) -> None:
    """The same command with valid settings goes on to contact the broker: the listener sees it connect.

    ``working-directory``: the Procfile's ``faust -A app worker`` (the console script, no PYTHONPATH) run in the
    folder holding the handler's module finds it there."""
    env = worker_env(worker_settings(listener, tmp_path, REBOUND_HANDLER=GOOD, REBOUND_WEB_ENABLED="false"))
    env.pop("PYTHONPATH", None)
    if where == "pythonpath":
        env["PYTHONPATH"] = pythonpath(handlers_dir)
    log = tmp_path / "worker.log"
    process = start_worker(env, tmp_path if where == "pythonpath" else handlers_dir, log)
    try:
        connected = connects(listener, process)
    finally:
        process.kill()
        process.wait(10)
    assert connected, f"the worker never connected (exit {process.returncode}):\n{log.read_text()[-2000:]}"


@pytest.mark.broker
@pytest.mark.parametrize(("module", "error", "text", "where", "status"), BROKEN)
def test_entry_point_exits_78_or_1_for_a_handler_module_failing_at_import(
    listener: Listener,
    handlers_dir: Path,
    tmp_path: Path,
    module: str,
    error: type[Exception] | str,
    text: str | None,
    where: str,
    status: int,
) -> None:
    status_seen, output = run_worker(
        worker_settings(listener, tmp_path, REBOUND_HANDLER=f"{module}:handle"), handlers_dir, handlers_dir
    )
    assert status_seen == status, output
    check_message(output, broken_line(module, error, text, where), broken_prefix(status), max_chars=400)
    assert not listener.connected()


@pytest.mark.broker
def test_entry_point_at_log_level_debug_prints_the_traceback_too(
    listener: Listener, handlers_dir: Path, tmp_path: Path
) -> None:
    settings = worker_settings(listener, tmp_path, REBOUND_HANDLER="broken_at_import:handle")
    completed = run_faust(["-l", "debug"], worker_env({**settings, "PYTHONPATH": pythonpath(handlers_dir)}), tmp_path)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 1, output
    assert "Traceback (most recent call last):" in output and 'broken_at_import.py", line 3, in <module>' in output
    assert output.splitlines()[-1].startswith(HANDLER_FAILED + "REBOUND_HANDLER=broken_at_import:handle")
    assert not listener.connected()


@pytest.mark.broker
def test_entry_point_exits_75_when_the_broker_refuses(handlers_dir: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    status, output = run_worker(
        {"REBOUND_BROKER": CLOSED_BROKER, "REBOUND_DATA_DIR": str(tmp_path / "data"), "REBOUND_HANDLER": GOOD},
        tmp_path,
        handlers_dir,
    )
    assert status == EX_TEMPFAIL == 75, output
    check_message(output, [f"REBOUND_BROKER={CLOSED_BROKER}", "Connect call failed"], BROKER_DOWN, 400)
    assert time.monotonic() - started < 20
    assert not (tmp_path / "data").exists()


@pytest.mark.broker
def test_entry_point_worker_help_needs_no_settings_and_no_broker(
    listener: Listener, handlers_dir: Path, tmp_path: Path
) -> None:
    """No REBOUND_HANDLER at all: ``--help`` still prints the worker's options, and nothing connects."""
    completed = run_faust(["--help"], worker_env(worker_settings(listener, tmp_path)), tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "Usage: faust worker" in completed.stdout
    assert not listener.connected()
    assert not (tmp_path / "data").exists()
