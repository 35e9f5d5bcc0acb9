"""The OCR agent on the OpenAI server (tiny random checkpoint, real OCR): `POST /v1/ocr` by upload and
base64, chat `image_url` parts through the official openai client with the OCR text in the prompt,
bad images as 4xx while the server stays up, and the per-page limits: a page over the work budget is a 413,
one past the deadline a 504 (both OpenAI error objects), and the next page is read as before."""

import base64

import httpx
import openai
import pytest
import torch

pytest.importorskip("rapidocr_onnxruntime")
pytest.importorskip("multipart")

from glm5.apps.ocr import server as ocr_server  # noqa: E402
from glm5.apps.ocr.agent import OcrAgent, OcrConfig  # noqa: E402
from glm5.data.tokenizer import load_tokenizer  # noqa: E402
from glm5.infer.config import EngineConfig  # noqa: E402
from glm5.infer.engine import LLMEngine  # noqa: E402
from glm5.model.config import ModelConfig  # noqa: E402
from glm5.model.hf_adapter import save_pretrained  # noqa: E402
from glm5.model.model import GLM5ForCausalLM  # noqa: E402
from glm5.serve.app import create_app  # noqa: E402
from glm5.serve.testing import serve_in_thread  # noqa: E402
from tests._ocr_images import MANY, CountingSession, blank_png, estimate, text_png  # noqa: E402
from tests.test_ocr_image import png_header  # noqa: E402

TOK = load_tokenizer("glm5/data/assets/tokenizer-8k")


@pytest.fixture(scope="module")
def live(tmp_path_factory, one_thread):
    path = tmp_path_factory.mktemp("tiny-ckpt")
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    save_pretrained(GLM5ForCausalLM(cfg).init_weights(0).eval(), path)
    TOK.save(path)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=512,
                                    num_blocks=128, block_size=16, max_num_seqs=8))
    agent = OcrAgent(OcrConfig(rounds=1, num_threads=1))
    app = create_app(engine, model_name="tiny", image_reader=lambda url: ocr_server.image_part_text(agent, url))
    ocr_server.install(app, agent)
    plain = create_app(engine, model_name="tiny")  # no OCR: image parts are refused
    with serve_in_thread(app) as url, serve_in_thread(plain) as plain_url:
        yield {"url": url, "plain": plain_url, "agent": agent}


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_ocr_route_upload_and_base64(live):
    r = httpx.post(live["url"] + "/v1/ocr", files={"file": ("page.png", text_png(), "image/png")},
                   data={"format": "txt", "rounds": "0"}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "ocr.page" and body["format"] == "txt" and "lazy dog" in body["text"]
    assert body["page"]["blocks"] and body["page"]["name"] == "page.png"
    r = httpx.post(live["url"] + "/v1/ocr", json={"image": base64.b64encode(text_png()).decode(), "format": "json"},
                   timeout=120)
    assert r.status_code == 200 and '"blocks"' in r.json()["text"]
    r = httpx.post(live["url"] + "/v1/ocr", json={"image": data_url(blank_png())}, timeout=120)
    assert r.status_code == 200 and r.json()["text"] == "" and r.json()["page"]["blocks"] == []


@pytest.mark.parametrize("kwargs,status,words", [
    (dict(json={"image": base64.b64encode(b"not an image").decode()}), 400, "not a supported image"),
    (dict(json={"image": "@@@"}), 400, "invalid base64"),
    (dict(json={"image": base64.b64encode(png_header(7000, 7000)).decode()}), 400, "more than the limit"),
    (dict(json={"image": base64.b64encode(png_header(0, 5)).decode()}), 400, "image"),
    (dict(json={"image": "AAAA", "format": "pdf"}), 400, "format"),
    (dict(json={"image": "AAAA", "rounds": 99}), 400, "rounds"),
    (dict(json={"picture": "AAAA"}), 400, "image"),
    (dict(content=b"{not json", headers={"content-type": "application/json"}), 400, "Malformed JSON"),
    (dict(content=b"raw", headers={"content-type": "text/plain"}), 415, "Content-Type"),
    (dict(files={"document": ("a.png", b"x", "image/png")}), 400, "file"),
])
def test_ocr_route_bad_input_is_4xx_and_server_stays_up(live, kwargs, status, words):
    r = httpx.post(live["url"] + "/v1/ocr", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert httpx.get(live["url"] + "/health", timeout=30).status_code == 200


def test_chat_image_part_enters_the_prompt(live):
    client = openai.OpenAI(base_url=live["url"] + "/v1", api_key="none", max_retries=0, timeout=120)
    url = data_url(text_png())
    messages = [{"role": "user", "content": [{"type": "text", "text": "What does the image say?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    # reference: the same prompt with the part replaced by the agent's text, tokenised by the template
    ocr_text = ocr_server.image_part_text(live["agent"], url)
    assert "lazy dog" in ocr_text
    ref = [{"role": "user", "content": "What does the image say?" + ocr_text}]
    want = len(TOK.apply_chat_template(ref, add_generation_prompt=True, tokenize=True))
    assert r.usage.prompt_tokens == want
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_bad_image_and_no_ocr_are_400(live):
    client = openai.OpenAI(base_url=live["url"] + "/v1", api_key="none", max_retries=0, timeout=60)
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]}]
    with pytest.raises(openai.BadRequestError, match="not a supported image"):
        client.chat.completions.create(model="tiny", messages=bad, max_tokens=2)
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(openai.BadRequestError, match="only inline `data:` URLs"):
        client.chat.completions.create(model="tiny", messages=remote, max_tokens=2)
    plain = openai.OpenAI(base_url=live["plain"] + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="--ocr"):
        plain.chat.completions.create(model="tiny", messages=bad, max_tokens=2)
    assert httpx.get(live["url"] + "/health", timeout=30).status_code == 200


# ------------------------------------------------ limits: 413 over the work budget, 504 past the deadline

@pytest.fixture
def counted(live, monkeypatch):
    """The server's recogniser counting its runs, each one second on the agent's (fake) deadline clock."""
    agent, now = live["agent"], [0.0]
    session = CountingSession(agent.perception.recognizer.session, now)
    monkeypatch.setattr(agent.perception.recognizer, "session", session)
    monkeypatch.setattr(agent, "clock", lambda: now[0])
    return session


def error_of(r: httpx.Response, status: int, type_: str, param: str, code: str) -> str:
    """The OpenAI error object of a response with `status` -> its message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == (type_, param, code), body
    return body["error"]["message"]


def chat(url: str, png: bytes) -> httpx.Response:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What does the image say?"},
                                             {"type": "image_url", "image_url": {"url": data_url(png)}}]}]
    return httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2,
                                                          "temperature": 0}, timeout=120)


def assert_small_page_read(live):
    """A normal page after a refused one: /v1/ocr reads it, and chat puts its OCR text in the prompt."""
    r = httpx.post(live["url"] + "/v1/ocr", json={"image": base64.b64encode(text_png()).decode(), "format": "txt",
                                                  "rounds": 0}, timeout=120)
    assert r.status_code == 200 and "lazy dog" in r.json()["text"], r.text
    r = chat(live["url"], text_png())
    assert r.status_code == 200, r.text
    ocr_text = ocr_server.image_part_text(live["agent"], data_url(text_png()))
    assert "lazy dog" in ocr_text
    ref = [{"role": "user", "content": "What does the image say?" + ocr_text}]
    assert r.json()["usage"]["prompt_tokens"] == len(TOK.apply_chat_template(ref, add_generation_prompt=True,
                                                                             tokenize=True))


def test_page_over_the_work_budget_is_413(live, counted, monkeypatch):
    agent, small, many = live["agent"], text_png(), text_png(MANY)
    need_small, need_many = estimate(agent, small).total(1), estimate(agent, many).total(1)  # the agent: rounds=1
    assert need_small < need_many
    monkeypatch.setattr(agent.config, "max_work_mpx", (need_small + need_many) / 2)
    r = httpx.post(live["url"] + "/v1/ocr", files={"file": ("many.png", many, "image/png")}, timeout=120)
    msg = error_of(r, 413, "invalid_request_error", "image", "ocr_work_limit")
    assert msg.startswith("many.png: reading this page needs an estimated ") and "--ocr-max-work-mpx" in msg
    msg = error_of(chat(live["url"], many), 413, "invalid_request_error", "messages", "ocr_work_limit")
    assert msg.startswith("image_url: reading this page needs an estimated ")
    assert counted.runs == 0  # both refused before any line was recognised
    assert_small_page_read(live)  # under the same budget
    assert counted.runs > 0


def test_page_past_the_deadline_is_504(live, counted, monkeypatch):
    agent = live["agent"]
    monkeypatch.setattr(agent.config, "timeout_s", 1.5)  # fake seconds: two recogniser batches
    body = {"image": base64.b64encode(text_png(MANY)).decode(), "name": "many.png", "rounds": 0}
    r = httpx.post(live["url"] + "/v1/ocr", json=body, timeout=120)
    msg = error_of(r, 504, "timeout_error", "image", "ocr_timeout")
    assert msg.startswith("OCR stopped at the recognition stage: the page took longer than the limit of 1.5 s")
    assert "--ocr-timeout-s" in msg and counted.runs == 2  # the worker stopped after the 2nd of >= 3 batches
    msg = error_of(chat(live["url"], text_png(MANY)), 504, "timeout_error", "messages", "ocr_timeout")
    assert msg.startswith("OCR stopped at the recognition stage") and counted.runs == 4
    monkeypatch.setattr(agent.config, "timeout_s", 10.0)  # a limit the small page fits in
    assert_small_page_read(live)
