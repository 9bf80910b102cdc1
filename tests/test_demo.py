"""End to end: app.py served on localhost, driven by headless Chromium through selenium.

Needs Debian's chromium + chromium-driver and the selenium/gradio packages; CI installs
them with scripts/ci_browser_setup.sh. Missing pieces fail the test (they do not skip it).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SETUP_HINT = "run `bash scripts/ci_browser_setup.sh` (apt chromium chromium-driver, pip selenium gradio)"
PROMPT = "Summarize in one sentence: The Moon always shows the same side to Earth because its rotation is tidally locked to its orbit."
NEW_TOKENS = 32  # short: the test checks the page, not speed
START_TIMEOUT_S = 240  # model load + warm-up on a busy 2-core machine
TURN_TIMEOUT_S = 240
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1300"]


def _require_browser_stack():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    for module in ("selenium", "gradio"):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"python package {module}")
    if missing:
        pytest.fail(f"browser test prerequisites missing: {', '.join(missing)}; {SETUP_HINT}",
                    pytrace=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"app.py exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"app.py did not serve {url} within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def demo_server(tmp_path):
    port = _free_port()
    log = tmp_path / "app.log"
    env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port),
               GRADIO_ANALYTICS_ENABLED="False", HF_SELFSPEC_DEMO_MAX_NEW_TOKENS=str(NEW_TOKENS),
               HF_SELFSPEC_DEMO_THREADS=os.environ.get("HF_SELFSPEC_TEST_THREADS", "1"))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py")], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_for_server(proc, url, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def browser(tmp_path):
    _require_browser_stack()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.slow
def test_demo_page_generates_identical_outputs_and_speedup(browser, demo_server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(demo_server)
    prompt = WebDriverWait(browser, 60).until(
        EC.element_to_be_clickable((By.CSS_SELECTOR, "#prompt textarea")))
    prompt.send_keys(PROMPT)
    browser.find_element(By.CSS_SELECTOR, "#generate").click()
    verdict = WebDriverWait(browser, TURN_TIMEOUT_S).until(
        EC.presence_of_element_located((By.ID, "verdict")))

    selfspec_text = browser.find_element(By.ID, "selfspec-text").text
    plain_text = browser.find_element(By.ID, "plain-text").text
    stats = browser.find_element(By.ID, "stats").text
    shot = tmp_path / "demo.png"
    browser.save_screenshot(str(shot))
    if not os.environ.get("CI") and not (ROOT / "docs" / "demo.png").exists():
        shutil.copyfile(shot, ROOT / "docs" / "demo.png")  # once, for docs/demo.md

    assert "identical" in verdict.text, stats
    assert selfspec_text.strip() and selfspec_text == plain_text
    assert re.search(r"speed-up \d+\.\d\d×", stats), stats
    # every self-spec token was re-rendered with its exact source, none left as "draft"
    titles = {s.get_attribute("title")
              for s in browser.find_elements(By.CSS_SELECTOR, "#selfspec-text span")}
    assert titles and "draft" not in titles and titles <= {"model", "copy", "head0", "head1",
                                                           "head2", "head3", "head4"}, titles
