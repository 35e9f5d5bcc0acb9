"""Structured output (xgrammar bitmask in the sampler) and the OpenAI parameters logit_bias, best_of,
n with streaming and stop lists: unit checks on the sampler and vocabularies, the engine batching
constrained with free requests, and the official `openai` client against a live server on a tiny
random checkpoint. Every constrained output is checked with `jsonschema` / `re.fullmatch`; a random
model is the hardest client for a grammar (it never writes valid JSON on its own).
"""

import json
import re

import jsonschema
import openai
import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from glm5.data.tokenizer import GLMTokenizer
from glm5.infer.config import EngineConfig
from glm5.infer.sampling import Sampler, SamplingParams, SamplingRow
from glm5.infer.structured import StructuredOutputs, apply_token_bitmask, vocab_bytes
from glm5.model.config import ModelConfig
from glm5.model.hf_adapter import save_pretrained
from glm5.model.model import GLM5ForCausalLM
from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.testing import serve_in_thread
from tests.test_serve_e2e import KEY, TOK, greedy_reference, oai

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["red", "green", "blue"]}, "name": {"type": "string", "maxLength": 6}},
    "required": ["ok", "n", "tag", "name"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A live server on a tiny random checkpoint (room for prompts that carry tool schemas)."""
    from glm5.infer.engine import LLMEngine  # noqa: PLC0415
    path = tmp_path_factory.mktemp("tiny-ckpt")
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).init_weights(0).eval()
    save_pretrained(model, path)
    TOK.save(path)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=1024,
                                    num_blocks=512, block_size=16, max_num_seqs=32, max_batch_size=32,
                                    preferred_batch_size=1, batch_timeout_ms=0))
    app = create_app(engine, config=ServerConfig(api_key=KEY), model_name="tiny")
    with serve_in_thread(app) as url:
        yield {"url": url, "engine": engine, "model": model, "path": path}


@pytest.fixture(scope="module")
def engine(live):
    """An engine of its own on the same checkpoint (the server's engine belongs to its thread)."""
    from glm5.infer.engine import LLMEngine  # noqa: PLC0415
    return LLMEngine(EngineConfig(model=str(live["path"]), device="cpu", dtype="float32", max_model_len=512,
                                  num_blocks=256, block_size=16, max_num_seqs=32))


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [V] -> int32 [ceil(V/32)] bitmask (bit t % 32 of word t // 32)."""
    v = allowed.shape[0]
    bits = torch.zeros((v + 31) // 32 * 32, dtype=torch.int64)
    bits[:v] = allowed.long()
    words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_sampler_applies_bitmask_and_bias_per_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    allowed = torch.zeros(70, dtype=torch.bool)
    allowed[[3, 40, 69]] = True
    rows = [SamplingRow(SamplingParams(temperature=0), [1], [], token_bitmask=pack(allowed)),
            SamplingRow(SamplingParams(temperature=0, logit_bias={7: 100.0}), [1], []),
            SamplingRow(SamplingParams(temperature=0), [1], [])]
    out = Sampler()(logits, rows).token_ids.tolist()
    assert out == [int(torch.where(allowed, logits[0], -torch.inf).argmax()), 7, int(logits[2].argmax())]
    masked = apply_token_bitmask(logits, [pack(allowed), None, None])
    assert torch.isinf(masked[0][~allowed]).all() and torch.equal(masked[1:], logits[1:])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})


def test_vocab_bytes_byte_level_and_sentencepiece():
    got = vocab_bytes(TOK, TOK.vocab_size + 3)
    assert got[:TOK.vocab_size] == [TOK.token_bytes(i) for i in range(TOK.vocab_size)] and got[-1] == b""
    vocab = {"<unk>": 0, "<0x0A>": 1, "\u2581a": 2, "b": 3}
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = GLMTokenizer.__new__(GLMTokenizer)
    tok.tok = sp
    assert vocab_bytes(tok, 4)[1:] == [b"\n", b" a", b"b"]


def run_engine(engine, reqs):
    outs = {}
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt=prompt, params=params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    return {k: v.outputs[0] for k, v in outs.items()}


def test_engine_batches_constrained_with_free_requests(live, engine):
    """8 requests in one batch, half JSON-schema constrained (sampled), half free (greedy): every
    constrained output parses and validates; every free output equals the model's own greedy decode."""
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    reqs = []
    for i in range(4):
        reqs.append((f"c{i}", f"Item {i}:", SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                                                          structured_outputs=spec)))
        reqs.append((f"f{i}", f"Item {i}:", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    outs = run_engine(engine, reqs)
    for i in range(4):
        c = outs[f"c{i}"]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text.replace("<|endoftext|>", "")), SCHEMA)
        ids = TOK.encode(f"Item {i}:")
        assert outs[f"f{i}"].text == greedy_reference(live["model"], ids, 8)


@pytest.mark.parametrize("spec,check", [
    (StructuredOutputs(regex=r"(yes|no)-[0-9]{3}"), lambda t: re.fullmatch(r"(yes|no)-[0-9]{3}", t)),
    (StructuredOutputs(choice=("alpha", "beta", "gamma")), lambda t: t in ("alpha", "beta", "gamma")),
    (StructuredOutputs(grammar='root ::= "(" [a-c]{1,3} ")"'), lambda t: re.fullmatch(r"\([a-c]{1,3}\)", t)),
    (StructuredOutputs(grammar="start: \"<\" NUM \">\"\nNUM: /[0-9]{2}/"), lambda t: re.fullmatch(r"<[0-9]{2}>", t)),
    # a random model never closes a free-form object by itself: a +100 bias on "}" does, and the
    # grammar still makes "{" come first
    (StructuredOutputs(json_object=True), lambda t: t == "{}"),
])
def test_engine_regex_choice_grammar(engine, spec, check):
    bias = {TOK.encode("}")[0]: 100.0} if spec.json_object else None
    outs = run_engine(engine, [(f"s{i}", "Answer:", SamplingParams(
        temperature=1.0, seed=i, max_tokens=40, structured_outputs=spec, logit_bias=bias)) for i in range(4)])
    for o in outs.values():
        text = o.text.replace("<|endoftext|>", "")
        assert o.finish_reason == "stop" and check(text), text


def chat_text(c, stream, **req):
    if not stream:
        return c.chat.completions.create(**req).choices[0].message.content
    return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**req, stream=True)
                   if ch.choices)


def test_response_format_json_schema_stream_equals_nonstream(live):
    c = oai(live)
    req = dict(model="tiny", messages=[{"role": "user", "content": "Describe a colour."}], max_tokens=80,
               temperature=0.8, seed=3, response_format={"type": "json_schema", "json_schema": {
                   "name": "colour", "schema": SCHEMA, "strict": True}})
    full = chat_text(c, False, **req)
    jsonschema.validate(json.loads(full), SCHEMA)
    assert chat_text(c, True, **req) == full  # thinking on: the block was closed, the JSON is content
    obj = chat_text(c, False, **{**req, "response_format": {"type": "json_object"},
                                 "logit_bias": {str(TOK.encode("}")[0]): 100}})
    assert json.loads(obj) == {}
    choice = c.chat.completions.create(**{**req, "response_format": None},
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_follows_schema(live, tool_choice):
    """tool_choice required / named is a grammar over GLM's XML call format: the random model's call
    closes, parses, names an offered tool and validates against its schema, streamed == non-streamed."""
    c = oai(live)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "user", "content": "And Rome?"}]
    req = dict(model="tiny", messages=history, tools=WEATHER, max_tokens=200, temperature=0.7, seed=1,
               tool_choice=tool_choice, parallel_tool_calls=False,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    full = c.chat.completions.create(**req).choices[0]
    assert full.finish_reason == "tool_calls" and len(full.message.tool_calls) == 1
    call = full.message.tool_calls[0].function
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    if isinstance(tool_choice, dict):
        assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    streamed = {"name": "", "args": ""}
    for chunk in c.chat.completions.create(**req, stream=True):
        for t in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed["name"] += t.function.name or ""
            streamed["args"] += t.function.arguments or ""
    assert (streamed["name"], streamed["args"]) == (call.name, call.arguments)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "regex"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "choice"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}}, "grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "exactly one"),
    ({"extra_body": {"structured_outputs": {"regex": "a"}}, "response_format": {"type": "json_object"}}, "either"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"logit_bias": {"abc": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
]


@pytest.mark.parametrize("extra,needle", BAD)
def test_bad_structured_requests_are_400(live, extra, needle):
    with pytest.raises(openai.BadRequestError) as e:
        oai(live).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          **extra)
    assert needle in e.value.body["message"], e.value.body


def test_logit_bias_best_of_n_stream_and_stops(live):
    c = oai(live)
    target = TOK.encode("ab")[0]
    r = c.completions.create(model="tiny", prompt="x", max_tokens=5, temperature=0, logit_bias={str(target): 100},
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == TOK.decode([target] * 5)
    # best_of: the most likely of the same 4 seeded samples that n=4 returns
    four = c.completions.create(model="tiny", prompt="Once", max_tokens=6, temperature=1.0, seed=11, n=4,
                                logprobs=0)
    scores = [sum(ch.logprobs.token_logprobs) for ch in four.choices]
    best = c.completions.create(model="tiny", prompt="Once", max_tokens=6, temperature=1.0, seed=11, best_of=4)
    assert [ch.text for ch in best.choices] == [four.choices[scores.index(max(scores))].text]
    assert best.usage.completion_tokens == four.usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", max_tokens=2, n=3, best_of=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", max_tokens=2, best_of=2, stream=True)
    # n with streaming equals n without, choice by choice
    req = dict(model="tiny", prompt="The", max_tokens=6, temperature=1.0, seed=5, n=3)
    texts = {ch.index: ch.text for ch in c.completions.create(**req).choices}
    streamed: dict[int, str] = {}
    for chunk in c.completions.create(**req, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == texts and len(texts) == 3
    # any number of stop strings (vLLM has no cap); a stop string still stops
    greedy = c.completions.create(model="tiny", prompt="The", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    many = c.completions.create(model="tiny", prompt="The", max_tokens=8, temperature=0,
                                stop=[f"zz{i}" for i in range(40)] + [greedy[3:6]], extra_body={"ignore_eos": True})
    assert many.choices[0].finish_reason == "stop" and many.choices[0].text == greedy[:greedy.index(greedy[3:6])]


def _chat_call(live, tool_choice) -> list[tuple[str, dict]]:
    """The greedy forced call of the chat route (thinking off): (name, arguments) per call."""
    r = oai(live).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=WEATHER, max_tokens=200,
        temperature=0, tool_choice=tool_choice, parallel_tool_calls=False,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert r.finish_reason == "tool_calls"
    return [(t.function.name, json.loads(t.function.arguments)) for t in r.message.tool_calls]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_messages_tool_choice_is_the_chat_grammar(live, choice):
    """Anthropic's tool_choice any / tool runs the chat route's required / named grammar: greedy, the
    same call, a schema-valid `input`, stop_reason tool_use."""
    import anthropic  # noqa: PLC0415
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in WEATHER]
    c = anthropic.Anthropic(base_url=live["url"], api_key=KEY, max_retries=0)
    m = c.messages.create(model="tiny", max_tokens=200, messages=[{"role": "user", "content": "Weather in Rome?"}],
                          tools=tools, tool_choice={**choice, "disable_parallel_tool_use": True},
                          extra_body={"temperature": 0})
    chat_choice = "required" if choice["type"] == "any" else {"type": "function", "function": {"name": "get_weather"}}
    uses = [(b.name, b.input) for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses == _chat_call(live, chat_choice)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    jsonschema.validate(uses[0][1], schemas[uses[0][0]])
    if choice["type"] == "tool":
        assert uses[0][0] == "get_weather"


def test_responses_tool_choice_required_is_the_chat_grammar(live):
    tools = [{"type": "function", **t["function"]} for t in WEATHER]
    r = oai(live).responses.create(model="tiny", input="Weather in Rome?", tools=tools, tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=200, temperature=0,
                                   reasoning={"effort": "none"})
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls == _chat_call(live, "required")


def test_compile_cost_of_tool_schemas_is_bounded_before_compiling():
    """A tool call's constraint (a structural tag holding every tool's schema) has the limits of a JSON
    schema: 512 properties per object, 4096 in all (issue 30)."""
    from glm5.infer.structured import MAX_OBJECT_PROPERTIES, check_spec_cost

    def tag(*widths):
        schemas = [{"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}} for n in widths]
        return StructuredOutputs(structural_tag=json.dumps({"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
                {"begin": f"<tool_call>f{k}", "content": {"type": "json_schema", "json_schema": s}, "end": "</tool_call>"}
                for k, s in enumerate(schemas)]}}))

    check_spec_cost(tag(MAX_OBJECT_PROPERTIES, 10))
    with pytest.raises(ValueError, match="600 properties is over the limit of 512"):
        check_spec_cost(tag(600))
    with pytest.raises(ValueError, match="4,096 properties in all"):
        check_spec_cost(tag(*[500] * 9))
