"""Server lifecycle against the scripted engine: shutdown drains for the grace period, then every open
stream ends with an error chunk and `[DONE]` (issue 16: a SIGTERM cut streams with neither); an engine
that dies of a fault no request explains stops the server (so `glm5 serve` exits non-zero) instead of
answering 503 forever; the messages say "engine failed" or "shutting down", whichever is true."""

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.server import GracefulServer
from glm5.serve.testing import free_port, serve_in_thread
from tests.test_serve_app import FakeEngine


def start(app, grace_s: float) -> tuple[GracefulServer, threading.Thread, str]:
    port = free_port()
    server = GracefulServer(app, "127.0.0.1", port, grace_s, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def stream_lines(url: str, body: dict, lines: list, first: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                first.set()


def test_shutdown_drains_then_ends_streams_with_an_error_chunk_and_done():
    engine = FakeEngine(step_sleep=0.1)
    app = create_app(engine, config=ServerConfig(shutdown_timeout_s=2.0), model_name="fake")
    server, thread, url = start(app, grace_s=2.0)
    lines, first = [], threading.Event()
    reader = threading.Thread(target=stream_lines, args=(url, {"prompt": "x", "max_tokens": 500}, lines, first))
    reader.start()
    assert first.wait(30)
    short, short_first = [], threading.Event()
    sender = threading.Thread(target=stream_lines, args=(url, {"prompt": "x", "max_tokens": 3}, short, short_first))
    sender.start()
    assert short_first.wait(30)
    server.should_exit = True  # what SIGTERM does
    reader.join(60)
    sender.join(60)
    thread.join(60)
    assert not thread.is_alive() and not reader.is_alive()
    assert short[-1] == "data: [DONE]" and json.loads(short[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert err["code"] == "server_shutting_down" and "grace period" in err["message"], err
    assert len(lines) >= 3  # tokens, then the error chunk, then [DONE]
    assert engine.aborted == [next(iter(engine.aborted))] and not engine.reqs


def test_an_engine_fault_stops_the_server():
    engine = FakeEngine(fail_step=True)
    server: GracefulServer | None = None
    app = create_app(engine, config=ServerConfig(), model_name="fake",
                     on_engine_failure=lambda e: server.engine_failed(e))
    server, thread, url = start(app, grace_s=1.0)
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["message"].startswith("engine failed")
    thread.join(60)
    assert not thread.is_alive() and isinstance(server.engine_failure, RuntimeError)


@pytest.mark.slow
def test_cli_sigterm_ends_a_stream_with_an_error_chunk(tmp_path):
    """`glm5 serve` as a subprocess: SIGTERM during a long stream; after `shutdown_timeout_s` the stream
    gets an error chunk and [DONE], and the process exits."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "glm5.cli.main", "serve", "--model", "tiny", "--port", str(port),
                             "--device=cpu", "--batch_timeout_ms=0", "--max_model_len=4096",
                             "--shutdown_timeout_s=1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        lines, first = [], threading.Event()
        reader = threading.Thread(target=stream_lines, args=(
            url, {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}, lines, first))
        reader.start()
        assert first.wait(60)
        proc.terminate()
        reader.join(60)
        assert lines[-1] == "data: [DONE]" and "server_shutting_down" in lines[-2], lines[-3:]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


class BlockingTokenizer:
    """The test tokenizer, except that encoding a text containing BLOCK waits until released: a stand-in
    for a multi-megabyte prompt that takes seconds to tokenise."""

    def __init__(self, tok):
        self.tok, self.entered, self.release = tok, threading.Event(), threading.Event()

    def encode(self, text, **kw):
        if "BLOCK" in text:
            self.entered.set()
            assert self.release.wait(60)
        return self.tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "BLOCK", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "BLOCK"}], "max_tokens": 2}),
    ("/tokenize", {"prompt": "BLOCK"}),
])
def test_health_and_other_requests_answer_while_a_prompt_is_tokenised(path, body):
    """Before: tokenising ran on the event loop, so a 3.9 MB prompt froze /health and every stream."""
    engine = FakeEngine()
    tok = BlockingTokenizer(engine.tokenizer)
    app = create_app(engine, tokenizer=tok, config=ServerConfig(), model_name="fake")
    with serve_in_thread(app) as url:
        slow: dict = {}
        sender = threading.Thread(target=lambda: slow.update(r=httpx.post(url + path, json=body, timeout=120)))
        sender.start()
        try:
            assert tok.entered.wait(30)
            assert httpx.get(url + "/health", timeout=20).status_code == 200  # the event loop is free
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=20)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        finally:
            tok.release.set()
            sender.join(60)
        assert slow["r"].status_code == 200, slow["r"].text


def test_a_tiny_kv_budget_is_one_line_naming_the_setting(capsys):
    """Before: `need num_blocks >= 1 and block_size >= 1, got 0, 16` with a traceback."""
    from glm5.cli.serve import main
    assert main(["--model", "tiny", "--device=cpu", "--kv_cache_memory=1000", "--max_model_len=64"]) == 2
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out
    assert "kv_cache_memory=1000" in out and "kv_cache_memory >=" in out, out
