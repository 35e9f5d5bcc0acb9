"""GLM's code-completion prompt (CodeGeeX4's layout) as the default infill of a GLM vocabulary: the prompt
equals CodeGeeX4's documented layout written out by hand, GLM's <|code_*|> tokens are the first-choice FIM
sentinels (as llama.cpp looks them up), `/infill` and `LLM.infill` build it, truncation drops whole
references, and the `fim` training objective lays its samples out the same way."""

import re

import httpx
import numpy as np
import pytest
import torch

from glm5.data.loader import DataLoaderConfig, PackedLoader
from glm5.data.shards import ShardWriter
from glm5.data.tokenizer import load_tokenizer
from glm5.data.tokenizer_cli import TokenizerTrainConfig, train_tokenizer
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.infill import InfillError, build_infill, choose_format, fim_tokens
from glm5.infer.llm import LLM
from glm5.infer.sampling import SamplingParams
from glm5.model.config import ModelConfig
from glm5.model.model import GLM5ForCausalLM
from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.testing import serve_in_thread

TOK = load_tokenizer("bundled:tokenizer-8k")
MAX_LEN = 256
PREFIX = "from typing import List\n\n\ndef parse(s: str) -> List[int]:\n    "
SUFFIX = "\n    return depth\n"
QUICK = "def quick_sort(arr):\n    return arr\n"


def codegeex(prefix, suffix, path, language, mode, references=()):
    """CodeGeeX4 guides/Infilling_guideline.md, "Cross File Infilling" format, written out by hand."""
    refs = "".join("###REFERENCE:\n###PATH:" + p + "\n" + code + "\n" for p, code in references)
    return ("<|user|>\n" + refs + "###PATH:" + path + "\n###LANGUAGE:" + language + "\n###MODE:" + mode + "\n"
            + "<|code_suffix|>" + suffix + "<|code_prefix|>" + prefix + "<|code_middle|><|assistant|>\n")


def reference_ids(*args, **kw):
    return TOK.encode(codegeex(*args, **kw), add_special_tokens=True)  # GLM's [gMASK]<sop> prefix


def test_prompt_is_codegeex4s_documented_layout():
    ip = build_infill(TOK, "codegeex", PREFIX, SUFFIX, room=MAX_LEN, path="src.py", mode="BLOCK")
    assert ip.token_ids == reference_ids(PREFIX, SUFFIX, "src.py", "Python", "BLOCK")
    assert ip.format == "codegeex" and ip.layout is None and not ip.is_truncated
    # cross-file references from input_extra; a language given; the LINE mode
    ip = build_infill(TOK, "codegeex", PREFIX, SUFFIX, room=MAX_LEN, extra=[("./sort/quick_sort.py", QUICK)],
                      path="src.py", language="Python", mode="LINE")
    assert ip.token_ids == reference_ids(PREFIX, SUFFIX, "src.py", "Python", "LINE",
                                         references=[("./sort/quick_sort.py", QUICK)])
    # no path, unknown language: empty after the colon (the guide's "no language" case); no suffix
    ip = build_infill(TOK, "codegeex", PREFIX, "", room=MAX_LEN)
    assert ip.token_ids == reference_ids(PREFIX, "", "", "", "BLOCK")
    assert TOK.decode(ip.token_ids).startswith("[gMASK]<sop><|user|>\n###PATH:\n###LANGUAGE:\n###MODE:BLOCK\n")


def test_mode_defaults_to_line_inside_a_line():
    mid_line = build_infill(TOK, "codegeex", "x = foo(", ", 2)\ny = 3\n", room=MAX_LEN, path="a.rs")
    assert mid_line.token_ids == reference_ids("x = foo(", ", 2)\ny = 3\n", "a.rs", "Rust", "LINE")
    at_line_end = build_infill(TOK, "codegeex", "x = 1\n", "   \ny = 3\n", room=MAX_LEN, path="a.go")
    assert at_line_end.token_ids == reference_ids("x = 1\n", "   \ny = 3\n", "a.go", "Go", "BLOCK")
    with pytest.raises(InfillError, match="LINE or BLOCK") as e:
        build_infill(TOK, "codegeex", "a", "b", room=MAX_LEN, mode="WORD")
    assert e.value.param == "mode"


def test_glm_code_tokens_are_the_first_choice_fim_tokens():
    """llama.cpp's FIM lookup knows <|code_prefix|>/<|code_suffix|>/<|code_middle|> as GLM-4.5's; ours
    prefer them, and fall back to <|fim_*|> in a vocabulary without them."""
    code = tuple(TOK.token_to_id(t) for t in ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"))
    assert fim_tokens(TOK) == code
    spm = build_infill(TOK, "spm", "a", "b", room=64)
    assert spm.token_ids == [code[1], *TOK.encode("b"), code[0], *TOK.encode("a"), code[2]]

    class FimOnly:  # a Qwen-coder-style vocabulary: <|fim_*|> and no GLM tokens
        ids = {"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3}

        def token_to_id(self, t):
            return self.ids.get(t)

        def encode(self, text, add_special_tokens=False):
            return [100 + ord(c) for c in text]

    assert fim_tokens(FimOnly()) == (1, 2, 3)
    assert choose_format(FimOnly(), has_block_positions=False) == "spm"
    with pytest.raises(InfillError, match="codegeex.*<\\|code_prefix\\|>"):
        choose_format(FimOnly(), has_block_positions=False, requested="codegeex")
    FimOnly.ids = {}
    with pytest.raises(InfillError, match="<\\|code_prefix\\|>.*<\\|fim_prefix\\|>"):
        choose_format(FimOnly(), has_block_positions=False)


def test_auto_format_per_model():
    assert choose_format(TOK, has_block_positions=False) == "codegeex"  # a GLM vocabulary, causal model
    assert choose_format(TOK, has_block_positions=True) == "glm"  # a model built for blank infilling
    # the code recipe's tokenizer (fim_tokens = true) on a model with both objectives: its FIM layout
    code_tok = train_tokenizer(TokenizerTrainConfig(vocab_size=400, fim_tokens=True),
                               texts=iter(["def f(a):\n    return a\n"] * 40))
    assert choose_format(code_tok, has_block_positions=True) == "codegeex"


def test_truncation_drops_whole_references_first():
    refs = [(f"r{k}.py", f"def f{k}():\n    return {k}\n" * 6) for k in range(4)]
    full = build_infill(TOK, "codegeex", PREFIX, SUFFIX, room=10_000, extra=refs, path="src.py")
    room = len(full.token_ids) - 20  # about one reference too many
    ip = build_infill(TOK, "codegeex", PREFIX, SUFFIX, room=room, extra=refs, path="src.py")
    assert len(ip.token_ids) <= room and ip.truncated["prefix"] == ip.truncated["suffix"] == 0
    assert ip.token_ids == reference_ids(PREFIX, SUFFIX, "src.py", "Python", "BLOCK", references=refs[1:])
    assert ip.truncated["extra"] == len(full.token_ids) - len(ip.token_ids)
    tiny = build_infill(TOK, "codegeex", PREFIX * 20, SUFFIX * 20, room=120, extra=refs, path="src.py")
    assert len(tiny.token_ids) <= 120 and tiny.truncated["prefix"] > 0 and tiny.truncated["suffix"] > 0
    assert tiny.truncated["extra"] > 0 and "###REFERENCE:" not in TOK.decode(tiny.token_ids)
    with pytest.raises(InfillError, match="only"):
        build_infill(TOK, "codegeex", PREFIX * 20, "", room=120, truncate=False)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    return GLM5ForCausalLM(cfg).init_weights(0).eval()


def test_infill_route_and_llm_build_the_glm_prompt(model):
    llm = LLM("tiny", model_obj=model, tokenizer=TOK, device="cpu", max_model_len=MAX_LEN)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.infill(PREFIX, SUFFIX, params, extra=[("q.py", QUICK)], path="src.py", mode="BLOCK")
    want = reference_ids(PREFIX, SUFFIX, "src.py", "Python", "BLOCK", references=[("q.py", QUICK)])
    assert out.prompt_token_ids == want
    greedy = llm.generate([want], params)[0].outputs[0].token_ids
    assert list(out.outputs[0].token_ids) == list(greedy)
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_LEN, num_blocks=64,
                                    block_size=16, batch_timeout_ms=0), model=model, tokenizer=TOK)
    with serve_in_thread(create_app(engine, config=ServerConfig(), model_name="tiny")) as url:
        body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"filename": "q.py", "text": QUICK}],
                "path": "src.py", "mode": "BLOCK", "n_predict": 5, "temperature": 0, "ignore_eos": True,
                "return_tokens": True}
        js = httpx.post(url + "/infill", json=body, timeout=60).json()
        assert js["infill_format"] == "codegeex" and js["tokens"] == list(greedy)
        assert js["prompt"] == TOK.decode(want)
        bad = httpx.post(url + "/infill", json={**body, "mode": "WORD"}, timeout=60)
        assert bad.status_code == 400 and "mode" in bad.text


def test_fim_objective_lays_samples_out_as_infill_prompts(tmp_path):
    """Each "fim" piece is a prompt `build_infill` would make (no path/language/references) + the middle
    + <|endoftext|>; prefix + middle + suffix is a contiguous run of one document; LINE iff no newline."""
    texts = [f"def f{k}(x):\n    y = x + {k}\n    return y * y\n\nprint(f{k}({k}))\n" * 3 for k in range(30)]
    docs = [np.asarray(TOK.encode(t), dtype=np.int64) for t in texts]
    meta = {"special_tokens": TOK.special_tokens, "pad_token_id": TOK.pad_token_id,
            "eos_token_id": TOK.eos_token_id, "sentence_end_ids": []}
    w = ShardWriter(tmp_path / "train", TOK.vocab_size, meta, max_tokens_per_part=4000)
    for ids in docs:
        w.add(ids, source="s", lang="en", domain="code")
    w.close()
    TOK.save(tmp_path / "train" / "tokenizer")
    loader = PackedLoader(DataLoaderConfig(train_path=str(tmp_path / "train"), batch_size=4, seq_len=160, seed=1),
                          rank=0, world_size=1)
    batch = loader.next_batch("fim")
    pattern = re.compile(r"\[gMASK\]<sop><\|user\|>\n###PATH:\n###LANGUAGE:\n###MODE:(LINE|BLOCK)\n"
                         r"<\|code_suffix\|>(.*)<\|code_prefix\|>(.*)<\|code_middle\|><\|assistant\|>\n(.*)<\|endoftext\|>",
                         re.S)
    seen, whole_text = set(), "".join(texts)
    end, special_ids = TOK.token_to_id("<|endoftext|>"), set(TOK.special_tokens.values())
    for r in range(4):
        ids, seg, lab = batch["input_ids"][r], batch["segment_ids"][r], batch["labels"][r]
        for s in seg.unique().tolist():
            piece = ids[seg == s].tolist()
            if s == 0 or TOK.token_to_id("<|code_middle|>") not in piece:
                continue
            assert torch.equal(lab[seg == s][:-1], ids[seg == s][1:])  # causal, aligned
            m = pattern.fullmatch(TOK.decode(piece))
            assert m, TOK.decode(piece)
            mode, suffix, prefix, middle = m.groups()
            assert mode == ("BLOCK" if "\n" in middle else "LINE")
            assert prefix + middle + suffix in whole_text
            specials = [t for t in piece if t in special_ids]
            assert specials == [TOK.token_to_id(t) for t in ("[gMASK]", "<sop>", "<|user|>", "<|code_suffix|>",
                                                             "<|code_prefix|>", "<|code_middle|>", "<|assistant|>")] + [end]
            seen.add(mode)
    assert seen, "no fim piece in the batch"
