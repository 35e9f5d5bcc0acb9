"""`glm5 data <subcommand>`: dispatch table of the data tools (cleaning pipeline, stats, corpus, tokenizer).

Each entry maps a name to `module:function`; the function takes `argv` and returns an exit code.
Modules are imported only when their subcommand runs. Add a subcommand by adding one line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

SUBCOMMANDS = {
    "run": ("glm5.cli.data:run_main", "clean a corpus: `glm5 data run --config configs/data/default.toml [--a.b=c]`"),
    "stats": ("glm5.cli.data:stats_main", "docs/tokens per source, lang, domain + drop reasons: `glm5 data stats DIR`"),
    "corpus": ("glm5.cli.data:corpus_main", "rebuild the bundled corpus (glm5/data/assets/corpus) from Debian packages"),
    "tokenizer": ("glm5.data.tokenizer_cli:main", "train the tokenizer"),
    "tokenize": ("glm5.data.tokenize_cli:main", "tokenize cleaned shards"),
}


def run_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="glm5 data run", description="Run (or resume) the cleaning pipeline.")
    ap.add_argument("--config", default=None, help="TOML file (configs/data/*.toml)")
    args, overrides = ap.parse_known_args(argv)
    from glm5.core.config import ConfigError, load_config
    from glm5.data.pipeline.config import DataConfig
    from glm5.data.pipeline.runner import run

    try:
        cfg = load_config(DataConfig, args.config, overrides)
        stats = run(cfg)
    except ConfigError as e:  # bad key/value, an output_dir holding another config's run, an unreachable Ray
        print(f"glm5 data run: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: stats[k] for k in ("num_in", "num_out", "wall_seconds")}, indent=2))
    print(f"stats: {cfg.run.output_dir}/stats.json   documents: {cfg.run.output_dir}/data/")
    return 0


def stats_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="glm5 data stats", description="Summarise a directory of JSONL(.gz) docs.")
    ap.add_argument("path", help="a `glm5 data run` output dir, a dir of JSONL files, or one file")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = ap.parse_args(argv)
    from glm5.data.pipeline.stats import format_summary, summarize

    summary = summarize(args.path)
    print(json.dumps(summary, indent=2, ensure_ascii=False) if args.json else format_summary(summary))
    return 0


def corpus_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="glm5 data corpus",
                                 description="Rebuild the bundled corpus (bundled:corpus) from Debian packages.")
    ap.add_argument("--set", choices=["main", "math"], default="main",
                    help="main: the bundled corpus; math: the Maxima manual (bundled:corpus-math)")
    ap.add_argument("--out", default=None, help="output directory (default: the set's bundled directory)")
    ap.add_argument("--validation-fraction", type=float, default=0.02)
    args = ap.parse_args(argv)
    from glm5.core.resources import package_dir, resolve_path
    from glm5.data.pipeline.corpus import SETS, build

    out = resolve_path(args.out) if args.out else package_dir("data", "assets",
                                                              {"main": "corpus", "math": "corpus-math"}[args.set])
    print(build(out, args.validation_fraction, SETS[args.set]))
    return 0


def usage() -> str:
    return "usage: glm5 data <subcommand> [options]\n\nsubcommands:\n" + "\n".join(
        f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"glm5 data: unknown subcommand {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, _, func = SUBCOMMANDS[argv[0]][0].partition(":")
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
