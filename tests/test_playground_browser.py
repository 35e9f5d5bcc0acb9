"""The playground in headless Chromium (Debian's `chromium`, driven by Playwright) against real servers.

A real `glm5 serve --model tiny --ocr --api-key ...` subprocess (MTP drafting on, so the speculative
counters exist): the key typed into the page unlocks the model list; a chat answer streams into the
assistant bubble (its text grows over several paints, then the bubble ends); thinking shows collapsible
reasoning; bad input shows the API's own 400; an OCR upload renders Markdown with per-line confidence;
the metrics tab shows expert load per MoE layer and the speculative counters. A scripted engine
(tests/test_serve_app.py) behind the same app gives a tool call: it is shown as a card, and its result goes
back as a `tool` message. Screenshots are kept (tmp_path, and $GLM5_TEST_ARTIFACTS when set); the first
paint and the first token are printed, never asserted.

Skips without /usr/bin/chromium or the playwright package. Never run `playwright install`.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is missing "
                               "(pip install -c constraints.txt playwright; its browsers are not needed)")
pytest.importorskip("rapidocr_onnxruntime", reason="the OCR page needs the ocr extra")

from glm5.serve.app import create_app  # noqa: E402
from glm5.serve.testing import free_port, serve_in_thread  # noqa: E402
from tests._ocr_images import text_png  # noqa: E402
from tests._tiny import tiny_config  # noqa: E402
from tests.test_serve_app import TOOLS, FakeEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "playground-key"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def server():
    """`glm5 serve` on the tiny preset (random weights, bundled tokenizer), on a free loopback port."""
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "glm5.cli.main", "serve", "--model", "tiny", "--port", str(port), "--api-key", KEY,
         "--ocr", "--ocr-rounds", "1", "--device=cpu", "--batch_timeout_ms=0", "--max_model_len=512",
         "--speculative_num_tokens=2"],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            raise RuntimeError(f"glm5 serve did not start:\n{log.read().decode(errors='replace')[-3000:]}")
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="glm5-chromium-")  # a fresh user-data dir per run
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=ARGS,
                                                        headless=True, viewport={"width": 1280, "height": 860})
        context.set_default_timeout(TIMEOUT_MS)
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def page(browser, server):
    """The playground, unlocked with the API key (one page for the real-server tests, in order)."""
    page = browser.new_page()
    page.goto(server + "/")
    page.wait_for_selector("#error:not([hidden])")  # no key yet: the model list is the API's 401
    assert "401" in page.inner_text("#error")
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#model option[value=tiny]", state="attached")
    yield page
    page.close()


def keep_screenshot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    if os.environ.get("GLM5_TEST_ARTIFACTS"):
        out = Path(os.environ["GLM5_TEST_ARTIFACTS"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out / name)
    assert path.stat().st_size > 1000
    return path


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def set_range(page, selector: str, value: str) -> None:
    page.eval_on_selector(selector, "(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }", value)


def last_answer(page):
    return page.locator(".msg.assistant").last


# Records the length of the streaming bubble's text at every DOM change (runs in the page).
WATCH_GROWTH = """() => {
  window.lengths = [];
  new MutationObserver(() => {
    const bubble = [...document.querySelectorAll('.msg.assistant')].pop();
    if (bubble && bubble.dataset.state === 'streaming') window.lengths.push(bubble.querySelector('.content').textContent.length);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""


def test_chat_streams_tokens_into_the_page(page, tmp_path):
    page.uncheck("#thinking")
    page.fill("#max-tokens", "48")
    set_range(page, "#temperature", "0")  # greedy: the same answer every run
    page.evaluate(WATCH_GROWTH)
    send(page, "The capital of France is")
    answer = last_answer(page)
    answer.and_(page.locator("[data-state=done]")).wait_for()
    lengths = page.evaluate("window.lengths")
    grown = sorted(set(n for n in lengths if n > 0))
    assert len(grown) >= 3, f"the answer did not stream (text lengths seen while streaming: {lengths})"
    # the streamed answer is the API's own greedy answer to the same request
    ref = httpx.post(page.url + "v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "The capital of France is"}], "max_tokens": 48,
        "temperature": 0, "top_p": 1, "chat_template_kwargs": {"enable_thinking": False}}).json()
    want = ref["choices"][0]["message"]["content"]
    assert want and page.evaluate("window.playground.messages.at(-1).content") == want
    assert answer.locator(".content").text_content().strip()
    meta = answer.locator(".meta").inner_text()
    assert "tokens" in meta and "first token" in meta
    assert page.locator(".msg.user").last.inner_text() == "The capital of France is"
    timings = page.evaluate("window.playground.timings")
    assert timings["firstTokenMs"] is not None and timings["firstPaintMs"] is not None
    print(f"\nplayground first paint {timings['firstPaintMs']:.0f} ms, first token {timings['firstTokenMs']:.0f} ms "
          f"({len(grown)} growth steps seen; {meta})")
    keep_screenshot(page, tmp_path, "playground-chat.png")


def test_thinking_shows_collapsible_reasoning(page):
    page.check("#thinking")
    page.fill("#max-tokens", "12")
    send(page, "Think first.")
    answer = last_answer(page)
    answer.and_(page.locator("[data-state=done]")).wait_for()
    reasoning = answer.locator("details.reasoning")
    assert reasoning.is_visible() and reasoning.locator("pre").text_content().strip()  # random weights: all thinking
    assert reasoning.get_attribute("open") is None  # collapsed once the answer ends
    reasoning.locator("summary").click()
    assert reasoning.get_attribute("open") is not None and reasoning.locator("pre").is_visible()


def test_bad_input_shows_the_api_error(page):
    page.fill("#max-tokens", "-3")
    send(page, "hello")
    answer = last_answer(page)
    answer.and_(page.locator("[data-state=error]")).wait_for()
    error = page.inner_text("#error")
    assert error.startswith("400: ") and "max_tokens" in error and "greater than or equal to 0" in error
    page.fill("#max-tokens", "8")
    page.click("#tabs button[data-tab=infill]")
    page.click("#infill-run")
    page.wait_for_function("document.getElementById('infill-info').textContent.length > 0", polling=100)
    info = page.inner_text("#infill-info")  # the bundled vocabulary's <|code_*|> tokens: GLM's code prompt
    assert "format codegeex" in info and "tokens" in info and not info.startswith("400")


def test_ocr_upload_renders_markdown_with_confidences(page, server, tmp_path):
    tab = page.locator("#ocr-tab")
    tab.wait_for()  # shown because the server runs with --ocr
    tab.click()
    png = text_png()
    page.set_input_files("#ocr-file", files=[{"name": "page.png", "mimeType": "image/png", "buffer": png}])
    page.wait_for_selector("#ocr-lines tr td.conf")
    md = page.inner_text("#ocr-md")
    assert "quick brown fox" in md and "lazy dog" in md
    # the same upload straight to the API is the reference for the table: one row per line, in order
    ref = httpx.post(server + "/v1/ocr", files={"file": ("page.png", png, "image/png")}, data={"format": "md"},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=120).json()
    want = [[str(ln["id"]), ln["text"], f"{100 * ln['confidence']:.1f} %", ln["source"]]
            for block in ref["page"]["blocks"] for ln in block["lines"]]
    rows = page.locator("#ocr-lines tr").evaluate_all(
        "rows => rows.slice(1).map(r => [...r.cells].map(c => c.textContent))")
    assert rows == want and len(rows) >= 2
    assert [ln.strip() for ln in md.splitlines() if ln.strip()] == [
        ln.strip() for ln in ref["text"].splitlines() if ln.strip()]
    keep_screenshot(page, tmp_path, "playground-ocr.png")


def test_metrics_panel_shows_expert_load_and_speculation(page, tmp_path):
    page.click("#tabs button[data-tab=chat]")  # one answer of its own, so the test stands alone
    page.fill("#max-tokens", "8")
    send(page, "Count the experts.")
    last_answer(page).and_(page.locator("[data-state=done]")).wait_for()
    page.click("#tabs button[data-tab=metrics]")
    page.wait_for_selector(".expert-row")
    layers = page.locator(".expert-row").evaluate_all("rows => rows.map(r => r.dataset.layer)")
    assert layers == ["1", "2", "3"]  # the tiny preset's MoE layers (layer 0 is dense)
    for row in page.locator(".expert-imbalance").all_inner_texts():
        tokens = int(row.split(" tokens")[0])
        assert tokens > 0 and "imbalance" in row
    assert page.locator(".expert-row").first.locator(".expert-cell").count() == 8
    figures = dict(zip(page.locator("#metrics .card .muted").all_inner_texts(),
                       page.locator("#metrics .card .figure").all_inner_texts()))
    assert float(figures["generated tokens"]) > 0 and float(figures["requests done"]) >= 1
    assert float(figures["drafts"]) > 0 and float(figures["draft tokens"]) == 2 * float(figures["drafts"])
    assert figures["acceptance rate"].endswith("%")
    assert page.locator("#spec .bar-row").count() == 2  # one bar per draft position
    keep_screenshot(page, tmp_path, "playground-metrics.png")


@pytest.fixture(scope="module")
def fake(browser):
    """A page on the app over the scripted engine (reasoning, "Let me check.", a get_weather call; 50 ms a
    token), which also infills (GLM blank infilling: the script is the middle)."""
    engine = FakeEngine(step_sleep=0.05)
    engine.model_config = tiny_config(block_position_embedding=True, max_block_positions=256)
    with serve_in_thread(create_app(engine, model_name="fake")) as url:
        page = browser.new_page()
        page.bring_to_front()  # a background tab's animation frames are throttled
        page.goto(url + "/")
        page.wait_for_selector("#model option[value=fake]", state="attached")
        yield engine, url, page
        page.close()


def test_tool_call_card_and_its_result_round_trip(fake, tmp_path):
    engine, url, page = fake
    assert page.locator("#ocr-tab").is_hidden()  # no --ocr: no OCR page
    page.click("#tools-box summary")
    page.fill("#tools", json.dumps(TOOLS))
    send(page, "Weather in Paris?")
    answer = last_answer(page)
    answer.and_(page.locator("[data-state=done]")).wait_for()
    assert answer.locator(".content").inner_text() == "Let me check."
    assert answer.locator("details.reasoning pre").text_content() == "The user wants weather."
    card = answer.locator(".tool-card")
    assert card.count() == 1 and card.locator("strong").inner_text() == "get_weather"
    assert '"city": "Paris"' in card.locator(".tool-args").inner_text()
    assert "tool_calls" in answer.locator(".meta").inner_text()
    keep_screenshot(page, tmp_path, "playground-tools.png")
    card.locator(".tool-result").fill("sunny, 24 C")
    card.locator("button").click()
    page.locator(".msg.assistant").nth(1).and_(page.locator("[data-state=done]")).wait_for()
    prompt = engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert "sunny, 24 C" in prompt and "get_weather" in prompt  # the call and its result went back
    page.click("#clear")
    page.fill("#tools", "[{not json")
    send(page, "again")
    last_answer(page).and_(page.locator("[data-state=error]")).wait_for()
    assert page.inner_text("#error").startswith("tools: not JSON")
    page.fill("#tools", "")


def test_stop_aborts_the_stream(fake):
    engine, url, page = fake
    page.click("#clear")
    send(page, "Weather in Paris?")
    answer = last_answer(page)
    page.wait_for_function("window.playground.timings.firstTokenMs !== null", polling=20)  # set per answer
    page.click("#stop")
    answer.and_(page.locator("[data-state=stopped]")).wait_for()
    assert answer.locator(".tool-card").count() == 0 and page.locator("#error").is_hidden()
    deadline = time.monotonic() + 30
    while not engine.aborted and time.monotonic() < deadline:  # the server aborts the engine request
        time.sleep(0.05)
    assert engine.aborted


def test_infill_streams_the_middle(fake):
    engine, url, page = fake
    page.click("#tabs button[data-tab=infill]")
    page.fill("#max-tokens", "12")
    page.click("#infill-run")
    page.wait_for_function("document.getElementById('infill-info').textContent.includes('tokens')", polling=100)
    prefix, suffix = page.input_value("#infill-prefix"), page.input_value("#infill-suffix")
    ref = httpx.post(url + "/infill", json={"input_prefix": prefix, "input_suffix": suffix, "n_predict": 12,
                                            "temperature": 0.7, "top_p": 1}, timeout=60).json()
    assert page.inner_text("#infill-out mark") == ref["content"] and ref["content"]
    assert page.inner_text("#infill-info").startswith(f"{ref['tokens_predicted']} tokens") and "format glm" in page.inner_text("#infill-info")
    assert page.locator("#error").is_hidden()
