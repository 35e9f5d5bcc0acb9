"""`glm5 quickstart`: the main job, end to end on the bundled corpus (2 CPU cores, ~10-15 minutes).

  1. clean the bundled corpus          glm5 data run --config configs/data/default.toml
  2. tokenise the cleaned documents    glm5 data tokenize --config configs/data/tokenize.toml ...
  3. pretrain the `tiny` preset        glm5 train --config configs/train/tiny.toml
  4. generate from the final model     glm5 generate --model runs/tiny/final --prompt ...

Every step is resumable: a finished data step is skipped, training resumes from its last checkpoint.
Extra `--section.key=value` arguments go to the training config (e.g. `--train.steps=100`).
The configs and the corpus are package data, so it runs from any directory; outputs go under the
current one (`runs/`). A smoke run: `glm5 quickstart --limit-docs 300 --train.steps=5 --max-tokens 4`.
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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="glm5 quickstart", description=__doc__.split("\n")[0])
    ap.add_argument("--skip-data", action="store_true", help="reuse runs/data from an earlier run")
    ap.add_argument("--run-dir", default="runs/tiny", help="training output directory")
    ap.add_argument("--data-dir", default="runs/data", help="where cleaned documents and token shards go")
    ap.add_argument("--max-tokens", type=int, default=40, help="tokens generated per prompt at the end")
    ap.add_argument("--limit-docs", type=int, default=0, help="clean only the first N corpus documents (0 = all)")
    args, overrides = ap.parse_known_args(argv)
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
                           "--max-tokens", str(args.max_tokens)])
    print(f"\nquickstart finished: model in {final}, metrics in {args.run_dir}/metrics.jsonl; "
          f"plots with `glm5 plot {args.run_dir}`")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
