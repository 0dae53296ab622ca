"""Settings from the environment: the ``REBOUND_*`` variables, over those of a ``.env`` file, over the defaults.

The one place the worker reads its configuration (``rebound/settings.py`` only validates what it is given), called
where the application starts: :func:`app.factory.build` and :func:`app.handlers.load_handler`. The variables are
gathered into text per field, the environment's by pydantic-settings, as they always were, the ``.env`` file's read
and parsed here once with python-dotenv, as pydantic-settings read it (UTF-8), and the pure
:func:`~rebound.settings.load_settings` validates them; so the reading is the same as before the core became pure:

- a field ``x`` is the variable ``REBOUND_X``, its name in any case (``rebound_x`` too);
- each value is the variable's text, parsed by the field's own validation (no JSON: every field is a scalar; a list
  such as ``REBOUND_MAIN_TOPICS`` is comma-separated text that the core splits; a secret becomes a ``SecretStr``);
- the process's environment wins over ``.env`` (python-dotenv's syntax, read from the working directory if it exists),
  which wins over the defaults; arguments given here win over both;
- a ``REBOUND_`` variable that names no setting (``REBOUND_TEST_KAFKA``, a typo) is ignored, in the environment and
  in ``.env``, as are the file's other variables.

A problem with a value the ``.env`` file gave says so, with the file's path (:func:`origins`): the one-line error of a
worker that will not start points at the file, not at an environment where the variable is not set. A file that
cannot be read or is not UTF-8 is such an error too, naming the file (no traceback).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dotenv import dotenv_values
from pydantic import create_model
from pydantic_settings import BaseSettings, SettingsConfigDict

from rebound.errors import ConfigurationError
from rebound.settings import ENV_PREFIX, Settings, settings_from

ENV_FILE = ".env"


class _Variables(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")  # (the file: read here, once)


_AS_TEXT: dict[str, Any] = dict.fromkeys(Settings.model_fields, (str | None, None))
_Text = create_model("_Text", __base__=_Variables, **_AS_TEXT)
"""Every setting as the text of its variable, or unset: what pydantic-settings gathers, before the core validates it."""


@dataclass(frozen=True)
class _Read:
    """What the environment and ``.env`` set, by field name; the file's path when there is one."""

    environment: dict[str, str]
    file: dict[str, str]
    path: Path | None


def _read(env_file: str | Path | None) -> _Read:
    """The ``REBOUND_*`` variables of the environment (gathered by pydantic-settings) and of ``env_file``, the file
    read and parsed once (python-dotenv, as pydantic-settings reads it: UTF-8, a variable's name in any case, a name without
    ``=`` unset); a file that cannot be read or is not UTF-8 is a :class:`~rebound.errors.ConfigurationError` naming
    it."""
    # BaseSettings takes _env_file; mypy sees only the __init__ that pydantic's dataclass_transform makes of the fields
    text = _Text(_env_file=None)  # type: ignore[call-arg]
    environment = {name: value for name, value in text.model_dump(exclude_unset=True).items() if value is not None}
    path = None if env_file is None else Path(env_file).expanduser()
    if path is None or not (path.is_file() or path.is_fifo()):
        return _Read(environment, {}, None)
    path = path.resolve()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"{path} cannot be read: {exc.strerror or exc}") from None
    try:
        content = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigurationError(
            f"{path} is not UTF-8 text (byte {data[exc.start]:#04x} on line {line}): save it as UTF-8"
        ) from None
    variables = dotenv_values(stream=io.StringIO(content))
    prefix = ENV_PREFIX.lower()
    in_file = {
        name.lower().removeprefix(prefix): value
        for name, value in variables.items()
        if value is not None and name.lower().startswith(prefix)
    }
    return _Read(environment, {field: in_file[field] for field in Settings.model_fields if field in in_file}, path)


def environment_values(env_file: str | Path | None = ENV_FILE) -> dict[str, str]:
    """The text of each setting the environment or ``env_file`` (None: no file) sets, by field name: the environment's
    over the file's."""
    read = _read(env_file)
    return {**read.file, **read.environment}


def _origins(read: _Read, given: Iterable[str]) -> dict[str, str]:
    if read.path is None:
        return {}
    return {
        field: f"in the environment, which overrides {read.path}" if field in read.environment else f"in {read.path}"
        for field in read.file
        if field not in set(given)
    }


def origins(env_file: str | Path | None = ENV_FILE, given: Iterable[str] = ()) -> dict[str, str]:
    """Where each setting ``env_file`` sets was read, by field name: ``in <the file's absolute path>``, or, when the
    environment sets it too, ``in the environment, which overrides <path>``; none for the settings in ``given`` (arguments)."""
    return _origins(_read(env_file), given)


def settings_from_environment(env_file: str | Path | None = ENV_FILE, **overrides: object) -> Settings:
    """The worker's settings: ``overrides`` over the ``REBOUND_*`` variables over ``env_file``'s over the defaults,
    validated; a problem is one :class:`~rebound.errors.ConfigurationError` naming the variable, and where it was
    read when ``env_file`` sets it (:func:`origins`), or naming the file when it cannot be read. The file is parsed
    once (python-dotenv's warning about a line it cannot parse is printed once)."""
    read = _read(env_file)
    values = {**read.file, **read.environment, **overrides}
    return settings_from(values, origins=_origins(read, overrides))
