"""A real headless browser for the chat page's test: Chromium driven through chromedriver by
Selenium. scripts/setup.sh --test installs Chromium and its driver from the distribution's
packages where it can (Debian/Ubuntu as root); elsewhere the test skips and says why."""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Browser:
    binary: str | None  # Chromium's executable
    driver: str | None  # chromedriver
    missing: str | None  # why the browser test cannot run here; None when it can


def find_browser() -> Browser:
    binary = next(
        (p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))),
        None,
    )
    driver = shutil.which("chromedriver")
    missing = None
    if importlib.util.find_spec("selenium") is None:
        missing = "selenium is not installed (it is in the test extras)"
    elif binary is None or driver is None:
        missing = (
            "Chromium or chromedriver not found (scripts/setup.sh --test installs the "
            "distribution's chromium and chromium-driver where it runs as root with apt-get)"
        )
    return Browser(binary, driver, missing)


def headless_chrome(browser: Browser, width: int = 1100, height: int = 900):  # noqa: ANN201
    """A Selenium driver of a headless Chromium window of this size."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser.binary or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(service=Service(browser.driver), options=options)
