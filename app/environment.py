"""Settings from the environment: the ``REBOUND_*`` variables, over those of a ``.env`` file, over the defaults.

The one place the worker reads its configuration (``rebound/settings.py`` only validates what it is given), called
where the application starts: :func:`app.factory.build` and :func:`app.handlers.load_handler`. The variables are
gathered by pydantic-settings, as they always were, into text per field, and the pure
:func:`~rebound.settings.load_settings` validates them; so the reading is the same as before the core became pure:

- a field ``x`` is the variable ``REBOUND_X``, its name in any case (``rebound_x`` too);
- each value is the variable's text, parsed by the field's own validation (no JSON: every field is a scalar; a list
  such as ``REBOUND_MAIN_TOPICS`` is comma-separated text that the core splits; a secret becomes a ``SecretStr``);
- the process's environment wins over ``.env`` (python-dotenv's syntax, read from the working directory if it exists),
  which wins over the defaults; arguments given here win over both;
- a ``REBOUND_`` variable that names no setting (``REBOUND_TEST_KAFKA``, a typo) is ignored, in the environment and
  in ``.env``, as are the file's other variables.

A problem with a value the ``.env`` file gave says so, with the file's path (:func:`origins`): the one-line error of a
worker that will not start points at the file, not at an environment where the variable is not set.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dotenv import dotenv_values
from pydantic import create_model
from pydantic_settings import BaseSettings, SettingsConfigDict

from rebound.settings import ENV_PREFIX, Settings, settings_from

ENV_FILE = ".env"


class _Variables(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=ENV_FILE, extra="ignore")


_AS_TEXT: dict[str, Any] = dict.fromkeys(Settings.model_fields, (str | None, None))
_Text = create_model("_Text", __base__=_Variables, **_AS_TEXT)
"""Every setting as the text of its variable, or unset: what pydantic-settings gathers, before the core validates it."""


def environment_values(env_file: str | Path | None = ENV_FILE) -> dict[str, str]:
    """The text of each setting the environment or ``env_file`` (None: no file) sets, by field name."""
    # BaseSettings takes _env_file; mypy sees only the __init__ that pydantic's dataclass_transform makes of the fields
    text = _Text(_env_file=env_file)  # type: ignore[call-arg]
    return {name: value for name, value in text.model_dump(exclude_unset=True).items() if value is not None}


def origins(env_file: str | Path | None = ENV_FILE, given: Iterable[str] = ()) -> dict[str, str]:
    """Where each setting ``env_file`` sets was read, by field name: ``in <the file's absolute path>``, or, when the
    environment sets it too, ``in the environment, which overrides <path>``; none for the settings in ``given`` (arguments)."""
    if env_file is None or not Path(env_file).is_file():
        return {}
    path = Path(env_file).resolve()
    in_file = {
        name.lower().removeprefix(ENV_PREFIX.lower())
        for name, value in dotenv_values(path).items()
        if value is not None and name.upper().startswith(ENV_PREFIX)
    }
    in_environment = environment_values(None)
    return {
        field: f"in the environment, which overrides {path}" if field in in_environment else f"in {path}"
        for field in Settings.model_fields
        if field in in_file and field not in set(given)
    }


def settings_from_environment(env_file: str | Path | None = ENV_FILE, **overrides: object) -> Settings:
    """The worker's settings: ``overrides`` over the ``REBOUND_*`` variables over ``env_file``'s over the defaults,
    validated; a problem is one :class:`~rebound.errors.ConfigurationError` naming the variable, and where it was
    read when ``env_file`` sets it (:func:`origins`)."""
    values = {**environment_values(env_file), **overrides}
    return settings_from(values, origins=origins(env_file, overrides))
