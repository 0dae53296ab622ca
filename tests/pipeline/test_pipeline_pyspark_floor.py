"""The pyspark floor: declared in one place per tool (pyproject, Makefile, pipeline/_requirements.py) and enforced when
``pipeline`` is imported, with one line naming it instead of a ModuleNotFoundError from inside Spark.

``make test-pyspark-floor`` runs the whole pipeline suite on exactly the floor version."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from pipeline._requirements import (
    PYSPARK_FLOOR,
    PYSPARK_REQUIREMENT,
    PySparkTooOldError,
    check_pyspark,
    importable_pyspark_version,
    release_tuple,
)

REPO = Path(__file__).resolve().parents[2]
FLOOR_TEXT = ".".join(map(str, PYSPARK_FLOOR))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4.2.0", (4, 2, 0)),
        ("4.2.1", (4, 2, 1)),
        ("4.1", (4, 1, 0)),
        ("4.2.0.dev0", (4, 2, 0)),
        ("4.3.0rc1", (4, 3, 0)),
        (" 5 ", (5, 0, 0)),
        ("unknown", None),
    ],
)
def test_release_tuple(text: str, expected: tuple[int, int, int] | None) -> None:
    assert release_tuple(text) == expected


@pytest.mark.parametrize("version", ["4.0.5", "4.1.4", "3.5.3", "4.1.0.dev0"])
def test_older_pyspark_is_one_line_naming_the_floor(version: str) -> None:
    with pytest.raises(PySparkTooOldError) as raised:
        check_pyspark(version)
    message = str(raised.value)
    assert "\n" not in message
    assert PYSPARK_REQUIREMENT in message
    assert f"found pyspark {version}" in message
    assert isinstance(raised.value, ImportError)


@pytest.mark.parametrize("version", [FLOOR_TEXT, "4.2.0.dev0", "4.2.1", "4.3.0", "unparseable"])
def test_floor_and_newer_pass(version: str) -> None:
    check_pyspark(version)


def test_version_is_read_from_the_importable_pyspark() -> None:
    import pyspark

    assert importable_pyspark_version() == pyspark.__version__


def test_floor_is_the_same_in_pyproject_makefile_and_check() -> None:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["pipeline"]
    assert [r for r in extra if r.startswith("pyspark")] == [PYSPARK_REQUIREMENT]
    makefile = (REPO / "Makefile").read_text()
    assert re.findall(r"^PYSPARK_FLOOR \?= (\S+)$", makefile, re.MULTILINE) == [FLOOR_TEXT]
    assert PYSPARK_REQUIREMENT.startswith(f"pyspark>={PYSPARK_FLOOR[0]}.{PYSPARK_FLOOR[1]},")


def _fake_pyspark(root: Path, version: str, *, as_zip: bool) -> Path:
    """A pyspark whose ``__init__`` refuses to run: the check must read ``version.py`` without importing pyspark,
    from a directory or from a zip such as a Spark distribution's ``python/lib/pyspark.zip``."""
    init = "raise RuntimeError('the version check imported pyspark')\n"
    version_py = f"__version__: str = '{version}'\n"
    if as_zip:
        archive = root / "pyspark.zip"
        with zipfile.ZipFile(archive, "w") as zf:
            zf.writestr("pyspark/__init__.py", init)
            zf.writestr("pyspark/version.py", version_py)
        return archive
    (root / "pyspark").mkdir()
    (root / "pyspark" / "__init__.py").write_text(init)
    (root / "pyspark" / "version.py").write_text(version_py)
    return root


def _import_pipeline_with(path_entry: Path, module: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys; sys.path.insert(0, {str(path_entry)!r}); sys.path.insert(1, {str(REPO)!r}); import {module}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("as_zip", [False, True], ids=["directory", "zip"])
def test_importing_pipeline_on_old_pyspark_fails_with_one_line(tmp_path: Path, as_zip: bool) -> None:
    entry = _fake_pyspark(tmp_path, "4.1.4", as_zip=as_zip)
    # the pure option parser is enough to trip it: every pipeline import goes through pipeline/__init__.py
    result = _import_pipeline_with(entry, "pipeline.kafka_source.options")
    assert result.returncode == 1, result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("pipeline._requirements.PySparkTooOldError: ")
    assert PYSPARK_REQUIREMENT in last_line
    assert "found pyspark 4.1.4" in last_line
    assert "the version check imported pyspark" not in result.stderr


@pytest.mark.parametrize("as_zip", [False, True], ids=["directory", "zip"])
def test_importing_pipeline_on_the_floor_does_not_import_pyspark(tmp_path: Path, as_zip: bool) -> None:
    entry = _fake_pyspark(tmp_path, FLOOR_TEXT, as_zip=as_zip)
    result = _import_pipeline_with(entry, "pipeline.kafka_source.options")
    assert result.returncode == 0, result.stderr
