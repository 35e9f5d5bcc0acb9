"""Schedules as pure functions of the optimizer step: learning rate, batch-size ramp, and the
objective mix.

Owns: `lr_factor(step)` for linear warmup + cosine / WSD / linear / constant (the LR actually used is
`base_lr * factor * stability_scale`), `BatchRamp` (global batch size growing from a start value to
the target, realised as a growing number of gradient-accumulation micro-steps), and
`pick_objective`, a deterministic function of (seed, step, micro-step) so that a resumed run draws
the same objectives without saving any RNG. Being stateless is what makes resume exact.
"""

from __future__ import annotations

import math
import random


def lr_factor(step: int, cfg, total_steps: int) -> float:
    """Multiplier on the base LR at optimizer step `step` (0-based) for a `ScheduleConfig`.

    warmup: linear from `warmup_init` to 1 over `warmup_steps` (step 0 already gets a small LR).
    cosine: 1 -> `min_lr_ratio` over the steps after warmup (half cosine).
    wsd:    stays at 1, then decays over the last `decay_ratio` of the steps (`decay_type`).
    linear: 1 -> `min_lr_ratio` linearly after warmup. constant: 1 after warmup.
    """
    warmup = cfg.warmup_steps
    if step < warmup:
        frac = (step + 1) / warmup
        return cfg.warmup_init + (1.0 - cfg.warmup_init) * frac
    lo = cfg.min_lr_ratio
    last = total_steps - 1  # the final step gets exactly `min_lr_ratio`
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "wsd":
        decay_steps = max(1, round(cfg.decay_ratio * total_steps))
        start = max(warmup, last - decay_steps)
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, last - start))
        return lo + (1.0 - lo) * _decay_shape(progress, cfg.decay_type)
    progress = min(1.0, (step - warmup) / max(1, last - warmup))
    if cfg.name == "cosine":
        return lo + (1.0 - lo) * _decay_shape(progress, "cosine")
    if cfg.name == "linear":
        return lo + (1.0 - lo) * _decay_shape(progress, "linear")
    raise ValueError(f"schedule.name: unknown schedule {cfg.name!r}")


def _decay_shape(progress: float, kind: str) -> float:
    """1 at progress 0 down to 0 at progress 1."""
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return 1.0 - progress
    if kind == "sqrt":  # "1 - sqrt" decay (WSD papers): fast drop at the end
        return 1.0 - math.sqrt(progress)
    raise ValueError(f"schedule.decay_type: unknown decay {kind!r}")


class BatchRamp:
    """Global batch size (in sequences) at each step, ramping linearly from `start` to `target`.

    The global batch is `micro_batch * world_size * accum`; the ramp changes `accum`, rounded down to
    a whole number of micro-batches (Megatron's `--rampup-batch-size` does the same in increments).
    `start <= 0` disables the ramp: `accum` is `grad_accum` throughout.
    """

    def __init__(self, micro_batch: int, world_size: int, grad_accum: int, start: int = 0,
                 ramp_steps: int = 0):
        self.unit = micro_batch * world_size
        self.target = self.unit * grad_accum
        self.start, self.ramp_steps, self.grad_accum = start, ramp_steps, grad_accum
        if start > 0 and start < self.unit:
            raise ValueError(f"train.batch_ramp_start={start} is below one micro-batch per rank "
                             f"({self.unit} sequences)")

    def global_batch(self, step: int) -> int:
        return self.accum(step) * self.unit

    def accum(self, step: int) -> int:
        """Gradient-accumulation micro-steps per optimizer step at `step`."""
        if self.start <= 0 or self.ramp_steps <= 0 or step >= self.ramp_steps:
            return self.grad_accum
        size = self.start + (self.target - self.start) * step / self.ramp_steps
        return max(1, min(self.grad_accum, int(size // self.unit)))


def pick_objective(mix: dict[str, float], seed: int, step: int, micro: int) -> str:
    """Draw the objective of one micro-batch with probabilities proportional to `mix`.

    Seeded by (seed, step, micro) alone, so it is reproducible and needs no saved state.
    """
    names = [k for k, w in mix.items() if w > 0]
    if len(names) == 1:
        return names[0]
    if not names:
        raise ValueError("train.objectives: every weight is 0")
    rng = random.Random(f"{seed}-{step}-{micro}")
    return rng.choices(names, weights=[mix[k] for k in names])[0]
