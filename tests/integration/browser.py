"""The session's headless Chromium (Debian's, driven by its chromium-driver), logged in to the
deployment through its login form; the ``browser`` fixture in ``conftest.py`` starts it once."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOTS_ENV = "HVD_VIEW_SCREENSHOTS"  # a folder: the tests also copy their screenshots there (docs/)
BROWSER_WAIT_S = 60


def logged_in_browser(base_url: str, password: str, scratch: Path) -> Iterator:
    """A Chromium logged in as the admin; every process of it is gone after the ``yield``."""
    import psutil
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    assert not missing, "%s missing: run scripts/setup (it installs chromium and chromium-driver)" % missing
    downloads = scratch / "downloads"
    downloads.mkdir()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    service = Service(CHROMEDRIVER, log_output=str(scratch / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    family = [service.process.pid, *(c.pid for c in psutil.Process(service.process.pid).children(recursive=True))]
    driver.downloads = downloads
    try:
        driver.get(base_url + "/auth/login")
        wait = WebDriverWait(driver, BROWSER_WAIT_S)
        wait.until(lambda d: d.find_elements(By.NAME, "username"))[0].send_keys("admin")
        driver.find_element(By.NAME, "password").send_keys(password)
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait.until(lambda d: "/auth/login" not in d.current_url)
        yield driver
    finally:
        driver.quit()
        assert _still_running(family, within_s=10) == [], "chromium processes left behind"


def _still_running(pids: list[int], within_s: float) -> list[int]:
    """Those of ``pids`` that have not ended (zombies count as ended) ``within_s`` seconds from now:
    Chromium's helpers exit on their own once the browser has gone, a moment after ``quit()``."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=within_s)
    left = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc.pid)
    return left


def save_screenshot(driver, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    driver.save_screenshot(str(shot))
    if os.environ.get(SCREENSHOTS_ENV):
        target = Path(os.environ[SCREENSHOTS_ENV])
        target.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(shot.read_bytes())
    return shot
