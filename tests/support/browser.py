"""Headless Chromium driven by Selenium, for the playground's end-to-end tests.

Chromium and its driver come from Debian's packages (`make test` installs them where
it can: see the Makefile's `browser` target). Both paths are given to Selenium
explicitly, so Selenium Manager never runs and nothing is fetched from the network.
`unavailable()` says why no browser can run here; the tests skip with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path

CHROMEDRIVER = "/usr/bin/chromedriver"  # Debian's chromium-driver
_CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


def chromium_path() -> str | None:
    for path in _CHROMIUM:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


def unavailable() -> str | None:
    """None when a browser test can run; else the reason it cannot."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[test]')"
    if chromium_path() is None:
        return "no Chromium: `apt-get install chromium chromium-driver` (make test does it as root where apt-get exists)"
    if not Path(CHROMEDRIVER).is_file():
        return f"no {CHROMEDRIVER}: `apt-get install chromium-driver`"
    return None


def start_chromium(width: int = 1400, height: int = 900):
    """A fresh headless Chromium (its own profile, so localStorage starts empty)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium_path()
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in a container: Chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(15)
    driver.set_script_timeout(15)
    return driver


def wait_for(predicate, timeout_s: float = 10, interval_s: float = 0.05, message: str = "condition"):
    """Poll `predicate()` until it returns something truthy (returned); AssertionError on timeout."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the element may not exist yet, or be replaced mid-read
            last_error = exc
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {message}" + (f" (last error: {last_error})" if last_error else ""))


def console_errors(driver) -> list[str]:
    """The page's console messages at SEVERE level (JS exceptions, failed loads)."""
    try:
        return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    except Exception:
        return []
