"""Multi-LoRA over HTTP with the official `openai` client and the real engine: `model` = adapter name,
/v1/models lists adapters, vLLM's load/unload routes behind the admin key, 4xx on misuse, and
concurrent requests for two adapters and the base each equal to their merged model's greedy output."""

import asyncio

import httpx
import openai
import pytest
import torch

from glm5.data.tokenizer import load_tokenizer
from glm5.finetune.adapters import from_pretrained
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.model import lora
from glm5.model.config import ModelConfig
from glm5.model.hf_adapter import save_pretrained
from glm5.model.model import GLM5ForCausalLM
from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.testing import serve_in_thread

KEY, ADMIN = "sk-test", "admin-test"
TOK = load_tokenizer("bundled:tokenizer-8k")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-lora")
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    save_pretrained(GLM5ForCausalLM(cfg).init_weights(0).eval(), root / "base")
    TOK.save(root / "base")
    for k, name in enumerate(("sql", "poet")):
        m = from_pretrained(root / "base")
        m.add_lora(lora.LoraConfig(r=4, alpha=8, targets=["attn", "experts"] if k else ["mlp", "o_proj"]))
        with torch.no_grad():
            for t, mod in lora.lora_layers(m):
                (mod.lora_B.weight if t.param is None else mod.lora_B).normal_(0, 0.3)
        m.save_adapter(root / name)
    engine = LLMEngine(EngineConfig(model=str(root / "base"), device="cpu", dtype="float32", max_model_len=128,
                                    num_blocks=128, max_loras=3, lora_modules={"sql": str(root / "sql")},
                                    preferred_batch_size=3, batch_timeout_ms=200))
    app = create_app(engine, config=ServerConfig(api_key=KEY, admin_key=ADMIN), model_name="tiny")
    with serve_in_thread(app) as url:
        yield {"url": url, "root": root, "engine": engine}


def merged_greedy(root, adapter, n):
    model = from_pretrained(root / "base", adapter=None if adapter is None else root / adapter)
    if adapter is not None:
        model.merge_adapter()
    ids = TOK.encode(PROMPT, add_special_tokens=True)
    out = model.generate_greedy(torch.tensor([ids]), n)
    return TOK.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def admin(live, route, body, key=ADMIN):
    return httpx.post(f"{live['url']}/v1/{route}", json=body, headers={"Authorization": f"Bearer {key}"})


def test_adapters_as_models_and_runtime_loading(live):
    client = openai.OpenAI(base_url=live["url"] + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny", "sql"]
    # admin key required; bad bodies and bad adapters are 4xx and change nothing
    assert admin(live, "load_lora_adapter", {"lora_name": "poet", "lora_path": str(live["root"] / "poet")},
                 key=KEY).status_code == 401
    r = admin(live, "load_lora_adapter", {"lora_name": "sql", "lora_path": str(live["root"] / "poet")})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = admin(live, "load_lora_adapter", {"lora_name": "x", "lora_path": str(live["root"] / "nope")})
    assert r.status_code == 400 and "not an adapter directory" in r.json()["error"]["message"]
    r = admin(live, "load_lora_adapter", {"lora_name": "poet", "lora_path": str(live["root"] / "poet")})
    assert r.status_code == 200 and "added successfully" in r.text
    assert [m.id for m in client.models.list().data] == ["tiny", "sql", "poet"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)

    async def three():  # one batch: base, sql, poet (preferred_batch_size 3)
        aclient = openai.AsyncOpenAI(base_url=live["url"] + "/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*[aclient.completions.create(model=m, prompt=PROMPT, max_tokens=6, temperature=0,
                                                                 extra_body={"ignore_eos": True})
                                      for m in ("tiny", "sql", "poet")])

    outs = [r.choices[0].text for r in asyncio.run(three())]
    assert outs == [merged_greedy(live["root"], a, 6) for a in (None, "sql", "poet")]
    chat = client.chat.completions.create(model="poet", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "poet"  # a response names the model (adapter) it was asked for, as vLLM's do
    r = admin(live, "unload_lora_adapter", {"lora_name": "ghost"})
    assert r.status_code == 404
    r = admin(live, "unload_lora_adapter", {"lora_name": "poet"})
    assert r.status_code == 200 and [m.id for m in client.models.list().data] == ["tiny", "sql"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="poet", prompt=PROMPT, max_tokens=2)
    sql = client.completions.create(model="sql", prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert sql.choices[0].text == outs[1] and sql.model == "sql"
    r = httpx.post(live["url"] + "/v1/messages", headers={"x-api-key": KEY}, json={
        "model": "sql", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["model"] == "sql"  # Anthropic's `model` echoes the one asked for
    metrics = httpx.get(live["url"] + "/metrics").text  # finished requests per adapter (the 404s not counted)
    for name, n in (("sql", 3), ("poet", 2)):
        assert f'glm5:lora_requests_total{{model_name="tiny",lora_name="{name}"}} {n}' in metrics


def test_cli_lora_flags():
    from glm5.cli.serve import parse_args
    from glm5.core.config import ConfigError

    engine_cfg, _ = parse_args(["--model", "m", "--lora", "sql=/a/b", "--lora", "poet=/c", "--max-loras", "4"])
    assert engine_cfg.lora_modules == {"sql": "/a/b", "poet": "/c"} and engine_cfg.max_loras == 4
    with pytest.raises(ConfigError, match="expected NAME=DIR"):
        parse_args(["--model", "m", "--lora", "nodir"])


def _poisoned(live, name: str, tensor_fn=None, config_fn=None):
    """A copy of the `poet` adapter with one tensor or its config changed."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = live["root"] / "poet", live["root"] / name
    shutil.copytree(src, dst, dirs_exist_ok=True)
    if tensor_fn is not None:
        tensors = load_file(dst / "adapter_model.safetensors")
        first = sorted(tensors)[0]
        tensors[first] = tensor_fn(tensors[first].clone())
        save_file(tensors, dst / "adapter_model.safetensors")
    if config_fn is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        config_fn(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def _set(key, value):
    return lambda cfg: cfg.__setitem__(key, value)


def test_poisoned_adapters_are_refused_before_they_touch_a_batch(live):
    """Issue 30: a NaN/Inf adapter, an out-of-range rank and catastrophic regexes in adapter_config.json are
    a 400 (promptly: RE2 matches in linear time), and the base model's greedy output is unchanged after."""
    import time

    client = openai.OpenAI(base_url=live["url"] + "/v1", api_key=KEY, max_retries=0)
    before = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    evil = r"([\w.]|[\w.])*Z"
    cases = {
        "nan": (dict(tensor_fn=lambda t: t.index_fill_(0, torch.tensor([0]), float("nan"))), "NaN or Inf"),
        "inf": (dict(tensor_fn=lambda t: t.index_fill_(0, torch.tensor([0]), float("inf"))), "NaN or Inf"),
        "huge-rank": (dict(config_fn=_set("rank_pattern", {"q_a_proj": 100000})), "out of range"),
        "evil-targets": (dict(config_fn=_set("target_modules", evil)), None),
        "evil-rank-key": (dict(config_fn=_set("rank_pattern", {evil: 2})), "ok"),  # matches nothing: loads
        "backref": (dict(config_fn=_set("target_modules", r"(a)\1")), "not a supported regular expression"),
    }
    for name, (kw, message) in cases.items():
        path = _poisoned(live, f"bad-{name}", **kw)
        t0 = time.monotonic()
        r = admin(live, "load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert time.monotonic() - t0 < 10, name
        if message == "ok":
            assert r.status_code == 200 and admin(live, "unload_lora_adapter", {"lora_name": name}).status_code == 200
            continue
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (name, r.text)
        assert message is None or message in r.json()["error"]["message"], (name, r.text)
    assert [m.id for m in client.models.list().data] == ["tiny", "sql"]
    after = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert after == before


def test_an_adapter_whose_outputs_overflow_fails_only_its_own_requests(live):
    """Issue 30: finite but huge adapter weights make that adapter's logits NaN. B times the scale must be
    finite to load (it is what the engine holds: a 400 otherwise); one that is, but overflows in the
    forward pass, fails its own requests with a 500 naming the cause, while a base request batched with them
    gets its own greedy answer, and failures in a row are not taken for an engine fault (the server stays up)."""
    from safetensors.torch import load_file, save_file

    path = _poisoned(live, "overflow")
    tensors = load_file(path / "adapter_model.safetensors")
    save_file({k: (t.fill_(3e38) if "lora_B" in k else t) for k, t in tensors.items()},  # x scale 2: inf
              path / "adapter_model.safetensors")
    r = admin(live, "load_lora_adapter", {"lora_name": "overflow", "lora_path": str(path)})
    assert r.status_code == 400 and "overflows" in r.json()["error"]["message"], r.text
    save_file({k: (t.fill_(1e38) if "lora_B" in k else t) for k, t in tensors.items()},  # finite, x scale too
              path / "adapter_model.safetensors")
    assert admin(live, "load_lora_adapter", {"lora_name": "overflow", "lora_path": str(path)}).status_code == 200
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def batch():  # one batch (preferred_batch_size 3): two overflowing requests and the base
        async with httpx.AsyncClient(base_url=live["url"], headers=headers, timeout=60) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json={**body, "model": m})
                                          for m in ("overflow", "tiny", "overflow")])

    bad1, base, bad2 = asyncio.run(batch())
    assert base.status_code == 200 and base.json()["choices"][0]["text"] == merged_greedy(live["root"], None, 6)
    for r in (bad1, bad2):
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed", r.text
        assert "not finite" in r.json()["error"]["message"]
    for _ in range(3):  # alone, one after another: the adapter is to blame, not the engine
        r = httpx.post(live["url"] + "/v1/completions", json={**body, "model": "overflow"}, headers=headers)
        assert r.status_code == 500 and "not finite" in r.json()["error"]["message"]
    assert httpx.get(live["url"] + "/health").status_code == 200
    r = httpx.post(live["url"] + "/v1/completions", json={**body, "model": "tiny"}, headers=headers)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == merged_greedy(live["root"], None, 6)
    assert admin(live, "unload_lora_adapter", {"lora_name": "overflow"}).status_code == 200


def test_generated_adapter_files_are_loaded_or_refused_with_a_400(live, tmp_path_factory):
    """Issue 30 item 6: the fuzzer's adapter files. `adapter_config.json` with any of PEFT's keys set to
    generated values (ranks, alphas, regexes and lists of target modules, patterns, junk types, extra keys)
    and `adapter_model.safetensors` with tensors dropped, added, reshaped, retyped or made non-finite: the
    load route answers 200 or a 400 error object, within 10 s, and never touches the base model's output;
    an adapter that loads serves a request and unloads."""
    import json
    import shutil
    import time

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from safetensors.torch import load_file, save_file

    src = live["root"] / "poet"
    base_cfg = json.loads((src / "adapter_config.json").read_text())
    base_tensors = load_file(src / "adapter_model.safetensors")
    names = sorted(base_tensors)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    expected = merged_greedy(live["root"], None, 4)
    regexes = st.sampled_from([r".*", r"q_a_proj", r"([\w.]|[\w.])*Z", r"(a)\1", r"[", r"(?=x)", r"x{99999}",
                               r".*\.experts\..*", r"(a+)+$", ""]) | st.text(max_size=12)
    values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 40),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=10), regexes,
                       st.lists(regexes, max_size=4), st.dictionaries(regexes, st.integers(-5, 100_000), max_size=3))
    config_edits = st.dictionaries(st.sampled_from(
        ["r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "peft_type", "use_rslora",
         "lora_dropout", "bias", "fan_in_fan_out", "modules_to_save", "use_dora", "layers_to_transform",
         "base_model_name_or_path", "task_type", "init_lora_weights", "exclude_modules", "extra_junk"]),
        values, max_size=3)
    tensor_edit = st.sampled_from(["none", "drop", "add", "reshape", "int", "nan", "inf", "transpose", "empty"])
    count = [0]
    root = tmp_path_factory.mktemp("fuzz-adapters")

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(config_edits, tensor_edit, st.sampled_from(names), st.booleans())
    def run(edits, edit, target, broken_json):
        count[0] += 1
        path = root / f"a{count[0]}"
        shutil.copytree(src, path)
        cfg = {**base_cfg, **edits}
        (path / "adapter_config.json").write_text("{" + json.dumps(cfg)[1:30] if broken_json else json.dumps(cfg))
        tensors = dict(base_tensors)
        t = tensors[target]
        if edit == "drop":
            del tensors[target]
        elif edit == "add":
            tensors[target.replace("lora_A", "lora_C").replace("lora_B", "lora_C") + ".x"] = t.clone()
        elif edit == "reshape":
            tensors[target] = t.reshape(-1)[: max(1, t.numel() - 1)].clone()
        elif edit == "int":
            tensors[target] = t.to(torch.int32)
        elif edit in ("nan", "inf"):
            tensors[target] = t.clone().index_fill_(0, torch.tensor([0]), float(edit))
        elif edit == "transpose":
            tensors[target] = t.t().contiguous()
        elif edit == "empty":
            tensors[target] = t[:0].clone()
        save_file(tensors, path / "adapter_model.safetensors")
        t0 = time.monotonic()
        r = admin(live, "load_lora_adapter", {"lora_name": "fuzzed", "lora_path": str(path)})
        assert time.monotonic() - t0 < 10, (edits, edit)
        assert r.status_code in (200, 400), (edits, edit, r.text)
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], r.text
        else:
            out = httpx.post(live["url"] + "/v1/completions", json={**body, "model": "fuzzed"}, headers=headers,
                             timeout=60)
            assert out.status_code in (200, 500), out.text  # 500: its own logits not finite, alone
            assert admin(live, "unload_lora_adapter", {"lora_name": "fuzzed"}).status_code == 200
        r = httpx.post(live["url"] + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected

    run()
    assert httpx.get(live["url"] + "/health").status_code == 200
