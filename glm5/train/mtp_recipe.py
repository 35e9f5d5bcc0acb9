"""Train the MTP layer of a checkpoint on its frozen trunk in bounded time: `train_mtp(model_dir, out_dir)`.

The recipe is the packaged config `train/smollm2-mtp` (glm5/configs/train/smollm2-mtp.toml): the trunk
frozen (`train.trainable = "mtp"`), the MTP layer fitted in closed form to the trunk's next hidden state
(`train.mtp_init = "lstsq"`), then `train.steps` self-distillation steps (`train.mtp_target = "self"`; 0 in
the packaged config, measured not to help) within what is left of `minutes`, on chat JSONL rendered with
the checkpoint's chat template (the bundled chat set unless `--data.train_path` says otherwise; the model's
own answers, `glm5.distill.mtp.train_mtp_self`, do far better). The run keeps its checkpoints and metrics
in `run_dir` (default `<out_dir>.run/`), so calling again after an interruption resumes it; the result is
written to `out_dir` atomically as an HF checkpoint with the input's files (config.json, safetensors,
generation_config.json, the tokenizer files copied as they are).

    from glm5.train.mtp_recipe import train_mtp
    path = train_mtp("runs/smollm2-glm5", "runs/smollm2-mtp", minutes=4)
    llm = glm5.LLM(str(path), dtype="float32", speculative_num_tokens=1)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from glm5.core.config import load_config
from glm5.core.io import atomic_dir

from .config import TrainConfig
from .trainer import Trainer

RECIPE = "train/smollm2-mtp"
FINAL_S = 20.0  # seconds kept for the final validation and writing the checkpoint


class _RecipeTrainer(Trainer):
    """The trainer with every logged record also passed, as one line, to a `log` callable, and its final
    model written to `out_dir` (instead of `RUN_DIR/final`)."""

    def __init__(self, cfg: TrainConfig, out_dir: Path, log: Callable[[str], None], deadline: float):
        self.log_fn, self.out_dir, self.deadline = log, out_dir, deadline
        super().__init__(cfg)

    def mtp_warm_start(self, writer) -> None:
        """The closed-form fit, then the gradient steps get what is left of the budget (the trainer's time
        limit covers its loop only)."""
        super().mtp_warm_start(writer)
        left = (self.deadline - time.monotonic()) / 60
        self.cfg.train.time_limit_min = max(0.05, left)
        self.log_fn(f"mtp recipe: closed-form fit done, {max(0.0, left):.1f} min left for gradient steps")

    def save_final(self) -> Path:
        """The whole model (config.json, safetensors, generation_config.json) plus the tokenizer files of
        `model.name` as they are (`ChatData.save_tokenizer`), atomically."""
        with atomic_dir(self.out_dir) as tmp:
            self.raw_model.save_pretrained(tmp)
            self.data.save_tokenizer(tmp)
        return self.out_dir

    def _write(self, writer, record: dict) -> None:
        super()._write(writer, record)
        if "mtp_loss" in record:
            agree = f"  agree {record['mtp_agree']:.3f}" if "mtp_agree" in record else ""
            self.log_fn(f"mtp step {self.step}/{self.cfg.train.steps}: mtp_loss {record['mtp_loss']:.3f}{agree}  "
                        f"lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} tok/s")
        elif record.get("event") == "final" and "val_mtp_loss" in record:
            agree = f"  val_mtp_agree {record['val_mtp_agree']:.3f}" if "val_mtp_agree" in record else ""
            self.log_fn(f"mtp final: val_mtp_loss {record['val_mtp_loss']:.3f}{agree}")


def recipe_config(model_dir: str | Path, run_dir: str | Path, minutes: float, overrides: list[str] = (),
                  ) -> TrainConfig:
    """The packaged recipe for `model_dir`, annealed over `minutes`, resuming what `run_dir` holds."""
    return load_config(TrainConfig, RECIPE, [f"--model.name={model_dir}", f"--log.run_dir={run_dir}",
                                             f"--train.time_limit_min={float(minutes)}", "--checkpoint.resume=auto",
                                             *overrides])


def train_mtp(model_dir: str | Path, out_dir: str | Path, minutes: float = 4.0, log: Callable[[str], None] = print,
              run_dir: str | Path | None = None, overrides: list[str] = (), progress: bool = False) -> Path:
    """Train `model_dir`'s MTP layer for at most `minutes` (the recipe's step count, or fewer when the
    time runs out, the LR annealed either way) and write the whole model to `out_dir` (atomic).
    `overrides`: extra `--section.key=value` settings for the recipe (e.g. `--train.num_threads=1`).
    Returns `out_dir`."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a checkpoint directory (no config.json)")
    run_dir = Path(run_dir) if run_dir is not None else out_dir.with_name(out_dir.name + ".run")
    cfg = recipe_config(model_dir, run_dir, minutes, [f"--log.progress={str(progress).lower()}", *overrides])
    t0 = time.monotonic()
    # the budget covers the fit, the steps and the final validation + write (~FINAL_S seconds)
    trainer = _RecipeTrainer(cfg, out_dir, log, deadline=t0 + 60 * minutes - FINAL_S)
    log(f"mtp recipe: {model_dir} -> {out_dir} ({trainer.trainable_params:,} MTP parameters, <= {minutes:g} min, "
        f"{torch.get_num_threads()} threads, run dir {run_dir})")
    trainer.fit()
    log(f"mtp recipe: wrote {out_dir} after {(time.monotonic() - t0) / 60:.1f} min ({trainer.step} steps)")
    return out_dir
