"""Tokenizer: round trips, special tokens, streaming detokenizer, training, GLM-format files."""

import json
from pathlib import Path

import pytest

from glm5.core.resources import bundled
from glm5.data.tokenizer import SPECIAL_TOKENS, GLMTokenizer, IncrementalDetokenizer, load_tokenizer
from glm5.data.tokenizer_cli import TokenizerTrainConfig, main as tokenizer_main, train_tokenizer

ASSET = bundled("tokenizer-8k")
CORPUS = bundled("corpus/train.jsonl.gz")

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "chinese": "深度学习模型需要大量的数据。你好，世界！GLM 是一个双语模型。",
    "code": "class A:\n    def f(self, x):\n        if x:\n            return {'a': [1, 2]}\n\t\treturn None\n",
    "emoji": "ok 😀👍🏽👨‍👩‍👧 ❤️ 🇨🇳 done",
    "special": "[gMASK]<sop><|user|>hi<|assistant|><think>hmm</think>yes<|endoftext|>",
    "whitespace": "  leading\n\n\n  trailing   \r\n\tx  ",
    "mixed": "Zeta函数ζ(s)=Σ n^-s ✓ naïve café — «quotes» 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
}


@pytest.fixture(scope="module")
def tok() -> GLMTokenizer:
    return load_tokenizer(ASSET)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip(tok, name):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_tokens_fit_the_model_vocab(tok):
    assert tok.vocab_size == 8192  # the tiny/small presets' vocab_size
    assert set(tok.special_tokens) == set(SPECIAL_TOKENS)
    assert sorted(tok.special_tokens.values()) == list(range(8192 - len(SPECIAL_TOKENS), 8192))
    for name, i in tok.special_tokens.items():
        assert tok.encode(name) == [i] and tok.decode([i]) == name
    assert tok.eos_token_ids == [tok.special_tokens[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    assert tok.pad_token_id == tok.special_tokens["<|endoftext|>"]
    ids = tok.encode(TEXTS["special"])
    assert tok.decode(ids, skip_special_tokens=True) == "hihmmyes"
    assert tok.encode("x", add_special_tokens=True)[:2] == [tok.special_tokens["[gMASK]"], tok.special_tokens["<sop>"]]


# GLM-5's released special tokens and their ids (zai-org GLM-4.7-Flash / GLM-5 tokenizer_config.json
# `added_tokens_decoder`, 154820..154855), written out here independently of glm5's SPECIAL_TOKENS.
GLM5_SPECIAL_IDS = {name: 154820 + k for k, name in enumerate((
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
    "<|end_of_video|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>",
    "<|end_of_transcription|>", "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "/nothink", "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>"))}


def test_bundled_vocabulary_has_glm5s_36_special_tokens_in_order(tok):
    """Every GLM-5 special token is there, at GLM-5's id shifted by one constant; GLM-4.5's ids agree too
    (llama.cpp / GLM-4.5 tokenizer: <|begin_of_image|> 151339, <|code_prefix|> 151347, <think> 151350)."""
    assert len(GLM5_SPECIAL_IDS) == 36
    shift = {name: GLM5_SPECIAL_IDS[name] - tok.token_to_id(name) for name in GLM5_SPECIAL_IDS}
    assert set(shift.values()) == {154820 - 8156}, shift
    for name, glm45 in (("<|begin_of_image|>", 151339), ("<|code_prefix|>", 151347), ("<think>", 151350)):
        assert tok.token_to_id(name) - tok.token_to_id("<|endoftext|>") == glm45 - 151329
    config = json.loads((ASSET / "tokenizer_config.json").read_text())
    assert config["additional_special_tokens"] == list(GLM5_SPECIAL_IDS)
    assert all(config["added_tokens_decoder"][str(tok.token_to_id(n))]["special"] for n in GLM5_SPECIAL_IDS)
    assert tok.encode("/nothink") == [tok.token_to_id("/nothink")]


def test_indentation_tokens(tok):
    """Seed D4: a newline plus 4/8/12/16 spaces (line-start indentation) is a single token."""
    for width in (4, 8, 12, 16):
        ids = tok.encode("x:\n" + " " * width + "return")
        assert tok.token_to_id("\n" + " " * width) in ids
    assert len(tok.encode("\n" + " " * 16)) == 1
    assert tok.token_to_id("\n" + " " * 4) not in tok.encode("a    b")  # mid-line spaces: plain BPE


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_never_splits_characters(tok, skip):
    text = TEXTS["emoji"] + TEXTS["chinese"] + TEXTS["special"] + TEXTS["mixed"]
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    chunks = [det.add(i) for i in ids]
    chunks.append(det.finish())
    assert "".join(chunks) == det.text == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in c for c in chunks)
    assert "" in chunks[:-1]  # some character really was split across tokens (byte tokens held back)


def test_incremental_detokenizer_flushes_a_dangling_byte(tok):
    lead = tok.token_to_id("ð")  # the byte-level token of 0xF0, the first byte of a 4-byte character
    assert tok.token_bytes(lead) == b"\xf0"
    det = IncrementalDetokenizer(tok)
    assert det.add(tok.encode("é")) == "é"
    assert det.add(lead) == ""
    assert det.finish() == "\ufffd"


def test_training_is_deterministic_and_keeps_specials_at_the_end(tmp_path):
    cfg = TokenizerTrainConfig(inputs=[str(CORPUS)], vocab_size=700, max_docs=400, output=str(tmp_path / "a"))
    a = train_tokenizer(cfg)
    b = train_tokenizer(cfg)
    assert a.tok.to_str() == b.tok.to_str()
    assert a.vocab_size == 700
    assert sorted(a.special_tokens.values()) == list(range(700 - len(SPECIAL_TOKENS), 700))
    for text in TEXTS.values():
        assert a.decode(a.encode(text)) == text
    a.save(tmp_path / "a")
    again = load_tokenizer(tmp_path / "a")
    assert again.encode(TEXTS["code"]) == a.encode(TEXTS["code"])
    assert load_tokenizer(tmp_path / "a" / "tokenizer.json").vocab_size == 700  # a bare file loads too


@pytest.mark.slow
def test_cli_reproduces_the_shipped_tokenizer(tmp_path):
    tokenizer_main(["--config", "configs/data/tokenizer.toml", f"--output={tmp_path / 'tok'}",
                    f"--inputs=[\"{CORPUS}\"]"])
    assert (tmp_path / "tok" / "tokenizer.json").read_text() == (ASSET / "tokenizer.json").read_text()


def test_missing_tokenizer_file_is_reported(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)


def test_code_and_fim_tokens(tmp_path):
    """D4 options: bracket/operator strings become single tokens; FIM sentinels sit just before GLM's
    special tokens, which keep the last ids; both survive save/load (what transformers reads too)."""
    texts = ["def f(a, b):\n    return a == b\n", "x = [] if y != {} else ()\n"] * 50
    cfg = TokenizerTrainConfig(vocab_size=400, code_tokens=["==", "()", "!="], fim_tokens=True)
    tok = train_tokenizer(cfg, texts=iter(texts))
    assert tok.vocab_size <= 400
    fim = [tok.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")]
    first_glm = tok.token_to_id(SPECIAL_TOKENS[0])
    assert fim == [first_glm - 3, first_glm - 2, first_glm - 1]
    assert tok.token_to_id(SPECIAL_TOKENS[-1]) == tok.vocab_size - 1
    for s in ("==", "()", "!="):
        assert len(tok.encode(s)) == 1
    text = "<|fim_suffix|>b\n<|fim_prefix|>def f():\n    a == ()<|fim_middle|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and fim[1] in ids
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.special_tokens["<|fim_middle|>"] == fim[2] and again.encode(text) == ids


class _CountingTokenizer:
    """Passes calls to a `tokenizers.Tokenizer`, counting the characters it was given to encode."""

    def __init__(self, inner):
        self.inner, self.chars = inner, 0

    def encode(self, text, **kw):
        self.chars += len(text)
        return self.inner.encode(text, **kw)

    def encode_batch(self, texts, **kw):
        self.chars += sum(map(len, texts))
        return self.inner.encode_batch(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_encode_with_a_limit_gives_the_same_ids_or_stops_early(tok):
    """`encode(text, limit=N)` (the server's context check): the plain ids when they fit, else TooManyTokens
    after tokenising about N tokens' worth of the text, not all of it (a 4 MB prompt costs what 8k tokens do)."""
    import random

    from glm5.data.tokenizer import COUNT_PIECE_CHARS, TooManyTokens

    rng = random.Random(0)
    pieces = [*TEXTS.values(), " ", "\n\n", "    ", "x" * 50]
    text = "".join(rng.choice(pieces) for _ in range(6000))  # several counting pieces, every kind of text
    assert len(text) > 3 * COUNT_PIECE_CHARS
    ids = tok.encode(text, add_special_tokens=True)
    assert tok.encode(text, add_special_tokens=True, limit=len(ids)) == ids
    with pytest.raises(TooManyTokens) as e:
        tok.encode(text, add_special_tokens=True, limit=len(ids) // 2)
    assert len(ids) // 2 < e.value.at_least <= len(ids)
    counting = GLMTokenizer(_CountingTokenizer(tok.tok), tok.chat_template)
    huge = "ab " * 1_300_000  # the probe's 3.9 MB prompt: 1.3 M tokens
    with pytest.raises(TooManyTokens, match="more than the limit of 8192"):
        counting.encode(huge, add_special_tokens=True, limit=8192)
    assert counting.tok.chars <= 2 * COUNT_PIECE_CHARS  # stopped after the first piece or two
    nospace = "é" * (3 * COUNT_PIECE_CHARS)  # no whitespace to cut at: cut mid-run, still bounded
    with pytest.raises(TooManyTokens):
        tok.encode(nospace, limit=1000)
