"""Evaluating over the OpenAI API: against a live `glm5 serve` the harness's URL path, lm-eval's own
`local-completions` model and the direct engine path give the same log-likelihoods; a flaky server is
retried, a dead one is reported without losing finished documents, and a rerun resumes."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from glm5.data.tokenizer import load_tokenizer
from glm5.eval.engine_model import EngineModel
from glm5.eval.harness import run_task
from glm5.eval.lm import GenerationParams
from glm5.eval.openai_model import ModelUnavailable, OpenAIClient, OpenAIModel
from glm5.eval.tasks import TaskConfig, build_task

from .eval_fixtures import make_checkpoint, make_mmlu

REQUESTS = [("Question: what is 2+2?\nAnswer:", " 4"), ("Hello", " world, how are you"), ("中文", "测试一下"),
            ("", "empty context")]


@pytest.fixture(scope="module")
def live(tmp_path_factory, one_thread):
    from glm5.infer.config import EngineConfig
    from glm5.infer.engine import LLMEngine
    from glm5.serve.app import create_app
    from glm5.serve.testing import serve_in_thread

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"))
    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", dtype="float32", max_model_len=256,
                                    num_blocks=128, max_num_seqs=16, preferred_batch_size=1, batch_timeout_ms=0))
    with serve_in_thread(create_app(engine, model_name="tiny")) as url:
        yield {"url": url, "ckpt": ckpt, "direct": EngineModel(str(ckpt), max_length=128, device="cpu")}


def test_url_path_equals_direct_path(live):
    remote = OpenAIModel(live["url"], tokenizer=load_tokenizer(live["ckpt"]), max_length=128, batch_size=3)
    assert remote.model == "tiny"
    got, ref = remote.loglikelihood(REQUESTS), live["direct"].loglikelihood(REQUESTS)
    for (a, ga), (b, gb) in zip(got, ref):
        assert a == pytest.approx(b, abs=1e-3) and ga == gb
    params = GenerationParams(max_tokens=6)
    assert remote.generate(["The sky is"], params) == live["direct"].generate(["The sky is"], params)


def test_lm_eval_local_completions_equals_direct_path(live):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=live["url"] + "/v1/completions", model="tiny", tokenizer_backend="huggingface",
                             tokenizer=str(live["ckpt"]), max_length=129, num_concurrent=1, max_retries=1)
    reqs = REQUESTS[:3]  # lm-eval's API model needs a non-empty context
    ref = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)])
    direct = live["direct"]
    direct.add_special_tokens = False  # lm-eval's API models never add the tokenizer's prefix tokens
    try:
        got = direct.loglikelihood(reqs)
    finally:
        direct.add_special_tokens = True
    for (a, ga), (b, gb) in zip(got, ref):
        assert a == pytest.approx(b, abs=1e-3) and ga == gb


class Flaky(BaseHTTPRequestHandler):
    """Scores every echoed token at -1 (top: itself); fails with 503 on the request numbers in `fail`."""

    count, fail = 0, set()

    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"data": [{"id": "flaky"}]})

    def do_POST(self):
        type(self).count += 1
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).count in type(self).fail:
            return self._send(503, {"error": {"message": "overloaded"}})
        if req.get("max_tokens") == 1 and req.get("echo"):
            choices = [{"index": i, "text": "", "logprobs": {"token_logprobs": [None] + [-1.0] * len(p),
                                                               "top_logprobs": [None] + [{"x": -1.0}] * len(p)}}
                       for i, p in enumerate(req["prompt"])]
            return self._send(200, {"choices": choices})
        return self._send(400, {"error": {"message": "bad request"}})


@pytest.fixture
def flaky():
    Flaky.count, Flaky.fail = 0, set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _model(url, retries=2):
    return OpenAIModel(url, tokenizer=load_tokenizer(make_checkpoint.__globals__["TOKENIZER"]),
                       client=OpenAIClient(url, retries=retries, backoff=0.01), batch_size=4, concurrency=1)


def test_retries_then_reports_and_resume(flaky, tmp_path):
    Flaky.fail = {1, 2}  # two 503s, then answers
    assert _model(flaky).loglikelihood([("a", " b")]) == [(-1.0, True)]
    with pytest.raises(ValueError, match="HTTP 400"):  # a client error is not retried
        _model(flaky).client.request("/completions", {"max_tokens": 5})
    task = build_task(TaskConfig(task="mmlu", data=str(make_mmlu(tmp_path / "mmlu"))))
    out = tmp_path / "mmlu.json"
    Flaky.count, Flaky.fail = 0, set(range(2, 100))  # the first chunk succeeds, then the server is down
    with pytest.raises(ModelUnavailable, match=r"no answer after 3 tries \(HTTP 503"):
        run_task(task, _model(flaky), out, model_name="flaky", chunk=1, progress=False)
    assert len(out.with_suffix(".records.jsonl").read_text().splitlines()) == 2  # header + one document
    Flaky.count, Flaky.fail = 0, set()
    res = run_task(task, _model(flaky), out, model_name="flaky", chunk=1, progress=False)
    assert res["n"] == 8 and Flaky.count == 7  # only the other seven documents were asked


def test_refused_connection_is_reported():
    from glm5.serve.testing import free_port
    url = f"http://127.0.0.1:{free_port()}"
    client = OpenAIClient(url, retries=1, backoff=0.01)
    with pytest.raises(ModelUnavailable, match="no answer after 2 tries"):
        client.request("/models")


def test_chat_prompts_engine_and_server_agree(live):
    """`chat=True` renders one user turn with the chat template: the engine path equals the engine's own
    `LLM.chat`, and the URL path (server-side template via /v1/chat/completions) equals both."""
    from glm5.infer.sampling import SamplingParams

    direct = live["direct"]
    params = GenerationParams(max_tokens=5, chat=True)
    got = direct.generate(["Hello there"], params)[0][0]
    ref = direct.llm.chat([{"role": "user", "content": "Hello there"}], SamplingParams(temperature=0, max_tokens=5))
    assert got == ref.outputs[0].text
    remote = OpenAIModel(live["url"], tokenizer=load_tokenizer(live["ckpt"]), max_length=128)
    answer = remote.generate(["Hello there"], params)[0][0]  # the reply's `content` (reasoning left out)
    msg = remote.client.request("/chat/completions", {"model": "tiny", "max_tokens": 5, "temperature": 0, "messages": [
        {"role": "user", "content": "Hello there"}]})["choices"][0]["message"]
    full = (msg.get("reasoning_content") or "") + (msg["content"] or "")
    assert full.strip() == got.strip() and answer == (msg["content"] or "")  # the parser trims whitespace
