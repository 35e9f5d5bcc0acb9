"""Code completion through the live server (real engine, tiny GLM blank-infilling checkpoint): OpenAI's
`suffix` via the official client and llama.cpp's `/infill` (its body and response shape, streaming ==
non-streaming), both equal to a naive full-recompute GLM infill; beam search and the temperature
schedule as request options; bad input (4xx naming the field); truncation reported."""

import json

import httpx
import openai
import pytest
import torch

from glm5.data.tokenizer import load_tokenizer
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.infill import InfillError, build_infill, choose_format
from glm5.infer.llm import LLM
from glm5.infer.sampling import SamplingParams
from glm5.model.config import ModelConfig
from glm5.model.model import GLM5ForCausalLM
from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.serving_infill import _CodeStop
from glm5.serve.testing import serve_in_thread

TOK = load_tokenizer("bundled:tokenizer-8k")
EOP = TOK.token_to_id("<eop>")
MAX_LEN = 160


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0,
                                  block_position_embedding=True, max_block_positions=256)
    torch.manual_seed(0)
    m = GLM5ForCausalLM(cfg).init_weights(0).eval()
    with torch.no_grad():
        m.lm_head.weight[EOP] *= 4.0  # some spans end with <eop> within a few tokens
    return m


@pytest.fixture(scope="module")
def live(model):
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_LEN, num_blocks=96,
                                    block_size=16, batch_timeout_ms=0), model=model, tokenizer=TOK)
    app = create_app(engine, config=ServerConfig(api_key="k"), model_name="tiny-glm")
    with serve_in_thread(app) as url:
        yield url


def naive(model, ids, layout, max_new):
    """Greedy Part B by full recompute with GLM's masks and 2D positions written out."""
    seq, out = list(ids), []
    sep, span = layout.part_a_len, layout.span_position
    for _ in range(max_new):
        n = len(seq)
        pos = [i if i < sep else span for i in range(n)]
        blk = [0 if i < sep else i - sep + 1 for i in range(n)]
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = (k < sep) | ((q >= sep) & (k <= q))
        logits = model(torch.tensor([seq]), position_ids=torch.tensor([pos]), attention_mask=mask[None],
                       block_position_ids=torch.tensor([blk])).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        if tok == EOP:
            break
        seq.append(tok)
    return out


def expected_text(model, prefix, suffix, max_new, extra=(), middle=""):
    ip = build_infill(TOK, "glm", prefix, suffix, room=MAX_LEN - max_new, extra=list(extra), middle_start=middle)
    return TOK.decode(naive(model, ip.token_ids, ip.layout, max_new), skip_special_tokens=True)


PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return result\n"


def test_openai_suffix_is_glm_infill(live, model):
    c = openai.OpenAI(base_url=live + "/v1", api_key="k", max_retries=0)
    r = c.completions.create(model="tiny-glm", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
    assert r.choices[0].text == expected_text(model, PREFIX, SUFFIX, 8)


def post(url, body, **kw):
    return httpx.post(url + "/infill", json=body, headers={"Authorization": "Bearer k"}, timeout=120, **kw)


def test_llama_cpp_infill_shape_and_stream(live, model):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "res",
            "input_extra": [{"filename": "util.py", "text": "import math\n"}], "n_predict": 8,
            "temperature": 0, "return_tokens": True}
    r = post(live, body)
    assert r.status_code == 200, r.text
    js = r.json()
    want = expected_text(model, PREFIX, SUFFIX, 8, [("util.py", "import math\n")], "res")
    assert js["content"] == want
    assert js["stop"] is True and js["stop_type"] in ("eos", "limit") and js["truncated"] is False
    assert js["tokens_predicted"] == len(js["tokens"]) > 0 and js["tokens_evaluated"] > 0
    assert {"timings", "generation_settings", "tokens_cached", "stopping_word"} <= set(js)
    # streaming: SSE chunks with content deltas, a final stop object, no [DONE] (llama.cpp's native shape)
    with httpx.stream("POST", live + "/infill", json={**body, "stream": True},
                      headers={"Authorization": "Bearer k"}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == want
    assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
    # the same request again: its Part A comes from the prefix cache
    assert post(live, body).json()["tokens_cached"] > 0


def test_infill_bad_input(live):
    r = post(live, {"input_prefix": "a", "input_extra": [{"filename": "x.py"}]})
    assert r.status_code == 400 and "input_extra.0.text" in r.json()["error"]["message"]
    r = post(live, {"input_prefix": "a", "n_predict": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_predict"
    r = httpx.post(live + "/v1/completions", json={"prompt": [1, 2, 3], "suffix": "x"},
                   headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    r = httpx.post(live + "/v1/completions", json={"prompt": "a", "suffix": "x", "echo": True},
                   headers={"Authorization": "Bearer k"})
    assert r.status_code == 400


def test_truncation_reported(live):
    long = "x = 1\n" * 400  # ~far more tokens than max_model_len
    r = post(live, {"input_prefix": long, "input_suffix": long, "n_predict": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    js = r.json()
    assert js["truncated"] is True and js["truncated_tokens"]["prefix"] > 0 and js["truncated_tokens"]["suffix"] > 0
    assert js["tokens_evaluated"] <= MAX_LEN - 4
    assert "prefix=" in r.headers["X-Infill-Truncated"]


def test_truncation_off_is_a_clear_error():
    with pytest.raises(InfillError, match="only"):
        build_infill(TOK, "glm", "a " * 500, "", room=64, truncate=False)


def test_format_choice_and_missing_tokens():
    assert choose_format(TOK, has_block_positions=True) == "glm"
    # the bundled vocabulary has GLM's <|code_*|> tokens: a causal model gets GLM's code-completion prompt
    assert choose_format(TOK, has_block_positions=False) == "codegeex"
    assert choose_format(TOK, has_block_positions=True, requested="spm") == "spm"
    with pytest.raises(InfillError, match="block_position_embedding"):
        choose_format(TOK, has_block_positions=False, requested="glm")


def test_beam_search_and_temperature_schedule_requests(live, model):
    c = openai.OpenAI(base_url=live + "/v1", api_key="k", max_retries=0)
    r = c.completions.create(model="tiny-glm", prompt="import os", max_tokens=4, n=2,
                             extra_body={"use_beam_search": True, "beam_width": 3, "length_penalty": 1.0,
                                         "ignore_eos": True})
    llm = LLM("tiny", model_obj=model, tokenizer=TOK, device="cpu", max_model_len=MAX_LEN)
    ref = llm.beam_search([TOK.encode("import os", add_special_tokens=True)],
                          SamplingParams(temperature=0, use_beam_search=True, beam_width=3, max_tokens=4,
                                         ignore_eos=True))[0]
    assert [ch.text for ch in r.choices] == [o.text for o in ref.outputs[:2]]
    # a schedule from 0 to 0 is greedy; a seeded schedule is reproducible
    greedy = c.completions.create(model="tiny-glm", prompt="import os", max_tokens=6, temperature=0)
    sched = c.completions.create(model="tiny-glm", prompt="import os", max_tokens=6,
                                 extra_body={"temperature_schedule": [0.0, 0.0]})
    assert sched.choices[0].text == greedy.choices[0].text
    a, b = (c.completions.create(model="tiny-glm", prompt="import os", max_tokens=6, seed=3,
                                 extra_body={"temperature_schedule": [0.8, 0.2]}) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    r = post(live, {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4, "use_beam_search": True,
                    "beam_width": 2})
    assert r.status_code == 200 and r.json()["stop"] is True


def test_code_stop_rules():
    stop = _CodeStop(n_indent=4, t_max_ms=0)
    assert stop.cut("x = 1\n    y = 2\n    z") is None
    assert stop.cut("x = 1\n    y = 2\nprint(y)") == len("x = 1\n    y = 2\n")
    assert stop.cut("x\n\n    ok") is None  # blank lines do not stop
    timed = _CodeStop(n_indent=0, t_max_ms=1)
    timed.cut("a")
    import time
    time.sleep(0.01)
    assert timed.cut("ab\ncd") == 3 and timed.cut("abcd") is None


def test_llm_infill_and_cli(model, tmp_path, capsys):
    from glm5.cli.generate import main as generate_main
    from glm5.model.hf_adapter import save_pretrained
    llm = LLM("tiny", model_obj=model, tokenizer=TOK, device="cpu", max_model_len=MAX_LEN)
    params = SamplingParams(temperature=0, max_tokens=6)
    out = llm.infill(PREFIX, SUFFIX, params)
    assert out.outputs[0].text == expected_text(model, PREFIX, SUFFIX, 6)
    beams = llm.infill(PREFIX, SUFFIX, SamplingParams(temperature=0, max_tokens=3, use_beam_search=True,
                                                      beam_width=2))
    assert len(beams.outputs) == 2 and beams.outputs[0].token_ids
    save_pretrained(model, tmp_path)
    TOK.save(tmp_path)
    assert generate_main(["--model", str(tmp_path), "--prompt", PREFIX, "--suffix", SUFFIX, "--temperature", "0",
                          "--max-tokens", "6", "--device", "cpu", "--max-model-len", str(MAX_LEN)]) == 0
    assert capsys.readouterr().out == out.outputs[0].text + "\n"
