"""The dashboard in a real headless Chromium, against a real worker on the embedded broker.

Needs the Debian packages ``chromium`` and ``chromium-driver`` (``apt-get install -y chromium chromium-driver``). When
they are missing the test installs them if it can (root with apt-get), and skips, saying so, only if it cannot. A
screenshot of the page is saved to ``out/test-output/dashboard.png`` (or ``$REBOUND_TEST_OUTPUT/dashboard.png``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from demo.harness import Worker, produce
from tests.integration.conftest import Deployment, wait_for

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
XSS_KEY = "<img src=x onerror=window.__xss=1>"
PARKED = [f"park-{index}" for index in range(5)]
PERMANENT = 31  # a page of 20, then 11 (one of them the XSS key's)
UNDECODABLE = 4
APT_COMMAND = ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"]


def find_chromium() -> tuple[str, str] | None:
    browser = next(
        (found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))), None
    )
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None
    )
    return (browser, driver) if browser and driver else None


def chromium_or_install() -> tuple[str, str]:
    found = find_chromium()
    if found:
        return found
    reason = "chromium and chromedriver not found; install them with: apt-get install -y chromium chromium-driver"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(reason + " (cannot install them here: not root or no apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], APT_COMMAND):
        done = subprocess.run(command, env=env, capture_output=True, timeout=900, check=False)
        if done.returncode != 0 and command is APT_COMMAND:
            pytest.skip(f"{reason} (installing failed: {done.stderr.decode(errors='replace')[-500:]})")
    found = find_chromium()
    if not found:
        pytest.skip(reason + " (installed, but still not found)")
    return found


@pytest.fixture(scope="module")
def chrome() -> Iterator[Any]:
    pytest.importorskip("selenium", reason="selenium is a dev dependency: pip install -e '.[dev]'")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = chromium_or_install()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def output_dir() -> Path:
    path = Path(os.environ.get("REBOUND_TEST_OUTPUT") or ROOT / "out" / "test-output")
    path.mkdir(parents=True, exist_ok=True)
    return path


def get_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as response:
        return json.loads(response.read())


def wait_until(what: str, check: Callable[[], Any], timeout: float, worker: Worker, driver: Any = None) -> Any:
    """``wait_for`` with an error from ``check`` counted as not yet (the page or the web server is not there yet);
    a timeout shows the page's text too."""
    try:
        return wait_for(check, timeout, what, [worker], ignore=(Exception,), interval=0.3)
    except AssertionError as error:
        page = driver.find_element("tag name", "body").text[-3000:] if driver is not None else ""
        raise AssertionError(f"{error}\npage:\n{page}") from None


def script(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def texts(driver: Any, selector: str) -> list[str]:
    return [node.text for node in driver.find_elements("css selector", selector)]


def produce_scenario(deployment: Deployment) -> None:
    """Parked for 10 minutes: ``PARKED`` and the XSS key; on the failed topic: ``PERMANENT`` (one of them the XSS
    key's second message) and ``UNDECODABLE`` records."""
    records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = [
        (key.encode(), script(fail="always"), []) for key in [*PARKED, XSS_KEY]
    ]
    records += [(f"perm-{index}".encode(), script(permanent=True), []) for index in range(PERMANENT - 1)]
    records += [(XSS_KEY.encode(), script(permanent=True), [])]
    records += [(f"bad-{index}".encode(), b"not json", []) for index in range(UNDECODABLE)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))


def check_backlog_and_charts(driver: Any, worker: Worker, tier: str) -> None:
    waiting = f'#backlog tr[data-tier="{tier}"] td.waiting'
    wait_until("tier count on the page", lambda: texts(driver, waiting) == [str(len(PARKED) + 1)], 20, worker, driver)

    def points(chart: str) -> int:
        return int(driver.find_element("css selector", f"#{chart} svg").get_attribute("data-points"))

    wait_until("the waiting chart has points", lambda: points("chart-waiting") > 0, 20, worker, driver)
    assert points("chart-outcomes") > 0 and points("chart-overdue") > 0
    assert driver.find_elements("css selector", "#chart-waiting svg circle.point")
    assert driver.find_elements("css selector", "#chart-waiting svg polyline")
    legend = driver.find_element("css selector", "#chart-waiting .legend").text
    assert f"{tier} ({len(PARKED) + 1})" in legend, legend
    wait_until("outcome counters", lambda: "dead" in driver.find_element("id", "outcomes").text, 20, worker, driver)


def check_key_lookup(driver: Any, worker: Worker) -> None:
    def look_up(key: str) -> None:
        box = driver.find_element("id", "key-input")
        box.clear()
        box.send_keys(key)
        driver.find_element("id", "key-go").click()

    for key in (PARKED[1], XSS_KEY):  # a key that is markup is shown as text
        look_up(key)
        wait_until(
            f"key lookup of {key}",
            lambda key=key: (
                driver.find_element("css selector", "#key-result code.key").text == key
                and "1 pending" in driver.find_element("id", "key-result").text
            ),
            20,
            worker,
            driver,
        )


def check_failed_browser(driver: Any, worker: Worker) -> None:
    # The first page came by itself: the newest 20.
    rows = "#failed-records tbody tr"
    wait_until("first failed page", lambda: len(driver.find_elements("css selector", rows)) == 20, 20, worker, driver)

    def search(reason: str, what: str, check: Callable[[], bool], key: str = "") -> None:
        for field, value in (("failed-reason", reason), ("failed-key", key)):
            box = driver.find_element("id", field)
            box.clear()
            box.send_keys(value)
        driver.find_element("id", "failed-search").click()
        wait_until(what, check, 20, worker, driver)

    # By key: the XSS key's record, its key shown as text.
    search("", "key filter", lambda: texts(driver, "#failed-records td.key") == [XSS_KEY], key=XSS_KEY)

    search(
        "undecodable",
        "undecodable filter",
        lambda: texts(driver, "#failed-records td.reason") == ["undecodable"] * UNDECODABLE,
    )
    assert sorted(texts(driver, "#failed-records td.key")) == [f"bad-{index}" for index in range(UNDECODABLE)]
    assert not driver.find_element("id", "failed-older").is_enabled()

    search(
        "permanent",
        "permanent, page 1",
        lambda: (
            texts(driver, "#failed-records td.reason") == ["permanent"] * 20
            and driver.find_element("id", "failed-older").is_enabled()
        ),
    )
    first_page = texts(driver, "#failed-records td.key")
    driver.find_element("id", "failed-older").click()
    wait_until(
        "permanent, page 2",
        lambda: (
            texts(driver, "#failed-records td.reason") == ["permanent"] * (PERMANENT - 20)
            and "Page 2" in driver.find_element("id", "failed-status").text
        ),
        20,
        worker,
        driver,
    )
    second_page = texts(driver, "#failed-records td.key")
    assert not set(first_page) & set(second_page)
    assert sorted(first_page + second_page) == sorted([f"perm-{i}" for i in range(PERMANENT - 1)] + [XSS_KEY])
    assert not driver.find_element("id", "failed-older").is_enabled()
    driver.find_element("id", "failed-newer").click()
    wait_until("back to page 1", lambda: texts(driver, "#failed-records td.key") == first_page, 20, worker, driver)


def check_json_views(port: int, deployment: Deployment) -> None:
    """The parameters the page relies on, and what the views refuse."""
    for path in ("/retry/failed?before=garbage", "/retry/failed?topic=nope", "/retry/history?scope=everything"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            get_json(port, path)
        assert refused.value.code == 400, path
    # A main topic names its failed topic; pages follow the cursor to the end.
    keys: list[str] = []
    cursor = ""
    for _ in range(10):
        page = get_json(port, f"/retry/failed?topic={deployment.topic}&reason=undecodable&limit=3{cursor}")
        keys += [record["key"] for record in page["records"]]
        if page["next_before"] is None:
            break
        cursor = "&before=" + page["next_before"]
    assert sorted(keys) == [f"bad-{index}" for index in range(UNDECODABLE)]
    worker_view = get_json(port, "/retry/history?scope=worker")
    assert worker_view["scope"] == "worker" and worker_view["samples"]


def test_dashboard_in_a_real_browser(deploy: Any, chrome: Any) -> None:
    driver = chrome
    deployment: Deployment = deploy(partitions=2, REBOUND_RETRY_SEQUENCE="10m")
    worker = deployment.start_worker("dash")
    port = worker.web_port
    wait_until("the worker owns its partitions", lambda: get_json(port, "/ready")["ready"], 60, worker)
    produce_scenario(deployment)
    tier = f"{deployment.topic}.retry.10m"
    failed = f"{deployment.topic}.failed"

    def settled() -> bool:
        backlog = get_json(port, "/retry/backlog")
        depth = get_json(port, "/retry/failed")["topics"][failed]["depth"]
        return bool(backlog["tiers"][tier]["waiting"] == len(PARKED) + 1 and depth == PERMANENT + UNDECODABLE)

    wait_until("messages parked and dead-lettered", settled, 60, worker)

    def parked_samples() -> list[Any]:  # two, so that the charts draw lines
        found = [s for s in get_json(port, "/retry/history")["samples"] if s["tiers"][tier]["waiting"]]
        return found if len(found) >= 2 else []

    history = wait_until("two history samples with the parked messages", parked_samples, 60, worker)
    assert history[-1]["tiers"][tier]["waiting"] == len(PARKED) + 1

    check_json_views(port, deployment)

    driver.get(f"http://127.0.0.1:{port}/dashboard/")
    assert driver.title == "Rebound dashboard"
    check_backlog_and_charts(driver, worker, tier)
    check_key_lookup(driver, worker)
    check_failed_browser(driver, worker)

    # Nothing ran from the data, and no image element was ever made of it.
    assert driver.execute_script("return typeof window.__xss") == "undefined"
    assert driver.execute_script("return document.getElementsByTagName('img').length") == 0
    assert "innerHTML" not in driver.page_source

    height = driver.execute_script("window.scrollTo(0, 0); return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(int(height) + 100, 6000))
    screenshot = output_dir() / "dashboard.png"
    assert driver.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000

    errors = [entry for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
