"""`glm5 lm-eval ...`: lm-evaluation-harness's own command line with the `glm5` model registered.

    glm5 lm-eval run --model glm5 --model_args pretrained=runs/tiny/final --tasks hellaswag
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("glm5 lm-eval: lm-eval is not installed (pip install -c constraints.txt 'lm-eval==0.4.13')",
              file=sys.stderr)
        return 2
    import glm5.eval.lm_eval_model  # noqa: F401  (registers --model glm5)

    sys.argv = ["lm_eval", *(sys.argv[2:] if argv is None else argv)]
    cli_evaluate()
    return 0
