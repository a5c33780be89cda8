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
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, css=CSS, quiet=True)
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
        page.locator("#verdict .mark-ok").screenshot(path=str(ARTIFACTS / "verdict-mark.png"))
        browser.close()
    assert (ARTIFACTS / "demo.png").stat().st_size > 10_000
    # the mark is drawn (CSS, no font needed): its picture holds the mark's green
    from PIL import Image

    picture = Image.open(ARTIFACTS / "verdict-mark.png").convert("RGB")
    pixels = [picture.getpixel((x, y)) for x in range(picture.width) for y in range(picture.height)]
    green = sum(1 for r, g, b in pixels if g > 100 and g > r + 40 and g > b + 40)
    assert green >= 10, f"the verdict's mark did not render ({green} green pixels of {len(pixels)})"


# refused by Gradio's own check of a component's range or choices, or by the app's (check_request)
@pytest.mark.parametrize("field, args, message", [
    ("max_new_tokens", (PROMPT, 10**7, "greedy", 0.7, "PACER", 2),
     r"max new tokens must be an integer between 8 and 512|greater than maximum value 512"),
    ("gamma", (PROMPT, 16, "greedy", 0.7, "fixed γ", 100), r"γ must be an integer between 1 and 8|greater than maximum value 8"),
    ("temperature", (PROMPT, 16, "sampling", 50.0, "PACER", 2),
     r"temperature must be between 0.1 and 1.5|greater than maximum value 1.5"),
    ("prompt", ("[1] " * 2000, 16, "greedy", 0.7, "PACER", 2), r"at most 4000"),
    ("method", (PROMPT, 16, "greedy", 0.7, "rm -rf", 2), r"method must be one of|not in the list of choices"),
    ("mode", (PROMPT, 16, "beam", 0.7, "PACER", 2), r"decoding must be one of|not in the list of choices"),
])
def test_the_server_enforces_its_limits(app_url, field, args, message):
    """An API call is not bound by the page's sliders: every value is checked on the server, before any model runs."""
    client = Client(app_url, verbose=False)
    with pytest.raises(Exception, match=message):
        client.predict(*args, api_name="/compare")


def test_check_request_refuses_what_the_components_might_let_through():
    """The app's own check, beneath Gradio's: non-numbers, fractions where an integer is meant, NaN, empty prompts."""
    from modeling_pacer.demo import check_request

    good = dict(prompt=PROMPT, max_new_tokens=16, mode="greedy", temperature=0.7, method="PACER", gamma=2)
    assert check_request(**good)["max_new_tokens"] == 16
    for field, value, message in (("max_new_tokens", "lots", "must be a number"), ("max_new_tokens", 16.5, "an integer"),
                                  ("temperature", float("nan"), "between 0.1 and 1.5"), ("gamma", 0, "between 1 and 8"),
                                  ("prompt", "   ", "Type a prompt"), ("prompt", None, "Type a prompt")):
        with pytest.raises(ValueError, match=message):
            check_request(**dict(good, **{field: value}))


def _generation_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "pacer-demo-generation"]


def _generating() -> bool:
    from modeling_pacer.demo import WORKER

    return WORKER.busy.is_set()


@pytest.mark.timeout(300)
def test_eight_concurrent_clients(app_url):
    """Eight clients at once, one asking for 10**7 tokens, one leaving early: each completed answer is the target's
    own output, the greedy request beyond the limit is refused, the one that left stops its generation, the requests
    run one at a time, memory stays bounded and no generation thread outlives its request."""
    import threading
    import time

    import psutil

    process = psutil.Process()
    rss_before = process.memory_info().rss
    results, errors = {}, {}

    def ask(i, args):
        try:
            results[i] = Client(app_url, verbose=False).predict(*args, api_name="/compare")
        except Exception as error:  # noqa: BLE001 - what the client saw is what the test checks
            errors[i] = str(error)

    normal = (PROMPT, 24, "greedy", 0.7, "PACER", 2)
    requests = {i: normal if i % 2 else (PROMPT, 24, "greedy", 0.7, "fixed γ", 3) for i in range(6)}
    requests[6] = (PROMPT, 10**7, "greedy", 0.7, "PACER", 2)
    threads = [threading.Thread(target=ask, args=(i, a)) for i, a in requests.items()]
    most, watching = [0], threading.Event()

    def watch():  # how many generations ever ran at once
        while not watching.is_set():
            most[0] = max(most[0], len(_generation_threads()))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    leaving = Client(app_url, verbose=False).submit(PROMPT, 512, "greedy", 0.7, "target alone", 2, api_name="/compare")
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while leaving.status().code.name not in ("PROCESSING", "ITERATING") and time.monotonic() < deadline:
        time.sleep(0.05)
    leaving.cancel()  # the client that leaves early
    for t in threads:
        t.join(240)
    assert sorted(results) == [0, 1, 2, 3, 4, 5] and list(errors) == [6], (sorted(results), errors)
    assert re.search(r"max new tokens must be an integer between 8 and 512|greater than maximum value 512", errors[6])
    texts = set()
    for i in range(6):
        target_html, _, method_html, _, _, verdict = results[i]
        assert "Identical" in verdict and _text(target_html) == _text(method_html)
        texts.add(_text(target_html))
    assert len(texts) == 1  # every completed answer the same greedy output
    deadline = time.monotonic() + 30
    while _generating() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _generating(), "a generation outlived its request"
    watching.set()
    watcher.join()
    assert most[0] == 1  # one generation thread, so one generation at a time
    assert process.memory_info().rss - rss_before < 500 * 2**20


def test_a_stopped_comparison_ends_its_generation_at_the_next_step():
    import torch

    from modeling_pacer.demo import start_comparison

    target, draft = make_pair("llama", "llama", "noisy")
    models = DemoModels(target, draft, word_tokenizer(), make_head(draft, max_draft_length=16), "tiny")
    ids = torch.tensor([[5, 17, 42]])
    for method in ("PACER", "target alone"):
        comparison = start_comparison(models, ids, method, 2, dict(max_new_tokens=100_000, do_sample=False))
        comparison.stop(timeout=30)
        assert comparison.done.is_set() and not _generating()
        assert all(len(side.tokens) < 400 and side.error is None for side in comparison.sides.values())


@pytest.mark.parametrize("method", ["PACER", "head's block rule", "SVIP", "fixed γ", "transformers' assisted generation"])
def test_every_method_of_the_page_is_the_target_and_its_speedup_is_the_ratio_shown(app_url, method):
    client = Client(app_url, verbose=False)
    target_html, target_stats, method_html, method_stats, chart, verdict = client.predict(
        PROMPT, 32, "greedy", 0.7, method, 3, api_name="/compare")
    assert "Identical" in verdict and _text(target_html) == _text(method_html)
    rate = lambda stats: float(re.search(r"([\d.]+) tokens/s", stats).group(1))  # noqa: E731
    shown = float(re.search(r"([\d.]+)x\*\* the target alone", method_stats).group(1))
    assert abs(shown - rate(method_stats) / rate(target_stats)) <= 0.005 + 1e-9  # the ratio of the two rates shown
    if method != "transformers' assisted generation":
        assert "rule: `" in method_stats  # the page names the rule that ran


def test_the_page_names_what_decides_and_the_chart_shows_every_bar():
    from modeling_pacer.demo import RULES, Side, steps_chart

    assert "the cost-aware rule on the draft's own probability" in RULES["PACER"]
    side = Side("method", steps=[dict(accepted=2, rejected=10, reason="x"), dict(accepted=16, rejected=0, reason="y")])
    assert steps_chart(side).y_lim == [0, 17]
    assert steps_chart(None).y_lim[1] >= 1


def test_space_measurement_on_tiny_models():
    """`pacer-bench space`'s measurement, on the tiny pair: every rate measured in each round, the page's speedup shown."""
    from modeling_pacer.benchmarks.space import measure_space

    target, draft = make_pair("llama", "llama", "noisy")
    models = DemoModels(target, draft, word_tokenizer(), make_head(draft, max_draft_length=16), "tiny")
    report = measure_space(models, PROMPT, max_new_tokens=24, rounds=2, log=lambda line: None)
    assert all(len(values) == 2 and all(v > 0 for v in values) for values in report["samples"].values())
    assert report["space_over_outside"] > 0 and report["medians"]["space: speedup shown"] > 0


def test_waiting_requests_of_the_same_settings_are_decoded_together():
    """Requests that wait for the worker with the same method and settings run as one batch (each side one batched
    call): every visitor's two sides are its own greedy output, the same as its request alone, its page says it ran
    with the others; a request of other settings waits for a call of its own."""
    import threading

    import torch
    from transformers import GenerationMixin

    from modeling_pacer import make_exact
    from modeling_pacer.demo import WORKER, side_stats, start_comparison

    target, draft = make_pair("llama", "llama", "noisy")
    make_exact(target)  # each row of a batch bitwise the row alone
    tokenizer = word_tokenizer()
    tokenizer.pad_token = "[0]"
    models = DemoModels(target, draft, tokenizer, make_head(draft, max_draft_length=16), "tiny")
    release = threading.Event()
    WORKER.submit(lambda payloads: release.wait(30))  # the worker busy: the requests below wait together
    prompts = [torch.tensor([[5, 17, 42]]), torch.tensor([[8, 91, 33, 2, 7, 64]]), torch.tensor([[11, 12]])]
    settings = dict(max_new_tokens=20, do_sample=False)
    together = [start_comparison(models, ids, "PACER", 2, settings) for ids in prompts]
    apart = start_comparison(models, prompts[0], "fixed γ", 3, settings)
    release.set()
    for comparison in [*together, apart]:
        assert comparison.done.wait(120)
    for ids, comparison in zip(prompts, together):
        alone = GenerationMixin.generate(target, ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
        sides = comparison.sides
        assert sides["method"].tokens == sides["target"].tokens == alone and sides["method"].error is None
        assert sides["method"].batch == sides["target"].batch == 3
        assert "decoded together with 2 other requests, as one batch" in side_stats(sides["method"], 1.0)
        assert sum(s["accepted"] + 1 for s in sides["method"].steps) >= len(alone)  # each step's drafts, its own
    assert apart.sides["method"].batch == 1 and apart.sides["method"].tokens == together[0].sides["target"].tokens
