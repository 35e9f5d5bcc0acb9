"""Request validation below HTTP: token ids against the vocabulary (one shared check), sampling parameters
clamped to numerically safe ranges as vLLM documents (0 < temperature < 1e-2 runs at 1e-2), NaN/inf
rejected, lone surrogates rejected by the tokenizer, and tool schemas checked as JSON Schema."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm5.data.tokenizer import check_encodable, load_tokenizer
from glm5.infer.sampling import MIN_TEMPERATURE, Sampler, SamplingParams, SamplingRow, check_token_ids
from glm5.serve.validation import find_lone_surrogate, schema_error

TOK = load_tokenizer("glm5/data/assets/tokenizer-8k")


@pytest.mark.parametrize("ids,ok", [([0, 1, 511], True), ([512], False), ([-1], False), ([2**80], False),
                                    ([True], False), (["3"], False), ([1.0], False), ([], True)])
def test_check_token_ids(ids, ok):
    if ok:
        check_token_ids("stop_token_ids", ids, 512)
    else:
        with pytest.raises(ValueError, match=r"^stop_token_ids .*\[0, 512\)"):
            check_token_ids("stop_token_ids", ids, 512)


def test_sampling_params_check_vocab_names_the_field():
    SamplingParams(stop_token_ids=[5]).check_vocab(8)
    with pytest.raises(ValueError, match="^stop_token_ids"):
        SamplingParams(stop_token_ids=[5, 99999], min_tokens=1).check_vocab(8)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "min_p", "presence_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nan_and_inf_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="temperature_schedule"):
        SamplingParams(temperature_schedule=(1.0, value))


def test_tiny_temperature_runs_at_vllms_floor():
    # vLLM's SamplingParams raises 0 < temperature < 1e-2 to 1e-2 (_MAX_TEMP); 0 stays greedy
    assert SamplingParams(temperature=1e-38).temperature == MIN_TEMPERATURE == 1e-2
    assert SamplingParams(temperature=0).temperature == 0
    assert SamplingParams(temperature=0.5).temperature == 0.5
    sched = SamplingParams(temperature_schedule=(1.0, 1e-3), max_tokens=5)
    assert sched.temperature_at(4) == MIN_TEMPERATURE and sched.temperature_at(0) == 1.0
    assert SamplingParams(repetition_penalty=1e-300).repetition_penalty == 1e-2
    assert SamplingParams(repetition_penalty=1e300).repetition_penalty == 1e2


@settings(max_examples=40, deadline=None)
@given(temperature=st.one_of(st.just(0.0), st.floats(1e-300, 100.0)),
       rep=st.floats(1e-300, 1e300), top_p=st.floats(1e-300, 1.0, exclude_min=False),
       min_p=st.floats(0.0, 1.0), top_k=st.integers(-1, 40), pres=st.floats(-2, 2), freq=st.floats(-2, 2),
       min_tokens=st.integers(0, 3), scale=st.floats(1e-3, 1e4))
def test_sampler_never_sees_nan(temperature, rep, top_p, min_p, top_k, pres, freq, min_tokens, scale):
    """Any parameters the API accepts give a finite distribution over the vocabulary (the reported bug:
    temperature 1e-38 or repetition_penalty 1e-300 gave NaN and token 0 every step)."""
    params = SamplingParams(temperature=temperature, repetition_penalty=rep, top_p=max(top_p, 1e-300),
                            min_p=min_p, top_k=top_k, presence_penalty=pres, frequency_penalty=freq,
                            min_tokens=min_tokens, max_tokens=8)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 40, generator=g) * scale
    rows = [SamplingRow(params, [1, 2, 3], [3, 4], None, (0, 1)) for _ in range(2)]
    probs = Sampler(g).probs(logits, rows)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    if min_tokens > 2:
        assert (probs[:, :2] == 0).all()  # EOS/stop ids still masked
    sampled = Sampler(g)(logits, rows).token_ids
    assert ((sampled >= 0) & (sampled < 40)).all() and bool((probs.gather(1, sampled[:, None]) > 0).all())


def test_tokenizer_rejects_lone_surrogates_with_a_value_error():
    with pytest.raises(ValueError, match="U\\+D800 at character 2"):
        TOK.encode("ab\ud800")
    with pytest.raises(ValueError, match="prompt .*U\\+DC00"):
        check_encodable("\udc00", "prompt")
    assert TOK.decode(TOK.encode("pair 😀 ok")) == "pair 😀 ok"  # a valid surrogate pair is text


def test_find_lone_surrogate_paths():
    assert find_lone_surrogate({"messages": [{"content": "ok"}, {"content": [{"text": "a\ud800"}]}]}) == \
        ("messages[1].content[0].text", "a\ud800", 1)
    assert find_lone_surrogate({"a": {"\udfff": 1}})[0] == "a (a key)"
    assert find_lone_surrogate({"a": ["ok", 1, None, 2.5]}) is None
    deep: list = []
    for _ in range(100_000):  # iterative walk: no RecursionError
        deep = [deep]
    assert find_lone_surrogate(deep) is None


@pytest.mark.parametrize("schema,where", [
    ({"type": "object", "properties": "str"}, "at properties"),
    ({"type": "objec"}, "at type"),
    ({"type": "object", "properties": {"a": {"type": 5}}}, "at properties.a.type"),
    ({"type": "object", "required": "a"}, "at required"),
    ({"type": "array", "items": [{"minimum": "x"}]}, "at items"),
])
def test_invalid_tool_schemas_are_named_with_their_path(schema, where):
    assert where in schema_error(schema)


@pytest.mark.parametrize("schema", [{}, {"type": "object", "properties": {"a": True, "b": {"type": ["string", "null"]}}},
                                    {"type": "object", "properties": {"x": {"$ref": "#/$defs/x"}},
                                     "$defs": {"x": {"enum": [1, 2]}}}])
def test_valid_tool_schemas_pass(schema):
    assert schema_error(schema) is None
