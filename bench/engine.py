"""Inference-engine benchmark on the `small` preset (random weights; both peers load the same checkpoint).

    python bench/engine.py                 # everything, numbers as JSON lines + a markdown summary
    python bench/engine.py --quick         # smaller workload (smoke run)
    python bench/engine.py --arch glm4_moe --only offline single   # the same sizes as GLM-4.5-style GQA
    python bench/engine.py --compile --quick   # compiled (torch.compile) vs eager decode, batch 1 and 8
    python bench/engine.py --only kernels      # torch vs per-function native kernels vs + whole-layer kernel

Measures, in one run: offline throughput for N prompts of mixed lengths (glm5 LLMEngine vs transformers
`generate` batched with left padding), single-stream decode tokens/s (glm5 vs transformers; also past
`index_topk` with a 1,024-token prompt, where both run DSA sparse attention at every step), KV bytes
per token (latent vs expanded per-head K/V), INT8 vs fp32 decode speed and weight memory, INT8 logit
error and perplexity change on the validation split, and batch-1 decode as a fraction of the
memory-bandwidth bound (active weight bytes per token / measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from glm5.infer import quant  # noqa: E402
from glm5.infer.config import EngineConfig  # noqa: E402
from glm5.infer.engine import LLMEngine, load_tokenizer_for  # noqa: E402
from glm5.model.kv_cache import bytes_per_token, expanded_bytes_per_token  # noqa: E402
from glm5.infer.sampling import SamplingParams  # noqa: E402
from glm5.model.config import ModelConfig  # noqa: E402
from glm5.model.hf_adapter import save_pretrained  # noqa: E402
from glm5.model.model import GLM5ForCausalLM  # noqa: E402

RESULTS: dict = {}


def record(name: str, **values) -> None:
    RESULTS[name] = values
    print(json.dumps({"bench": name, **values}), flush=True)


# `--arch`: the `small` preset's sizes in each architecture of the family (GLM-4.5-style GQA: 6 query heads,
# 2 key/value heads of 64, half rotated, QK-norm, q/k/v bias; GLM-4.7-Flash-style: small's MLA, no indexer)
ARCHS = {"glm_moe_dsa": {}, "glm4_moe_lite": {"model_type": "glm4_moe_lite"},
         "glm4_moe": {"model_type": "glm4_moe", "num_key_value_heads": 2, "head_dim": 64, "use_qk_norm": True,
                      "attention_bias": True,
                      "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}}}


def build(ckpt: str, arch: str = "glm_moe_dsa") -> GLM5ForCausalLM:
    d = ModelConfig.from_preset("small").to_dict()
    if arch != "glm_moe_dsa":
        for key in [k for k in d if k.startswith("index") or k == "layer_types"]:
            del d[key]
    cfg = ModelConfig.from_dict({**d, **ARCHS[arch]})
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).init_weights(0).eval()
    save_pretrained(model, ckpt)
    return model


def workload(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, 8000, (L,), generator=g).tolist() for L in lens]


def engine_for(model, **kw) -> LLMEngine:
    """An engine on a copy of `model` (an engine swaps its kernels' modules into the model it is given)."""
    opts = dict(device="cpu", max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=2048, block_size=16)
    return LLMEngine(EngineConfig(**{**opts, **kw}), model=copy.deepcopy(model))


def run_engine(engine: LLMEngine, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{t}", prompt_token_ids=p, params=params)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    elapsed = time.perf_counter() - t
    return elapsed, [done[f"b{i}-{t}"] for i in range(len(prompts))]


def hf_model(ckpt: str, dtype: torch.dtype = torch.float32, device: str = "cpu", attn: str = "eager"):
    """transformers' model of the checkpoint (bench/gpu_check.py asks for bf16 + sdpa on CUDA)."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation=attn,
                                                             dtype=dtype).to(device).eval()


@torch.inference_mode()
def run_hf(hf, prompts, max_tokens: int, batch: int) -> tuple[float, list[list[int]]]:
    outs = []
    t = time.perf_counter()
    for b0 in range(0, len(prompts), batch):
        chunk = prompts[b0:b0 + batch]
        L = max(map(len, chunk))
        ids = torch.zeros(len(chunk), L, dtype=torch.long)
        mask = torch.zeros(len(chunk), L, dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding
            ids[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p), 1
        out = hf.generate(ids.to(hf.device), attention_mask=mask.to(hf.device), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        outs += out[:, L:].tolist()
    return time.perf_counter() - t, outs


def bench_offline(model, hf, args) -> None:
    prompts = workload(args.num_prompts, args.min_len, args.max_len)
    engine = engine_for(model)
    run_engine(engine, prompts[:2], 2)  # warm-up
    t_ours, ours = run_engine(engine_for(model), prompts, args.max_tokens)
    t_hf, ref = run_hf(hf, prompts, args.max_tokens, args.hf_batch)
    gen = len(prompts) * args.max_tokens
    same = sum(a == b for a, b in zip(ours, ref))
    record("offline_throughput", num_prompts=len(prompts), prompt_lens=[args.min_len, args.max_len],
           max_tokens=args.max_tokens, glm5_tok_s=gen / t_ours, hf_tok_s=gen / t_hf, ratio=t_hf / t_ours,
           hf_batch=args.hf_batch, identical_outputs=f"{same}/{len(prompts)}")


def timed(fn, *a) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of fn(*a): with 1 thread on a shared machine, CPU time is the
    time actually computed, wall time also counts waiting for a core."""
    w, c = time.perf_counter(), time.process_time()
    fn(*a)
    return time.perf_counter() - w, time.process_time() - c


def stamp() -> tuple[float, float]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # CUDA runs (bench/gpu_check.py): work done
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()


def rate(n: int, t0, t1) -> tuple[float, float]:
    """n tokens between two stamps -> (tokens per wall second, tokens per CPU second)."""
    return n / (t1[0] - t0[0]), n / (t1[1] - t0[1])


def engine_decode_tok_s(model, prompt, n: int, **kw) -> tuple[float, float]:
    """n decode steps timed from the first generated token (the prefill step excluded)."""
    engine = engine_for(model, **kw)
    engine.add_request("d", prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=n + 1,
                                                                           ignore_eos=True))
    engine.step()  # prefill + first token
    t0 = stamp()
    while engine.has_unfinished_requests():
        engine.step()
    return rate(n, t0, stamp())


@torch.inference_mode()
def hf_decode_tok_s(hf, prompt, n: int) -> tuple[float, float]:
    """The same for transformers `generate`: a stopping criterion stamps every step."""
    import transformers

    class Stamps(transformers.StoppingCriteria):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores, **kw):
            self.t.append(stamp())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    st = Stamps()
    hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=n + 1, min_new_tokens=n + 1,
                do_sample=False, pad_token_id=0, eos_token_id=None,
                stopping_criteria=transformers.StoppingCriteriaList([st]))
    return rate(n, st.t[0], st.t[-1])


def alternate(fns: dict, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Run the measurements in turn, `rounds` times: the shared machine's load changes by the minute, so
    a ratio is only meaningful between measurements taken next to each other (report per-round ratios)."""
    out = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            out[k].append(fn())
    return out


def ratio_stats(a: list, b: list, i: int) -> dict:
    """Median and range of the per-round ratios a/b of component i (0 wall, 1 CPU)."""
    r = sorted(x[i] / y[i] for x, y in zip(a, b))
    return {"median": r[len(r) // 2], "min": r[0], "max": r[-1]}


def median(xs: list, i: int) -> float:
    v = sorted(x[i] for x in xs)
    return v[len(v) // 2]


def bench_single_stream(model, hf, args) -> None:
    prompt = workload(1, 64, 64, seed=1)[0]
    res = alternate({"glm5": lambda: engine_decode_tok_s(model, prompt, args.decode_tokens),
                     "hf": lambda: hf_decode_tok_s(hf, prompt, args.decode_tokens)}, args.rounds)
    ours, theirs = res["glm5"], res["hf"]
    record("single_stream_decode", prompt_len=64, new_tokens=args.decode_tokens, rounds=args.rounds,
           glm5_tok_s=median(ours, 0), hf_tok_s=median(theirs, 0), ratio=ratio_stats(ours, theirs, 0),
           glm5_tok_per_cpu_s=median(ours, 1), hf_tok_per_cpu_s=median(theirs, 1),
           ratio_cpu=ratio_stats(ours, theirs, 1))
    RESULTS["_fp32_decode"] = (median(ours, 0), median(ours, 1))


def batch_decode_tok_s(engine: LLMEngine, prompts, n: int) -> tuple[float, float]:
    """n decode steps of len(prompts) sequences on `engine`, timed after the step that prefills them all."""
    params = SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}-{time.perf_counter()}", prompt_token_ids=p, params=params)
    engine.step()  # every prompt fits one step's token budget: prefill + first tokens
    t0 = stamp()
    while engine.has_unfinished_requests():
        engine.step()
    return rate(n * len(prompts), t0, stamp())


def bench_compile(model, args) -> None:
    """Captured decode (EngineConfig.compile_decode="inductor": torch.compile(fullgraph=True) of the model's
    paged forward per batch bucket) vs eager, decode tok/s at batch 1 and 8, same engine options; the
    compiled engine builds its bucket in a warm-up run first (its build seconds are reported). Keys are
    padded to max_model_len (256 here) in the compiled step; the eager one attends each step's own keys."""
    for kernels in ("torch", "native"):
        for batch in (1, 8):
            prompts = workload(batch, 64, 64, seed=4)
            engines = {"eager": engine_for(model, kernels=kernels, max_model_len=256),
                       "compiled": engine_for(model, kernels=kernels, max_model_len=256, compile_decode="inductor")}
            for e in engines.values():  # warm-up: first calls, the compiled engine's bucket build
                batch_decode_tok_s(e, prompts, 2)
            res = alternate({k: (lambda e=e: batch_decode_tok_s(e, prompts, args.decode_tokens))
                             for k, e in engines.items()}, max(1, args.rounds - 2))
            st = engines["compiled"].get_stats()
            record(f"compiled_decode_{kernels}_batch{batch}", kernels=kernels, batch=batch, prompt_len=64,
                   new_tokens=args.decode_tokens, max_model_len=256, eager_tok_s=median(res["eager"], 0),
                   compiled_tok_s=median(res["compiled"], 0), eager_tok_per_cpu_s=median(res["eager"], 1),
                   compiled_tok_per_cpu_s=median(res["compiled"], 1),
                   ratio=ratio_stats(res["compiled"], res["eager"], 0),
                   ratio_cpu=ratio_stats(res["compiled"], res["eager"], 1), compile_s=st["decode_compile_s"],
                   buckets=st["decode_compiled_buckets"], compiled_steps=st["decode_graph_steps"],
                   disabled=st["decode_compile_disabled"], load_avg=os.getloadavg())


def bench_kernels(model, args) -> None:
    """The CPU backends at decode, same run, alternated: PyTorch's ops (`kernels="torch"`), the per-function
    native kernels alone (typed ops swapped in: norms, few-row linear layers, SwiGLU, router, experts,
    attention; `native_layer_kernel=False`) and those plus the whole-layer decode kernel (the default),
    batch 1 and 8, 64-token prompts; tokens per CPU second (and wall), and whether the greedy tokens agree."""
    modes = {"torch": dict(kernels="torch"), "native_ops": dict(kernels="native", native_layer_kernel=False),
             "native_layer": dict(kernels="native")}
    for batch in (1, 8):
        prompts = workload(batch, 64, 64, seed=5)
        engines = {k: engine_for(model, max_model_len=256, **kw) for k, kw in modes.items()}
        tokens = {k: run_engine(e, prompts, 8)[1] for k, e in engines.items()}  # warm-up and agreement
        res = alternate({k: (lambda e=e: batch_decode_tok_s(e, prompts, args.decode_tokens))
                         for k, e in engines.items()}, max(1, args.rounds - 2))
        record(f"kernels_decode_batch{batch}", batch=batch, prompt_len=64, new_tokens=args.decode_tokens,
               **{f"{k}_tok_per_cpu_s": median(v, 1) for k, v in res.items()},
               **{f"{k}_tok_s": median(v, 0) for k, v in res.items()},
               ops_over_torch_cpu=ratio_stats(res["native_ops"], res["torch"], 1),
               layer_over_ops_cpu=ratio_stats(res["native_layer"], res["native_ops"], 1),
               greedy_agree=all(tokens[k] == tokens["torch"] for k in tokens), load_avg=os.getloadavg())


def bench_long_decode(model, hf, args) -> None:
    """Single-stream decode past `index_topk` (1,024 prompt tokens on `small`, top-256): DSA sparse attention
    at every step, glm5 (the native layer kernel selects and attends the top-k) vs transformers `generate`."""
    prompt = workload(1, 1024, 1024, seed=2)[0]
    res = alternate({"glm5": lambda: engine_decode_tok_s(model, prompt, args.decode_tokens, max_model_len=2048),
                     "hf": lambda: hf_decode_tok_s(hf, prompt, args.decode_tokens)}, max(1, args.rounds - 2))
    ours, theirs = res["glm5"], res["hf"]
    record("long_context_decode", prompt_len=len(prompt), index_topk=model.config.index_topk,
           new_tokens=args.decode_tokens, glm5_tok_s=median(ours, 0), hf_tok_s=median(theirs, 0),
           ratio=ratio_stats(ours, theirs, 0), ratio_cpu=ratio_stats(ours, theirs, 1))


def bench_tiny_batch(args) -> None:
    """A new user's first try: 32 short prompts on a 3-layer, hidden-128 checkpoint (the `tiny` preset cut to
    3 layers), engine vs one padded transformers `generate` batch, alternated over the rounds."""
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=3)
    torch.manual_seed(0)
    tiny = GLM5ForCausalLM(cfg).init_weights(0).eval()
    ckpt = args.ckpt + "-tiny3"
    save_pretrained(tiny, ckpt)
    hf = hf_model(ckpt)
    prompts = workload(32, 8, 48, seed=3)
    n = args.max_tokens
    engine_for(tiny, max_model_len=256).step()  # import/first-call warm-up outside the timings
    res = alternate({"glm5": lambda: timed(run_engine, engine_for(tiny, max_model_len=256), prompts, n),
                     "hf": lambda: timed(run_hf, hf, prompts, n, 32)}, args.rounds)
    ours, theirs = run_engine(engine_for(tiny, max_model_len=256), prompts, n)[1], run_hf(hf, prompts, n, 32)[1]
    gen = len(prompts) * n
    record("tiny_batch32", layers=3, hidden=cfg.hidden_size, num_prompts=32, max_tokens=n, rounds=args.rounds,
           glm5_tok_s=gen / median(res["glm5"], 0), hf_tok_s=gen / median(res["hf"], 0),
           speedup=ratio_stats(res["hf"], res["glm5"], 0), speedup_cpu=ratio_stats(res["hf"], res["glm5"], 1),
           identical_outputs=f"{sum(a == b for a, b in zip(ours, theirs))}/{len(prompts)}")


def bench_sessions(args) -> None:
    """Seed I8: KV a 24-turn conversation holds at its last turn, unlimited vs max_session_len 512 with the
    drop and summarize policies (tiny preset, bundled tokenizer, 24 new tokens per reply)."""
    from glm5.infer.session import Session
    cfg = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    tiny = GLM5ForCausalLM(cfg).init_weights(0).eval()
    rows = {}
    for name, limit, policy in (("unlimited", None, "drop"), ("drop", 512, "drop"), ("summarize", 512, "summarize")):
        engine = LLMEngine(EngineConfig(model="tiny", device="cpu", max_model_len=2048, num_blocks=200), model=tiny,
                           tokenizer=load_tokenizer_for("tiny", cfg.vocab_size))
        sess = Session(engine, max_session_len=limit, policy=policy, system="You are a helpful assistant.")
        t = time.perf_counter()
        for turn in range(24):
            out = sess.send(f"Turn {turn}: tell me one more thing about the history of tea.",
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        kv = (len(out.prompt_token_ids) + 24) * engine.runner.cache.bytes_per_token()
        rows[name] = dict(last_prompt_tokens=len(out.prompt_token_ids), kv_bytes_last_turn=kv,
                          seconds=time.perf_counter() - t, **sess.stats())
    base = rows["unlimited"]["kv_bytes_last_turn"]
    record("sessions_24_turns", **{k: {**v, "kv_vs_unlimited": v["kv_bytes_last_turn"] / base} for k, v in rows.items()})


def bench_kv(model) -> None:
    cfg = model.config
    ours, exp = bytes_per_token(cfg), expanded_bytes_per_token(cfg)
    g5 = ModelConfig.from_preset("glm-5")
    record("kv_bytes_per_token", small_latent=ours, small_expanded=exp, small_ratio=exp / ours,
           glm5_latent_bf16=bytes_per_token(g5, torch.bfloat16),
           glm5_expanded_bf16=expanded_bytes_per_token(g5, torch.bfloat16),
           glm5_ratio=expanded_bytes_per_token(g5) / bytes_per_token(g5))


def bench_int8(model, args) -> None:
    choice, times = quant.select_kernels(model.config.hidden_size, 3 * model.config.hidden_size)
    record("int8_kernels_us", **{b: {k: v * 1e6 for k, v in t.items()} for b, t in times.items()},
           choice=choice)
    qmodel = quant.quantize_model(copy.deepcopy(model), choice)
    prompt = workload(1, 64, 64, seed=1)[0]
    res = alternate({"int8": lambda: engine_decode_tok_s(qmodel, prompt, args.decode_tokens),
                     "fp32": lambda: engine_decode_tok_s(model, prompt, args.decode_tokens)}, args.rounds)
    q, fp = res["int8"], res["fp32"]
    record("int8_vs_fp32", rounds=args.rounds, fp32_decode_tok_s=median(fp, 0), int8_decode_tok_s=median(q, 0),
           speedup=ratio_stats(q, fp, 0), fp32_tok_per_cpu_s=median(fp, 1), int8_tok_per_cpu_s=median(q, 1),
           speedup_cpu=ratio_stats(q, fp, 1),
           fp32_weight_mb=quant.weight_bytes(model) / 2**20, int8_weight_mb=quant.weight_bytes(qmodel) / 2**20,
           memory_ratio=quant.weight_bytes(qmodel) / quant.weight_bytes(model))
    int8_quality(model, qmodel, args, "small_random")
    if args.train_steps and os.path.exists(os.path.join(args.train, "meta.json")):
        tiny = train_tiny(args)
        int8_quality(tiny, quant.quantize_model(copy.deepcopy(tiny), choice), args, "tiny_trained")


def token_stream(path: str, n: int) -> torch.Tensor:
    from glm5.data.shards import TokenShards
    shards = TokenShards(path)
    docs, total = [], 0
    for i in range(len(shards)):
        docs.append(torch.as_tensor(shards.doc(i).astype("int64")))
        total += docs[-1].numel()
        if total > n:
            break
    return torch.cat(docs)[:n]


def train_tiny(args) -> GLM5ForCausalLM:
    """A briefly trained `tiny` model, so that INT8 perplexity is measured on meaningful logits."""
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", num_nextn_predict_layers=0)).init_weights(0)
    data = token_stream(args.train, 2_000_000)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    T, B = 128, 8
    t0 = time.perf_counter()
    for step in range(args.train_steps):
        starts = torch.randint(0, data.numel() - T - 1, (B,), generator=g)
        x = torch.stack([data[s:s + T] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + T + 1] for s in starts.tolist()])
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    record("tiny_training", steps=args.train_steps, final_loss=loss.item(), seconds=time.perf_counter() - t0)
    return model.eval()


@torch.inference_mode()
def int8_quality(model, qmodel, args, label: str) -> None:
    if not os.path.exists(os.path.join(args.validation, "meta.json")):  # the quality rows need tokenized text
        record(f"int8_quality_{label}", skipped=f"no token shards at {args.validation}: run `glm5 data tokenize`")
        return
    stream = token_stream(args.validation, args.ppl_tokens + 1)
    T = 256
    n = (stream.numel() - 1) // T
    x, y = stream[: n * T].view(n, T), stream[1: n * T + 1].view(n, T)
    nll, err, flips = {}, 0.0, 0.0
    for name, m in (("fp32", model), ("int8", qmodel)):
        logits = torch.cat([m(x[i:i + 4]).logits for i in range(0, n, 4)])  # [n, T, V]
        nll[name] = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
        if name == "fp32":
            ref = logits
        else:
            err = ((logits - ref).abs().max() / ref.std()).item()
            flips = (logits.argmax(-1) != ref.argmax(-1)).float().mean().item()
    record(f"int8_quality_{label}", tokens=n * T, ppl_fp32=math.exp(nll["fp32"]), ppl_int8=math.exp(nll["int8"]),
           ppl_change_pct=100 * (math.exp(nll["int8"] - nll["fp32"]) - 1), max_logit_err_over_std=err,
           argmax_flip_rate=flips)


def bench_offload(model, args) -> None:
    """Experts memory-mapped + an LRU of R experts per layer (of 64): resident bytes, speed, hit rate."""
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n)
    for num_prompts, resident in ((8, 8), (1, 32)):
        prompts = workload(num_prompts, 32, 64, seed=2)
        t_full, ref = run_engine(engine_for(model), prompts, 16)
        off = LLMEngine(EngineConfig(model=args.ckpt, device="cpu", max_model_len=1024, max_num_seqs=64,
                                     max_num_batched_tokens=2048, max_resident_experts=resident))
        t_off, out = run_engine(off, prompts, 16)
        st = off.get_stats()
        record(f"expert_offload_batch{num_prompts}", resident_experts_per_layer=resident,
               of_experts=model.config.n_routed_experts, full_weight_mb=quant.weight_bytes(model) / 2**20,
               offload_resident_mb=(quant.weight_bytes(off.model) + st["expert_cache_bytes"]) / 2**20,
               routed_expert_mb=experts / 2**20, hit_rate=st["expert_cache_hit_rate"],
               tok_s_full=num_prompts * 16 / t_full, tok_s_offload=num_prompts * 16 / t_off,
               identical_outputs=out == ref)


def bandwidth_gbs(mb: int = 512) -> float:
    a = torch.empty(mb * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    return 5 * 2 * a.nbytes / (time.perf_counter() - t) / 1e9  # read + write


def active_weight_bytes(model) -> int:
    """Weight bytes one decode token touches: everything except the unused routed experts and the
    embedding table (one row) and the MTP layer."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if name.startswith(f"model.layers.{cfg.num_hidden_layers}") or "embed_tokens" in name:
            continue
        n = p.numel() * p.element_size()
        if ".mlp.experts." in name:
            n = n * cfg.num_experts_per_tok // cfg.n_routed_experts
        total += n
    return total


def bench_bandwidth(model) -> None:
    bw = bandwidth_gbs()
    active = active_weight_bytes(model)
    bound = bw * 1e9 / active
    tok_s = RESULTS.get("_fp32_decode", (0.0, 0.0))
    record("bandwidth_bound", copy_bandwidth_gbs=bw, active_weight_mb=active / 2**20, bound_tok_s=bound,
           measured_tok_s=tok_s[0], fraction=tok_s[0] / bound, measured_tok_per_cpu_s=tok_s[1],
           fraction_cpu=tok_s[1] / bound)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both peers")
    p.add_argument("--ckpt", default="/tmp/glm5-bench-small")
    p.add_argument("--validation", default="runs/data/tokens/validation")
    p.add_argument("--train", default="runs/data/tokens/train")
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--arch", choices=list(ARCHS), default="glm_moe_dsa", help="the model family member to bench")
    p.add_argument("--compile", action="store_true",
                   help="also measure compiled (compile_decode=inductor) vs eager decode at batch 1 and 8 "
                        "(= --only compile)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    q = args.quick
    args.num_prompts, args.min_len, args.max_len = (16, 8, 64) if q else (64, 16, 256)
    args.max_tokens, args.hf_batch = (8, 16) if q else (32, 64)
    args.decode_tokens, args.ppl_tokens = (8, 1024) if q else (64, 8192)
    args.train_steps = 20 if q else 300
    args.rounds = 1 if q else 5
    print(json.dumps({"threads": args.threads, "load_avg": os.getloadavg(), "torch": torch.__version__}))
    model = build(args.ckpt, args.arch)
    only = set(args.only or ["kv", "tiny32", "sessions", "single", "long", "offline", "int8", "offload", "bandwidth"])
    if args.compile:
        only = {"compile"} | set(args.only or [])
    hf = hf_model(args.ckpt) if only & {"single", "long", "offline"} else None
    if "compile" in only:
        bench_compile(model, args)
    if "kernels" in only:
        bench_kernels(model, args)
    if "kv" in only:
        bench_kv(model)
    if "tiny32" in only:
        bench_tiny_batch(args)
    if "sessions" in only:
        bench_sessions(args)
    if "single" in only:
        bench_single_stream(model, hf, args)
    if "long" in only:
        bench_long_decode(model, hf, args)
    if "offline" in only:
        bench_offline(model, hf, args)
    if "int8" in only:
        bench_int8(model, args)
    if "offload" in only:
        bench_offload(model, args)
    if "bandwidth" in only:
        bench_bandwidth(model)
    print(json.dumps({"load_avg_end": os.getloadavg()}))


if __name__ == "__main__":
    main()
