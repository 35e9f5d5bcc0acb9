"""`--model` for every command that runs a model: a checkpoint directory, a preset, or (when not given,
or given as `bundled:smollm2-glm5`) the embedded default model, built on first use (glm5/apps/embedded.py)."""

from __future__ import annotations

import sys

from glm5.apps.embedded import EMBEDDED, NAME, SPECULATIVE, build_report, embedded_model

# Engine options the embedded model is served with unless the command sets them: its MTP layer is trained
# for speculation (one draft per step, corrected by prompt lookup; acceptance in docs/convert.md).
EMBEDDED_ENGINE_DEFAULTS = dict(SPECULATIVE)


def resolve_model(value: str | None) -> str:
    """The model argument as a path or preset; None / `bundled:smollm2-glm5` -> the embedded model's
    directory (built first if needed, progress on stderr)."""
    if value is None or value == EMBEDDED:
        return str(embedded_model(log=lambda m: print(m, file=sys.stderr, flush=True)))
    return value


def is_embedded(value: str | None) -> bool:
    return value is None or value == EMBEDDED


def embedded_name() -> str:
    return NAME


def embedded_summary() -> dict:
    return build_report()
