"""The dashboard in a real headless Chromium (Selenium) while a load generator drafts: the plots fill with points,
the page updates live, the speedup series moves, and a screenshot is saved as a test artifact."""

import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from drafter_service.api.tree import accept_greedy
from drafter_service.core.config import DrafterConfig
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import ServiceConfig
from engine_client import DrafterClient

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
VOCAB = 1000
PLAIN_STEP = 0.004  # seconds of a plain decode step of the simulated engine
CHARTS = ("speedup", "mat", "acceptance", "rate", "latency", "store")


def artifacts() -> Path:
    folder = Path(os.environ.get("DRAFTER_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def require_browser():
    """Selenium's webdriver module, or skip (fail under DRAFTER_REQUIRE_BROWSER=1) when a part is missing."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    try:
        from selenium import webdriver
    except ImportError:
        webdriver = None
        missing.append("the selenium package")
    if missing:
        reason = (f"no headless browser: {', '.join(missing)} missing (Debian packages chromium and "
                  f"chromium-driver, pip selenium; `make test` installs them)")
        if os.environ.get("DRAFTER_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + "; DRAFTER_REQUIRE_BROWSER=1 requires the browser test to run")
        pytest.skip(reason)
    return webdriver


class LoadGenerator(threading.Thread):
    """Requests through DrafterClient like an engine: greedy verification against a known output, step times
    reported. Some outputs repeat earlier ones, more often as time goes on, so acceptance and the estimated
    speedup change over time."""

    def __init__(self, address: str) -> None:
        super().__init__(name="load-generator", daemon=True)
        self.address = address
        self.stop = threading.Event()
        self.steps = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _run(self) -> None:
        rng = random.Random(7)
        texts: list[list[int]] = []
        started = time.monotonic()
        with DrafterClient(self.address, max_nodes=16, timeout=2.0) as client:
            while not self.stop.is_set():
                repeat = min(0.8, 0.1 + 0.1 * (time.monotonic() - started))  # from 10 % to 80 % repeats
                if texts and rng.random() < repeat:
                    text = rng.choice(texts)
                else:
                    text = [rng.randrange(VOCAB) for _ in range(100)]
                    texts.append(text)
                prompt, output = text[:16], text[16:]
                session = client.start(prompt)
                accepted: list[int] = []
                pos, step = 0, 0.0
                while pos < len(output) and not self.stop.is_set():
                    tree = client.draft(session, accepted, step_seconds=step,
                                        plain_step_seconds=PLAIN_STEP if step else 0.0)
                    n, _ = accept_greedy(tree, output[pos:])
                    accepted = output[pos:pos + n + 1]
                    pos += len(accepted)
                    step = PLAIN_STEP * (1.0 + 0.04 * len(tree))  # verifying a tree costs a little more
                    time.sleep(step)
                    self.steps += 1
                client.end(session, accepted)


def viewport(driver, width: int, height: int) -> None:
    """Make the page's viewport exactly width x height CSS pixels (a window's frame would take some)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})


def chrome(webdriver, width: int, height: int, profile: str):
    """A headless Chromium through chromedriver (a second try when a loaded machine makes the first one fail)."""
    from selenium.common.exceptions import WebDriverException

    try:
        return _chrome(webdriver, width, height, profile)
    except WebDriverException:
        shutil.rmtree(profile, ignore_errors=True)
        return _chrome(webdriver, width, height, profile)


def _chrome(webdriver, width: int, height: int, profile: str):
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


STATE_JS = """
const s = window.drafterDashboard;
if (!s || !s.ready) return null;
const plots = {};
for (const [name, plot] of Object.entries(s.plots)) {
  plots[name] = {points: plot.data[0].length,
                 series: plot.data.slice(1).map(ys => ys.filter(v => v !== null && v !== undefined))};
}
return {polls: s.polls, points: s.points.length, plots: plots,
        figures: Array.from(document.querySelectorAll('.figure .value')).map(e => e.textContent),
        scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth};
"""


def settled(state, after_points: int = 0) -> bool:
    if not state or state["points"] <= after_points or set(state["plots"]) != set(CHARTS):
        return False
    if any(p["points"] < 3 or not p["series"][0] for p in state["plots"].values()):
        return False
    speedups, store = state["plots"]["speedup"]["series"][0], state["plots"]["store"]["series"][0]
    return (len({round(v, 3) for v in speedups}) >= 3  # the speedup moves,
            and max(speedups) > 1.0  # above plain decoding once repeated outputs are drafted
            and store[-1] > store[0])  # and the store grows as requests end


def test_dashboard_plots_fill_live_and_the_speedup_moves(redis_server, tmp_path):
    webdriver = require_browser()
    from selenium.common.exceptions import JavascriptException
    from selenium.webdriver.support.ui import WebDriverWait

    cfg = ServiceConfig(address="127.0.0.1:0", redis_url=redis_server.url, http_address="127.0.0.1:0",
                        data_dir=str(tmp_path / "data"), default_vocab_size=VOCAB,
                        drafter=DrafterConfig(capacity=1 << 18), rebuild_in_subprocess=False, metrics_interval_s=0.5)
    profile = tempfile.mkdtemp(prefix="drafter-chromium-")
    runtime = Runtime(cfg).start()
    load = LoadGenerator(f"127.0.0.1:{runtime.port}")
    driver = None
    try:
        load.start()
        driver = chrome(webdriver, 1366, 768, profile)
        viewport(driver, 1366, 768)
        driver.set_page_load_timeout(20)
        driver.get(f"http://127.0.0.1:{runtime.http_port}/?window=900")
        state = WebDriverWait(driver, 25, poll_frequency=0.25, ignored_exceptions=(JavascriptException,)).until(
            lambda d: (lambda s: s if settled(s) else False)(d.execute_script(STATE_JS)))
        plots = state["plots"]
        assert all(0.0 <= v <= 1.0 for v in plots["acceptance"]["series"][0])
        assert all(v >= 1.0 for v in plots["mat"]["series"][0])
        assert all(v > 0 for v in plots["latency"]["series"][0] + plots["rate"]["series"][0])
        assert state["figures"][0].endswith("×") and state["figures"][4] == "healthy"
        assert state["scrollWidth"] <= state["innerWidth"]  # no horizontal scroll at 1366x768

        # live: later polls bring more points without reloading the page
        later = WebDriverWait(driver, 10, poll_frequency=0.25, ignored_exceptions=(JavascriptException,)).until(
            lambda d: (lambda s: s if settled(s, state["points"]) and s["polls"] > state["polls"] else False)(
                d.execute_script(STATE_JS)))
        assert later["plots"]["speedup"]["points"] >= state["plots"]["speedup"]["points"]
        shot = artifacts() / "dashboard-1366x768.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not severe, severe

        viewport(driver, 1920, 1080)  # the other common laptop size: still no horizontal scroll
        time.sleep(0.5)
        wide = driver.execute_script(STATE_JS)
        assert wide["scrollWidth"] <= wide["innerWidth"]
        driver.save_screenshot(str(artifacts() / "dashboard-1920x1080.png"))
    except BaseException:
        if driver is not None:  # what the page showed, for whoever reads the failure
            driver.save_screenshot(str(artifacts() / "dashboard-failure.png"))
            (artifacts() / "dashboard-failure.log").write_text("\n".join(map(str, driver.get_log("browser"))))
        raise
    finally:
        load.stop.set()
        load.join(10)
        if driver is not None:
            driver.quit()
        runtime.stop()
        shutil.rmtree(profile, ignore_errors=True)
    assert load.error is None, load.error
    assert load.steps > 50


def test_a_missing_browser_skips_unless_it_is_required(monkeypatch):
    import sys

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("DRAFTER_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="chromium-driver"):
        require_browser()
    monkeypatch.setenv("DRAFTER_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="DRAFTER_REQUIRE_BROWSER=1"):
        require_browser()
