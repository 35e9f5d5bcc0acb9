"""`glm5 prune CHECKPOINT OUT [--config FILE] [--key=value ...]`: cut a smaller GLM-5 student out of a
checkpoint, guided by importance on calibration text (Minitron; glm5/distill/prune.py, docs/distill.md).

    glm5 prune bundled:smollm2-glm5 runs/student --config distill/prune-smollm2
    glm5 prune CKPT OUT --num_hidden_layers=24 --intermediate_size=1024 --n_routed_experts=2

Then heal it with `glm5 distill --model.name=OUT/...` (the teacher: CHECKPOINT). A spec the checkpoint
cannot take exits 2 with one line naming the parameter.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from glm5.cli.models import resolve_model
    from glm5.core.config import ConfigError, load_config
    from glm5.core.io import CheckpointError
    from glm5.core.resources import config_file
    from glm5.distill.prune import PruneConfig, PruneError, prune

    ap = argparse.ArgumentParser(prog="glm5 prune", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="GLM-5 checkpoint directory (or bundled:smollm2-glm5)")
    ap.add_argument("out", help="output checkpoint directory")
    ap.add_argument("--config", default=None, help="TOML file of PruneConfig keys (or a bundled config name)")
    ap.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    args, overrides = ap.parse_known_args(argv)
    try:
        path = None
        if args.config:
            path = config_file(args.config)
        spec = load_config(PruneConfig, path, overrides)
        record = prune(resolve_model(args.checkpoint), args.out, spec,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
    except (PruneError, ConfigError, CheckpointError, FileNotFoundError) as e:
        if args.debug:
            raise
        print(f"glm5 prune: {e}", file=sys.stderr)
        return 2
    print(f"{record['parameters_before']:,} -> {record['parameters_after']:,} parameters -> {args.out}")
    return 0
