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
PROMPT = ("Summarize in one sentence: The Moon always shows the same side to Earth because its rotation is "
          "tidally locked to its orbit.")
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


# --------------------------------------------------------------------------- limits (no browser)


def _load_app():
    """app.py as a module (it needs gradio: scripts/ci_browser_setup.sh installs it)."""
    import importlib.util

    try:
        import gradio  # noqa: F401
    except ImportError:
        pytest.fail(f"the demo tests need gradio; {SETUP_HINT}", pytrace=False)
    spec = importlib.util.spec_from_file_location("selfspec_demo_app", ROOT / "app.py")
    app = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = app  # its dataclasses look their module up there
    spec.loader.exec_module(app)
    return app


class CharTokenizer:
    """The two tokenizer calls the demo makes, for a tiny random model: a token per
    character of the prompt, token ids as text."""

    def apply_chat_template(self, messages, **kwargs):
        import torch

        return {"input_ids": torch.tensor([[3 + ord(c) % 200 for c in messages[-1]["content"]]])}

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in tokens)


@pytest.fixture
def tiny_demo():
    """The demo's Demo on a tiny random model (no EOS: a turn runs to its token budget),
    with a record of the generate() calls it makes."""
    from conftest import tiny_model

    import hf_selfspec

    app = _load_app()
    model = hf_selfspec.attach_heads(tiny_model("llama", seed=30), heads=False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    calls = []

    def recording_generate(*args, **kwargs):
        calls.append(kwargs.get("assistant"))
        return type(model).generate(model, *args, **kwargs)

    model.generate = recording_generate
    return app, app.Demo(model, CharTokenizer()), calls


def test_demo_limits_prompts_and_tokens_on_the_server(tiny_demo, monkeypatch):
    import gradio as gr

    app, demo, calls = tiny_demo
    for prompt in ("", "   ", None, "x" * (app.MAX_PROMPT_CHARS + 1)):
        with pytest.raises(gr.Error):
            next(demo.turn(prompt, 16))
    monkeypatch.setattr(app, "MAX_PROMPT_TOKENS", 10)
    with pytest.raises(gr.Error, match="at most 10 tokens"):
        next(demo.turn("eleven char", 16))
    assert calls == []  # refused before any work
    assert app.clamp_new_tokens(10**9) == app.NEW_TOKENS_CAP
    assert app.clamp_new_tokens(-5) == 1 and app.clamp_new_tokens("many") == app.MAX_NEW_TOKENS
    *_, (selfspec_html, plain_html, stats_html) = demo.turn("hello", 10**9)  # an API client's value
    assert "identical outputs" in stats_html
    assert calls == ["self", None] and demo.model.selfspec_stats.new_tokens == app.NEW_TOKENS_CAP


def test_an_abandoned_turn_is_cancelled(tiny_demo):
    """Gradio closes the turn's generator when the browser goes away: its generate() stops at
    the next token, the plain call never starts, and the model is free again at once."""
    app, demo, calls = tiny_demo
    turn = demo.turn("hello world", app.NEW_TOKENS_CAP)
    next(turn)  # the first chunk is on the page
    turn.close()
    assert demo.lock.acquire(timeout=60), "the abandoned turn still holds the model"
    demo.lock.release()
    assert calls == ["self"], calls
    assert demo.model.selfspec_stats.new_tokens < app.NEW_TOKENS_CAP


def test_demo_queue_is_bounded_and_serial(tiny_demo):
    app, demo, _ = tiny_demo
    ui = app.build_ui(demo)
    assert ui._queue.max_size == app.QUEUE_SIZE
    assert ui._queue.default_concurrency_limit == 1, "one turn at a time"
    assert all(fn.concurrency_limit in ("default", 1) for fn in ui.fns.values())
