"""Every GPU check of issues 12 and 15 in one prepared script, sized for a short device window (~10 min on
one H200, no network, a fresh copy of this repository with torch installed).

    python bench/gpu_check.py --budget-s 540              # on the GPU machine: results in $OUT (else ./)
    python bench/gpu_check.py --device cpu --quick        # dry run on CPU: every code path, tiny sizes

Sections, in order (each in its own try/except; one that no longer fits the time budget is skipped and
says so):
  env     versions, the GPU, whether glm5's engine has a CUDA-graph path (it reads `compile_decode`)
  peak    the measured bf16 matmul peak (8192^3 on CUDA), the denominator of every MFU here
  tests   `python -m pytest -q -m gpu` on the test files holding `gpu`-marked tests: pass/fail counts
  engine  bf16 `small` preset (random weights, a checkpoint in a temp dir, both peers load it): offline
          throughput for 64 mixed-length prompts and single-stream decode tok/s, glm5 LLMEngine vs
          transformers `generate` (sdpa, bf16) on the same GPU (bench/engine.py's measurements, run on CUDA)
  graphs  the captured decode step (glm5/infer/graphs.py): one bucket's logits replayed from a CUDA graph and
          compiled by torch.compile vs the same step eagerly; decode tok/s at batch 1 and 8, engines with
          compile_decode none / inductor / cuda_graphs, and their build seconds
  train   one training step on CUDA, bf16 autocast + fp32 masters: glm5 Trainer, glm5's model in a plain
          loop and transformers' GlmMoeDsaForCausalLM in the same loop, each in its own process
          (bench/train.py's children): tokens/s, Trainer / transformers (issue 15 target >= 2x), MFU
          against the peak above, which expert kernel ran (`torch._grouped_mm` expected)

Every result is one JSON line in $OUT/gpu_check.jsonl as soon as it is measured (a run killed at its time
limit keeps what it had); $OUT/gpu_check.md is a short summary, rewritten after each section.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import types
import xml.etree.ElementTree as ET
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's glm5, also where it is not pip-installed (the GPU machine)

import torch  # noqa: E402

# seconds each section is expected to need on the GPU machine (a section starts only if that much is left)
ESTIMATE_S = {"env": 5, "peak": 10, "tests": 60, "engine": 150, "graphs": 200, "train": 150}
QUICK_ESTIMATE_S = {"env": 1, "peak": 1, "tests": 20, "engine": 20, "graphs": 20, "train": 40}


def load_bench(name: str) -> types.ModuleType:
    """bench/NAME.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Run:
    """The time budget, the JSON-lines log and the Markdown summary of one gpu_check run."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.out = Path(args.out or os.environ.get("OUT") or ".")
        self.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out / "gpu_check.jsonl"
        self.jsonl.write_text("")
        self.rows: list[dict] = []
        self.peak_flops = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def record(self, section: str, name: str, **values) -> None:
        row = {"section": section, "name": name, "t_s": round(self.elapsed(), 1), **values}
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(json.dumps(row, default=str), flush=True)

    def section(self, name: str, fn) -> None:
        need = (QUICK_ESTIMATE_S if self.args.quick else ESTIMATE_S)[name]
        if self.left() < need:
            self.record(name, "status", status="skipped",
                        reason=f"time budget: {self.left():.0f} s left of {self.args.budget_s:.0f}, needs ~{need} s")
        else:
            print(f"== {name} (t={self.elapsed():.0f} s, {self.left():.0f} s left)", flush=True)
            t = time.monotonic()
            try:
                fn(self)
                self.record(name, "status", status="ok", seconds=round(time.monotonic() - t, 1))
            except Exception as e:  # noqa: BLE001 (one section's failure must not lose the others)
                self.record(name, "status", status="error", seconds=round(time.monotonic() - t, 1),
                            error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-3000:])
        gc.collect()  # the section's models and KV cache, before the next one (train children share the GPU)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.write_md()

    def write_md(self) -> None:
        (self.out / "gpu_check.md").write_text(summary(self.rows, self.args))


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def summary(rows: list[dict], args) -> str:
    """Markdown: one block per section, its status first, then each measurement's values."""
    mode = "quick dry run, " if args.quick else ""
    lines = [f"# gpu_check ({mode}device {args.device}, budget {args.budget_s:.0f} s)", ""]
    for section in ESTIMATE_S:
        mine = [r for r in rows if r["section"] == section]
        if not mine:
            continue
        status = next((r for r in mine if r["name"] == "status"), {"status": "running or killed"})
        extra = status.get("reason") or status.get("error") or (f"{status['seconds']} s" if "seconds" in status else "")
        lines.append(f"## {section}: {status['status']}" + (f" ({extra})" if extra else ""))
        for r in mine:
            if r["name"] == "status":
                continue
            vals = ", ".join(f"{k}={fmt(v)}" for k, v in r.items() if k not in ("section", "name", "t_s"))
            lines.append(f"- **{r['name']}**: {vals}")
        lines.append("")
    return "\n".join(lines)


# ---- sections ---------------------------------------------------------------------------------------------
def graph_path() -> tuple[bool, str]:
    """Does glm5's engine have a CUDA-graph (or compiled) decode, i.e. does any module besides the config
    read `compile_decode`? Decided from the source so that this script follows the engine as it changes."""
    infer = ROOT / "glm5" / "infer"
    users = sorted(p.name for p in infer.glob("*.py") if p.name != "config.py" and "compile_decode" in p.read_text())
    if users:
        return True, (f"compile_decode read in glm5/infer/{', '.join(users)}: the `graphs` section measures "
                      "eager vs inductor vs cuda_graphs decode")
    return False, "no CUDA-graph path: nothing in glm5/infer reads compile_decode, the engine runs eagerly"


def env_section(run: Run) -> None:
    import transformers
    cuda = torch.cuda.is_available()
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    has_graphs, note = graph_path()
    run.record("env", "versions", python=platform.python_version(), torch=torch.__version__,
               transformers=transformers.__version__, cuda=torch.version.cuda, commit=commit,
               gpu=torch.cuda.get_device_name(0) if cuda else None,
               capability=".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
               gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
               cpu_threads=torch.get_num_threads(), load_avg=os.getloadavg())
    run.record("env", "engine_graph_path", present=has_graphs, note=note)


def peak_section(run: Run) -> None:
    """Best of 10 timed n x n x n matmuls after 3 warm-ups: bf16 on CUDA (n 8192), fp32 on CPU (the training
    dtype there; n 256 in --quick)."""
    dev = torch.device(run.args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = 8192 if dev.type == "cuda" else (256 if run.args.quick else 1024)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    best = float("inf")
    for i in range(13):
        sync(dev)
        t = time.perf_counter()
        a @ b
        sync(dev)
        if i >= 3:
            best = min(best, time.perf_counter() - t)
    run.peak_flops = 2 * n**3 / best
    run.record("peak", "matmul_peak", dtype=str(dtype), n=n, tflops=run.peak_flops / 1e12)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


def tests_section(run: Run) -> None:
    """The `gpu`-marked tests, from the files that hold some (collecting every test module would import
    packages the GPU machine may lack: fastapi, xgrammar, ...). Counts from pytest's JUnit XML."""
    files = gpu_test_files()
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  timeout=max(10.0, min(run.left() - 5, 300)),
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])})
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"pytest ran past {e.timeout:.0f} s") from e
        counts = junit_counts(xml) if xml.is_file() else {}
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    run.record("tests", "pytest_gpu", exit_code=done.returncode, files=files, **counts, failed=failed[:20],
               tail=done.stdout.strip().splitlines()[-3:])


def junit_counts(xml: Path) -> dict:
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {**n, "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"]}


def hf_peer(run: Run, be: types.ModuleType, ckpt: str, dtype: torch.dtype, warm: list[list[int]]):
    """(transformers model, attention implementation), warmed up with a short `generate`: sdpa then eager
    on CUDA, eager on CPU (bench/engine.py's). (None, None), recorded, when none loads or generates (the
    GPU machine's transformers may differ from ours): glm5's numbers are still measured."""
    for attn in (["sdpa", "eager"] if run.args.device == "cuda" else ["eager"]):
        try:
            hf = be.hf_model(ckpt, dtype=dtype, device=run.args.device, attn=attn)
            be.run_hf(hf, warm, 2, 2)
            return hf, attn
        except Exception as e:  # noqa: BLE001
            run.record("engine", "hf_peer_failed", attn=attn, error=f"{type(e).__name__}: {e}"[:1500])
    return None, None


def engine_section(run: Run) -> None:
    """bench/engine.py's offline and single-stream measurements on `run.args.device`."""
    from glm5.model.config import ModelConfig
    from glm5.model.hf_adapter import from_pretrained, save_pretrained
    from glm5.model.model import GLM5ForCausalLM
    be = load_bench("engine")
    a, dev = run.args, run.args.device
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # fp32 on CPU: the engine computes in fp32 there
    preset, overrides = ("tiny", {"num_hidden_layers": 2}) if a.quick else ("small", {})
    n_prompts, lo, hi, max_tokens, decode_tokens, rounds = (8, 8, 32, 4, 4, 1) if a.quick else (64, 16, 256, 32, 64, 3)
    variants = {"": {}}  # the engine's default (eager); compiled and graph decode: the `graphs` section
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        save_pretrained(GLM5ForCausalLM(ModelConfig.from_preset(preset, **overrides)).init_weights(0), ckpt)
        model = from_pretrained(ckpt, dtype=dtype, device=dev).eval()
        prompts = be.workload(n_prompts, lo, hi)
        hf, attn = hf_peer(run, be, ckpt, dtype, prompts[:2])
    common = dict(preset=preset, dtype=str(dtype), hf_attn=attn,
                  hf_experts=getattr(hf.config, "_experts_implementation", None) if hf else None)
    engine = lambda **kw: be.engine_for(model, device=dev, **kw)  # noqa: E731
    for kw in variants.values():  # warm-ups outside the timings (CUDA kernels, graph capture)
        be.run_engine(engine(**kw), prompts[:2], 2)

    if run.left() > 30:
        gen = n_prompts * max_tokens
        t_hf, ref = be.run_hf(hf, prompts, max_tokens, n_prompts) if hf else (None, None)
        row = dict(num_prompts=n_prompts, prompt_lens=[lo, hi], max_tokens=max_tokens, hf_batch=n_prompts,
                   hf_tok_s=gen / t_hf if hf else None, **common)
        for label, kw in variants.items():
            t, outs = be.run_engine(engine(**kw), prompts, max_tokens)
            sfx = f"_{label}" if label else ""
            row[f"glm5_tok_s{sfx}"] = gen / t
            if hf:
                row |= {f"ratio{sfx}": t_hf / t,
                        f"identical_outputs{sfx}": f"{sum(x == y for x, y in zip(outs, ref))}/{n_prompts}"}
        run.record("engine", "offline_throughput", **row)
    else:
        run.record("engine", "offline_throughput", skipped=f"time budget ({run.left():.0f} s left)")

    if run.left() > 20:
        prompt = be.workload(1, 64, 64, seed=1)[0]
        fns = {f"glm5{'_' + k if k else ''}":
               (lambda kw=kw: be.engine_decode_tok_s(model, prompt, decode_tokens, device=dev, **kw))
               for k, kw in variants.items()}
        peer = {"hf": lambda: be.hf_decode_tok_s(hf, prompt, decode_tokens)} if hf else {}
        res = be.alternate({**fns, **peer}, rounds)
        row = dict(prompt_len=64, new_tokens=decode_tokens, rounds=rounds,
                   hf_tok_s=be.median(res["hf"], 0) if hf else None, **common)
        for k in fns:
            sfx = k[len("glm5"):]
            row[f"glm5_tok_s{sfx}"] = be.median(res[k], 0)
            if hf:
                row[f"ratio{sfx}"] = be.ratio_stats(res[k], res["hf"], 0)
        run.record("engine", "single_stream_decode", **row)
    else:
        run.record("engine", "single_stream_decode", skipped=f"time budget ({run.left():.0f} s left)")


def graphs_section(run: Run) -> None:
    """The captured decode step (glm5/infer/graphs.py): logits of one bucket (8 decode rows of different
    lengths over a cache of random rows) replayed from a CUDA graph and compiled by torch.compile, each
    against the same step run eagerly; then decode tok/s at batch 1 and 8 for engines with compile_decode
    none / inductor / cuda_graphs (build seconds from the engine's stats). The CPU dry run compiles with
    dynamo's `eager` backend (the whole trace, no code generation) and has no CUDA-graph mode."""
    from glm5.infer.graphs import DecodeBuffers, DecodeGraphs, decode_step
    from glm5.infer.input_batch import SeqChunk
    from glm5.model.config import ModelConfig
    from glm5.model.hf_adapter import cast_model
    from glm5.model.kv_cache import LatentKVCache
    from glm5.model.model import GLM5ForCausalLM
    be = load_bench("engine")
    a, dev = run.args, run.args.device
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    preset, overrides = ("tiny", {"num_hidden_layers": 2}) if a.quick else ("small", {})
    backend = "inductor" if cuda else "eager"
    modes = {"inductor": {"compile_decode": "inductor", "compile_backend": backend}}
    if cuda:
        modes["cuda_graphs"] = {"compile_decode": "cuda_graphs"}
    torch.manual_seed(0)
    model = cast_model(GLM5ForCausalLM(ModelConfig.from_preset(preset, **overrides)).init_weights(0), dtype)
    model = model.to(dev).eval()
    block, keys, blocks = 16, 256, 96
    # 8 decode rows of 9, 32, ..., 170 keys, each on its own blocks (11 ids apart)
    chunks = [SeqChunk(f"s{i}", 8 + 23 * i, [100 + i], list(range(1 + 11 * i, 1 + 11 * i - (-(9 + 23 * i) // block))))
              for i in range(8)]

    def cache() -> LatentKVCache:
        c = LatentKVCache(model.config, blocks + 1, block, dtype=dtype, device=dev)
        g = torch.Generator().manual_seed(1)
        for t in c.latent + [k for k in c.index_k if k is not None]:
            t.copy_(torch.randn(t.shape, generator=g))
        return c

    with torch.inference_mode():
        buf = DecodeBuffers.allocate(8, keys // block, torch.device(dev))
        buf.fill(chunks, block, blocks)
        ref = decode_step(model, cache(), buf, keys, block)[0].float()
        for mode in modes:
            graphs = DecodeGraphs(model, cache(), mode, [8], block, keys, blocks, backend=backend)
            got = graphs.run(chunks)
            if got is None:
                run.record("graphs", f"step_{mode}", error=graphs.disabled)
                continue
            got = got[0].float()
            run.record("graphs", f"step_{mode}", bucket=8, dtype=str(dtype), backend=backend if mode == "inductor"
                       else None, max_abs_diff=(got - ref).abs().max().item(),
                       greedy_agree=f"{int((got.argmax(-1) == ref.argmax(-1)).sum())}/8",
                       build_s=round(sum(graphs.compile_seconds.values()), 2))
    del buf
    n = 2 if a.quick else 32
    for batch in (1, 8):
        if run.left() < 30:
            run.record("graphs", f"decode_batch{batch}", skipped=f"time budget ({run.left():.0f} s left)")
            continue
        prompts = be.workload(batch, 64, 64, seed=4)
        opts = dict(device=dev, max_model_len=keys, kernels="torch")  # the captured path needs plain experts
        engines = {"eager": be.engine_for(model, **opts)}
        engines |= {m: be.engine_for(model, **opts, **kw) for m, kw in modes.items()}
        for e in engines.values():  # warm-up: CUDA kernels, the bucket's build
            be.batch_decode_tok_s(e, prompts, 2)
        row = dict(batch=batch, new_tokens=n, prompt_len=64, preset=preset, dtype=str(dtype))
        for m, e in engines.items():
            row[f"{m}_tok_s"] = be.batch_decode_tok_s(e, prompts, n)[0]
            if m != "eager":
                st = e.get_stats()
                row[f"{m}_build_s"], row[f"{m}_steps"] = st["decode_compile_s"], st["decode_graph_steps"]
                row[f"{m}_disabled"] = st["decode_compile_disabled"]
                row[f"{m}_vs_eager"] = row[f"{m}_tok_s"] / row["eager_tok_s"]
        run.record("graphs", f"decode_batch{batch}", **row)


def train_child(run: Run, bt: types.ModuleType, a, impl: str) -> dict | None:
    """One bench/train.py child; a failed one is recorded (stderr's tail) and the others still run. If
    transformers' default expert kernel fails under autocast (it casts the rows to the fp32 master weights'
    dtype for grouped_mm), its per-expert loop is tried once instead, and the row says which ran."""
    tries = [a.hf_experts] + (["eager"] if impl == "hf" and a.hf_experts != "eager" else [])
    for experts in tries:
        a.hf_experts = experts
        try:  # (the failed default stays failed: later rounds go straight to the fallback)
            return bt._run_child(a, impl, timeout=max(10.0, run.left() - 5))
        except subprocess.CalledProcessError as e:
            run.record("train", f"{impl}_failed", hf_experts=experts or "default", error=e.stderr.strip()[-1500:])
        except subprocess.TimeoutExpired as e:
            run.record("train", f"{impl}_failed", error=f"ran past {e.timeout:.0f} s")
            return None
    return None


def train_section(run: Run) -> None:
    """bench/train.py's three children on `run.args.device`, interleaved over the rounds; MFU also against
    this run's measured peak (the children's own is a 4096^3 matmul)."""
    bt = load_bench("train")
    q = run.args.quick
    a = types.SimpleNamespace(batch=1 if q else 16, seq=32 if q else 1024, steps=1 if q else 8, layers=1 if q else 8,
                              threads=torch.get_num_threads() if run.args.device == "cuda" else 1, mtp=False,
                              device=run.args.device, hf_experts="")  # hf_experts: "eager" once the default failed
    rounds = 1 if q else 2
    from glm5.train.perf import mfu
    rows: dict[str, list[dict]] = {}
    for r in range(rounds):
        for impl in ("glm5", "glm5-plain", "hf"):
            if run.left() < (10 if q else 40):
                run.record("train", f"{impl}_round{r}", skipped=f"time budget ({run.left():.0f} s left)")
                continue
            row = train_child(run, bt, a, impl)
            if row is None:
                continue
            if run.peak_flops and a.device == "cuda":  # on CPU the children run 1 thread, this peak all
                row["mfu_vs_run_peak"] = mfu(row["active_params"], row["tokens_per_s"], run.peak_flops)
            rows.setdefault(impl, []).append(row)
            run.record("train", f"{impl}_round{r}", round=r, batch=a.batch, seq=a.seq, layers=a.layers, **row)
    if rows.get("glm5") and rows.get("hf"):
        ratios = sorted(g["tokens_per_s"] / h["tokens_per_s"] for g, h in zip(rows["glm5"], rows["hf"]))
        plain = sorted(g["tokens_per_s"] / h["tokens_per_s"] for g, h in zip(rows.get("glm5-plain", []), rows["hf"]))
        mfus = sorted(g.get("mfu_vs_run_peak", g["mfu"]) for g in rows["glm5"])
        run.record("train", "trainer_vs_transformers", rounds=len(ratios), ratio_median=ratios[len(ratios) // 2],
                   ratio_min=ratios[0], ratio_max=ratios[-1], target=2.0, met=ratios[len(ratios) // 2] >= 2.0,
                   plain_loop_ratio_median=plain[len(plain) // 2] if plain else None,
                   trainer_mfu_median=mfus[len(mfus) // 2], glm5_experts=rows["glm5"][0].get("experts"),
                   hf_experts=rows["hf"][0].get("experts"))


SECTIONS = {"env": env_section, "peak": peak_section, "tests": tests_section, "engine": engine_section,
            "graphs": graphs_section, "train": train_section}


def main(argv: list[str] | None = None) -> Run:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU dry run)")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip what no longer fits in this many seconds")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {','.join(SECTIONS)}")
    p.add_argument("--out", help="results folder (default $OUT, else .)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (dry run: --device cpu --quick)")
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--only: unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    try:  # loading our checkpoints logs the MTP layer's weights, which transformers has no module for, as a table
        import transformers
        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    run = Run(args)
    for name, fn in SECTIONS.items():
        if name in args.only.split(","):
            run.section(name, fn)
    print(f"done in {run.elapsed():.0f} s: {run.jsonl}, {run.out / 'gpu_check.md'}", flush=True)
    return run


if __name__ == "__main__":
    main()
