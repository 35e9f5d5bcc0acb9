"""`glm5 distill`: knowledge distillation into a small GLM-5-architecture student (docs/eval.md).

    glm5 distill --config configs/distill/smollm2-tiny.toml
    glm5 distill --config configs/distill/smollm2-tiny.toml --distill.alpha=1.0 --log.run_dir=runs/kd/baseline
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from dataclasses import replace

    from glm5.cli.models import is_embedded, resolve_model
    from glm5.core.config import load_cli_config
    from glm5.distill.run import DistillConfig, distill

    cfg = load_cli_config(DistillConfig, argv, "glm5 distill", __doc__.split("\n\n")[0],
                          "configs/distill/smollm2-tiny.toml")
    try:
        if is_embedded(cfg.distill.teacher):  # the embedded teacher is built on first use
            cfg = replace(cfg, distill=replace(cfg.distill, teacher=resolve_model(cfg.distill.teacher)))
        summary = distill(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"glm5 distill: {e}", file=sys.stderr)
        return 2
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
    return 0
