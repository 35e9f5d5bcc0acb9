"""`/metrics` for speculative decoding and the prefix cache, scraped from a live server on the REAL engine
(tiny model with one MTP layer drafting 2 tokens): vLLM's spec-decode counter families with their
`_total` samples and a `position` label, values equal to the proposer's own counts and consistent with
each other (a position is accepted only after every earlier one), and the prefix-cache hit rate after
a repeated prompt; and the Grafana dashboard in docs/ queries only series `/metrics` writes. Per-adapter
request counts are checked in test_serve_lora.py.
"""

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from glm5.data.tokenizer import load_tokenizer
from glm5.infer.config import EngineConfig
from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.metrics import ServerMetrics
from glm5.serve.testing import serve_in_thread
from tests._tiny import tiny_model

engine_mod = pytest.importorskip("glm5.infer.engine")
K = 2


def scrape(url: str) -> dict[str, float]:
    """Sample name (with labels) -> value."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_spec_decode_and_prefix_cache_metrics():
    engine = engine_mod.LLMEngine(EngineConfig(device="cpu", num_blocks=64, block_size=4, max_model_len=64,
                                               speculative_num_tokens=K),
                                  model=tiny_model(seed=11, index_topk=6, num_nextn_predict_layers=1))
    app = create_app(engine, tokenizer=load_tokenizer("bundled:tokenizer-8k"), config=ServerConfig(),
                     model_name="tiny")
    with serve_in_thread(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        prompt = [5, 17, 42, 99, 3, 250, 7, 8, 11, 12, 13, 14]
        for _ in range(2):  # the second time the prompt's full blocks come from the prefix cache
            c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
        m = scrape(url)
    label = '{model_name="tiny"}'
    stats = engine.runner.proposer.stats()
    drafts = m["vllm:spec_decode_num_drafts_total" + label]
    draft_tokens = m["vllm:spec_decode_num_draft_tokens_total" + label]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total" + label]
    per_pos = [m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{i}"}}']
               for i in range(K)]
    assert (drafts, draft_tokens, accepted) == (stats["spec_num_drafts"], stats["spec_num_draft_tokens"],
                                                stats["spec_num_accepted_tokens"])
    assert drafts > 0 and drafts <= draft_tokens <= K * drafts
    assert sum(per_pos) == accepted <= draft_tokens and per_pos == sorted(per_pos, reverse=True)
    assert not any(re.match(r"vllm:spec_decode_num_accepted_tokens_per_pos_total.*position=\"2\"", k) for k in m)
    engine_stats = engine.get_stats()
    rate = m["vllm:gpu_prefix_cache_hit_rate" + label]
    assert rate > 0 and rate == pytest.approx(engine_stats["prefix_cache_hits"] / engine_stats["prefix_cache_queries"])


def test_no_spec_decode_series_without_drafting():
    engine = engine_mod.LLMEngine(EngineConfig(device="cpu", num_blocks=32, block_size=4, max_model_len=64),
                                  model=tiny_model(seed=1))
    app = create_app(engine, tokenizer=load_tokenizer("bundled:tokenizer-8k"), config=ServerConfig(),
                     model_name="tiny")
    with serve_in_thread(app) as url:
        text = httpx.get(url + "/metrics").text
    assert "vllm:spec_decode" not in text and 'vllm:gpu_prefix_cache_hit_rate{model_name="tiny"} 0.0' in text


def test_grafana_dashboard_reads_only_exposed_series():
    """docs/grafana-glm5-serve.json: every series a panel queries, and every label it groups by, is one
    `/metrics` writes (rendered with every optional family present: MTP, expert load, an adapter)."""
    metrics = ServerMetrics("tiny")
    metrics.count_lora_request("sql")
    metrics.inc("vllm:request_success_total", 1.0, "stop")
    stats = {"num_running": 1, "prefix_cache_queries": 8, "prefix_cache_hits": 4, "spec_num_drafts": 3,
             "spec_num_draft_tokens": 6, "spec_num_accepted_tokens": 4, "spec_num_accepted_tokens_per_pos": [3, 1],
             "expert_load": {1: {"tokens_per_expert": [2, 0], "imbalance": 2.0}}}
    labels_of: dict[str, set[str]] = {}
    for line in metrics.render(stats).splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels_of.setdefault(name, set()).update(re.findall(r'(\w+)="', rest))
    dash = json.loads((Path(__file__).parent.parent / "docs" / "grafana-glm5-serve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 14
    for expr in exprs:
        names = re.findall(r"\b((?:vllm|glm5):\w+)", expr)
        assert names, expr
        for name in names:
            assert name in labels_of, f"{name} is not exposed"
        for grouped in re.findall(r"by \(([\w, ]+)\)", expr):
            for label in (g.strip() for g in grouped.split(",")):
                assert label == "le" or any(label in labels_of[n] for n in names), f"{label} in {expr}"
