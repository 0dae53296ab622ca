"""The core's settings are pure: they validate the values they are given and read neither the environment nor a
``.env`` file (``app/environment.py`` reads those, where the worker starts)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import rebound
from rebound.settings import Settings, load_settings

CORE = Path(rebound.__file__).parent
ENVIRONMENT_READS = re.compile(
    r"\bos\.environ\b|\bgetenv\b|\bimport\s+environ\b|\benvironb?\s*\[|\bdotenv\b|\bpydantic_settings\b|[\"']\.env[\"']"
)


def test_the_core_reads_no_variable_and_no_env_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("REBOUND_WEB_PORT=7001\n")
    monkeypatch.setenv("REBOUND_APP_ID", "from-env")
    monkeypatch.setenv("REBOUND_CONCURRENCY", "-3")  # would be refused if it were read
    assert load_settings().app_id == "rebound"
    assert load_settings().web_port == 6066
    assert Settings().app_id == "rebound"
    assert load_settings(app_id="given").app_id == "given"


def test_no_module_of_the_core_reads_the_environment() -> None:
    """import-linter keeps pydantic_settings and dotenv out of rebound/; ``os.environ`` is a stdlib name it cannot
    see, so this looks for it (and the others) in the source."""
    found = [
        f"{path.relative_to(CORE.parent)}:{number}: {line.strip()}"
        for path in sorted(CORE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ENVIRONMENT_READS.search(line.split("#", 1)[0])
    ]
    assert CORE.name == "rebound" and len(list(CORE.rglob("*.py"))) > 20  # the search looks at the core
    assert found == []
