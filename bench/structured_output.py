"""Structured-output benchmarks.

`engines`: xgrammar vs outlines-core on the bundled 8k byte-level BPE tokenizer, same run: time to
compile a JSON schema (and a regex) for the vocabulary, then the per-token cost of walking a valid
document token by token (compute the allowed-token mask, accept the token). This is what picked the
grammar engine (README's dependency section).

`serve`: tokens/s of 32 concurrent JSON-schema-constrained chat requests vs 32 unconstrained ones
through the real engine on a tiny random model, same run, same prompts; and the GLM tool parser's cost
per streamed token.

    flock /tmp/glm5-bench.lock python3 bench/structured_output.py engines
    flock /tmp/glm5-bench.lock python3 bench/structured_output.py serve
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]},
    "active": {"type": "boolean"}}, "required": ["name", "age", "email", "tags", "address", "active"]}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
       "address": {"city": "London", "zip": "W1"}, "active": True}


def _tokenizer():
    from glm5.infer.engine import BUNDLED_TOKENIZER
    from glm5.data.tokenizer import load_tokenizer
    return load_tokenizer(BUNDLED_TOKENIZER)


def bench_xgrammar(tok, schema_text: str, doc_ids: list[int]) -> dict:
    import torch
    import xgrammar as xgr
    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=tok.eos_token_ids)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(schema_text, any_whitespace=False)
    t2 = time.perf_counter()
    compiler.compile_regex(r"[a-z]+@[a-z]+\.(com|org)")
    t3 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    logits = torch.zeros(1, tok.vocab_size)
    steps = []
    for t in doc_ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        assert matcher.accept_token(t), "document rejected"
        steps.append(time.perf_counter() - s)
    return {"setup_s": t1 - t0, "compile_schema_s": t2 - t1, "compile_regex_s": t3 - t2,
            "per_token_us": 1e6 * statistics.median(steps)}


def bench_outlines(tok, schema_text: str, doc_ids: list[int]) -> dict:
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    eos = tok.eos_token_ids[0]
    vmap: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if i not in tok.eos_token_ids:
            vmap.setdefault(tok.token_bytes(i), []).append(i)
    vocab = Vocabulary(eos, vmap)
    t1 = time.perf_counter()
    index = Index(build_regex_from_schema(schema_text, r"[ ]?"), vocab)
    t2 = time.perf_counter()
    Index(r"[a-z]+@[a-z]+\.(com|org)", vocab)
    t3 = time.perf_counter()
    guide = Guide(index)
    mask = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)
    steps = []
    for t in doc_ids:
        s = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        guide.advance(t)
        steps.append(time.perf_counter() - s)
    return {"setup_s": t1 - t0, "compile_schema_s": t2 - t1, "compile_regex_s": t3 - t2,
            "per_token_us": 1e6 * statistics.median(steps)}


def engines() -> None:
    tok = _tokenizer()
    schema_text = json.dumps(SCHEMA)
    doc_ids = tok.encode(json.dumps(DOC))
    print(f"tokenizer: bundled byte-level BPE, vocab {tok.vocab_size}; document {len(doc_ids)} tokens")
    for name, fn in (("xgrammar", bench_xgrammar), ("outlines-core", bench_outlines)):
        r = fn(tok, schema_text, doc_ids)
        print(f"{name:14s} " + "  ".join(f"{k}={v:.4f}" if k.endswith("_s") else f"{k}={v:.1f}" for k, v in r.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["engines", "serve"])
    args = ap.parse_args()
    if args.what == "engines":
        engines()
    else:
        from bench_structured_serve import serve  # noqa: PLC0415 (added with the serve integration)
        serve()


if __name__ == "__main__":
    main()
