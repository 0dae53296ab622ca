"""The oldest pyspark the pipeline runs on, checked when ``pipeline`` is imported.

The ``pykafka`` source needs the Python Data Source API of Spark 4.2: a ``DataSourceStreamReader`` whose
``latestOffset(start, limit)`` gets a ``ReadLimit`` from ``getDefaultReadLimit``, with ``SupportsTriggerAvailableNow``.
On 4.0 and 4.1 a job starts its SparkSession and only then dies registering the source, with
``ModuleNotFoundError: No module named 'pyspark.sql.streaming.datasource'``, which names no version (and 4.1's
``DataSourceStreamReader`` has neither ``getDefaultReadLimit`` nor a limit argument to ``latestOffset``). Checking the version when ``pipeline`` is imported turns
that into one line naming the floor, before Spark starts, on the driver and on every executor that unpickles the
source.

The version is read from the ``pyspark`` that ``import pyspark`` would load (its ``version.py``), not from pip's
metadata: under ``spark-submit`` a Spark distribution puts ``$SPARK_HOME/python/lib/pyspark.zip`` first on the path,
and a different pip-installed pyspark may sit behind it. Reading the file avoids importing pyspark itself, so the
pure modules (options, planning, arrow) stay cheap to import and still work where pyspark is not installed at all.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys

# In step with the pyspark line of pyproject's ``pipeline`` extra and the Makefile's PYSPARK_FLOOR (a test checks).
PYSPARK_FLOOR: tuple[int, int, int] = (4, 2, 0)
PYSPARK_REQUIREMENT = "pyspark>=4.2,<5"

_VERSION_ASSIGNMENT = re.compile(r"""^__version__(?:\s*:\s*str)?\s*=\s*['"]([^'"]+)['"]""", re.MULTILINE)
_RELEASE = re.compile(r"^(\d+)(?:\.(\d+))?(?:\.(\d+))?")


class PySparkTooOldError(ImportError):
    """The importable pyspark is older than PYSPARK_FLOOR."""


def release_tuple(version: str) -> tuple[int, int, int] | None:
    """``"4.2.0.dev1"`` -> ``(4, 2, 0)``; ``"4.1"`` -> ``(4, 1, 0)``; None when the text has no leading number."""
    match = _RELEASE.match(version.strip())
    if match is None:
        return None
    major, minor, micro = (int(part) if part else 0 for part in match.groups())
    return major, minor, micro


def importable_pyspark_version() -> str | None:
    """The version of the pyspark ``import pyspark`` would load, or None when there is none."""
    loaded = sys.modules.get("pyspark")
    if loaded is not None and isinstance(getattr(loaded, "__version__", None), str):
        return str(loaded.__version__)
    try:
        spec = importlib.util.find_spec("pyspark")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    get_data = getattr(spec.loader, "get_data", None)
    if locations and callable(get_data):
        try:  # a directory, or a zip such as pyspark.zip (zipimporter.get_data takes the same joined path)
            text = get_data(os.path.join(locations[0], "version.py")).decode("utf-8")
        except (OSError, UnicodeDecodeError):
            text = ""
        match = _VERSION_ASSIGNMENT.search(text)
        if match:
            return match.group(1)
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_pyspark(version: str | None = None) -> None:
    """Raise PySparkTooOldError (one line naming the floor) when the importable pyspark is too old.

    No pyspark at all is fine here: the pure modules do not need it, and the jobs then fail on ``import pyspark``
    with a message that already says what is missing. An unparseable version is let through rather than guessed at.
    """
    found = version if version is not None else importable_pyspark_version()
    if found is None:
        return
    release = release_tuple(found)
    if release is None or release >= PYSPARK_FLOOR:
        return
    raise PySparkTooOldError(
        f"the Rebound pipeline needs {PYSPARK_REQUIREMENT} (the Python Data Source streaming API of Spark "
        f"{'.'.join(map(str, PYSPARK_FLOOR[:2]))}), found pyspark {found}: "
        f"pip install '{PYSPARK_REQUIREMENT}', or run on Spark {PYSPARK_FLOOR[0]}.{PYSPARK_FLOOR[1]}+"
    )
