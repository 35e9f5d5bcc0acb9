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
    steps = []
    for t in doc_ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
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


SERVE_SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 8, "maxItems": 8},
    "score": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["items", "score"],
    "additionalProperties": False}


def _engine_run(engine, n: int, max_tokens: int, spec) -> tuple[int, float]:
    from glm5.infer.sampling import SamplingParams
    for i in range(n):
        engine.add_request(f"r{i}", prompt=f"Record {i}:", params=SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=spec is None, structured_outputs=spec))
    tokens, t0 = {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] = len(o.outputs[0].token_ids)
    return sum(tokens.values()), time.perf_counter() - t0


def serve() -> None:
    """Engine throughput, 32 concurrent sampled requests on the tiny random model, constrained by a
    JSON schema vs free, alternating runs in the same process; then the tool parser per token."""
    from glm5.infer.config import EngineConfig
    from glm5.infer.engine import LLMEngine
    from glm5.infer.structured import StructuredOutputs
    engine = LLMEngine(EngineConfig(model="tiny", max_model_len=512, num_blocks=1024, max_num_seqs=32))
    spec = StructuredOutputs(json=json.dumps(SERVE_SCHEMA))
    engine.grammars.compile(spec)
    _engine_run(engine, 4, 8, None)  # warm-up
    rates = {"free": [], "json_schema": []}
    for _ in range(2):
        for name, s in (("free", None), ("json_schema", spec)):
            toks, secs = _engine_run(engine, 32, 64, s)
            rates[name].append(toks / secs)
    free, cons = statistics.mean(rates["free"]), statistics.mean(rates["json_schema"])
    print(f"engine, 32 concurrent, tiny random model: free {free:.1f} tok/s, json_schema {cons:.1f} tok/s, "
          f"ratio {cons / free:.2f}x (mean of 2 alternating runs)")
    tool_parser_cost()


def tool_parser_cost() -> None:
    from glm5.serve.parsers import GLMReasoningParser, GLMToolParser
    tok = _tokenizer()
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"}}}}}]
    body = "\n".join(f"    value_{i} = compute({i}, 'x') * 2  # step {i}" for i in range(200))
    text = ("Let me write it.</think>Writing the file.<tool_call>write_file<arg_key>path</arg_key><arg_value>/tmp/a.py"
            f"</arg_value><arg_key>content</arg_key><arg_value>{body}</arg_value><arg_key>mode</arg_key>"
            "<arg_value>420</arg_value></tool_call>")
    pieces = [tok.decode([t]) for t in tok.encode(text)]
    best = float("inf")
    for _ in range(5):
        rp, tp = GLMReasoningParser(True), GLMToolParser(tools)
        t0 = time.perf_counter()
        for p in pieces:
            _, content = rp.feed(p)
            tp.feed(content)
        tp.finish()
        best = min(best, time.perf_counter() - t0)
    assert len(tp.tool_calls) == 1
    print(f"reasoning + tool parser: {1e6 * best / len(pieces):.1f} us per streamed token "
          f"({len(pieces)} tokens, one 200-line string argument, best of 5)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["engines", "serve"])
    args = ap.parse_args()
    if args.what == "engines":
        engines()
    else:
        serve()


if __name__ == "__main__":
    main()
