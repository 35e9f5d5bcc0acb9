"""A tiny random GLM-5 checkpoint with the bundled 8k tokenizer, and small MMLU-layout files, for the
eval tests (not a test module: imported by them)."""

from __future__ import annotations

import csv
from pathlib import Path

from glm5.data.tokenizer import load_tokenizer
from glm5.model.config import ModelConfig
from glm5.model.hf_adapter import save_pretrained
from glm5.model.model import GLM5ForCausalLM

TOKENIZER = Path(__file__).resolve().parents[1] / "glm5" / "data" / "assets" / "tokenizer-8k"
MMLU_ROWS = [["What is 2+2?", "3", "4", "5", "6", "B"], ["Capital of France?", "Paris", "Rome", "Berlin", "Madrid", "A"],
             ["Colour of the sky?", "green", "red", "blue", "black", "C"], ["1, 2, 3, ?", "5", "7", "9", "4", "D"]]


def make_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    cfg = ModelConfig.load("tiny", **{"num_hidden_layers": 2, "hidden_size": 64, "num_nextn_predict_layers": 0,
                                      **overrides})
    save_pretrained(GLM5ForCausalLM(cfg).init_weights(seed), path)
    load_tokenizer(TOKENIZER).save(path)
    return path


def make_mmlu(root: Path, subjects=("algebra", "geography")) -> Path:
    for split in ("test", "dev"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for s in subjects:
            with open(root / split / f"{s}_{split}.csv", "w", newline="") as f:
                csv.writer(f).writerows(MMLU_ROWS)
    return root
