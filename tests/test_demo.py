"""The Gradio Space on tiny random models: driven through gradio_client, and in a real headless Chromium
through Playwright (a screenshot is kept as a test artefact)."""

import os
import re
import shutil
import socket
from pathlib import Path

import pytest

gr = pytest.importorskip("gradio")
from gradio_client import Client  # noqa: E402

from modeling_pacer.demo import CSS, DemoModels, ModelHolder, build_demo  # noqa: E402

from conftest import make_head, make_pair, word_tokenizer  # noqa: E402

PROMPT = "[5] [17] [42] [8] [91] [33]"
ARTIFACTS = Path(os.environ.get("PACER_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    target, draft = make_pair("llama", "llama", "noisy")
    models = DemoModels(target, draft, word_tokenizer(), make_head(draft, max_draft_length=16), "tiny random pair")
    demo = build_demo(ModelHolder(lambda progress: models), refresh_seconds=0.05)
    port = _free_port()
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, css=CSS, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


def _text(fragment: str) -> str:
    """The output text of a rendered side: rejected draft tokens are shown struck through, not part of it."""
    fragment = re.sub(r'<span class="tok-rejected"[^>]*>.*?</span>', "", fragment, flags=re.S)
    return re.sub(r"<[^>]+>", "", fragment)


@pytest.mark.parametrize("method", ["PACER", "fixed γ"])
def test_client_generation_is_identical_with_stats(app_url, method):
    client = Client(app_url, verbose=False)
    target_html, target_stats, method_html, method_stats, chart, verdict = client.predict(
        PROMPT, 40, "greedy", 0.7, method, 3, api_name="/compare")
    assert "Identical" in verdict
    assert _text(target_html) == _text(method_html) and len(_text(target_html)) > 10
    assert "40 tokens" in target_stats and "tokens/s" in target_stats
    assert "40 tokens" in method_stats and "the target alone" in method_stats and "tokens per forward" in method_stats
    assert 'class="tok-accepted"' in method_html or 'class="tok-target"' in method_html
    rows = chart["value"]["data"] if isinstance(chart, dict) and "value" in chart else chart["data"]
    assert len(rows) > 0


def test_client_target_alone(app_url):
    client = Client(app_url, verbose=False)
    target_html, target_stats, method_html, method_stats, chart, verdict = client.predict(
        PROMPT, 12, "greedy", 0.7, "target alone", 2, api_name="/compare")
    assert "12 tokens" in target_stats and method_html == "" and "Only the target ran" in verdict


def test_browser_shows_both_outputs(app_url):
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--disable-component-update", "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(app_url)
        page.get_by_label("Prompt").fill(PROMPT)
        page.locator("#generate").click()
        page.get_by_text("Identical").wait_for(timeout=60_000)
        without_rejected = """el => { const c = el.cloneNode(true);
            c.querySelectorAll('.tok-rejected').forEach(e => e.remove()); return c.innerText; }"""
        target_text = page.locator("#target-text").evaluate(without_rejected)
        method_text = page.locator("#method-text").evaluate(without_rejected)
        assert target_text.strip() and target_text == method_text
        assert page.locator("#method-text .tok-accepted").count() + page.locator("#method-text .tok-target").count() > 0
        assert "tokens/s" in page.locator("#method-stats").inner_text()
        page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)
        browser.close()
    assert (ARTIFACTS / "demo.png").stat().st_size > 10_000
