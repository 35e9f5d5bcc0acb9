"""`glm5 train` end to end on tiny token shards (the real loader and tokenizer), then `glm5 plot`."""

import gzip
import json
from pathlib import Path

from glm5.cli.main import main
from glm5.core.log import read_metrics
from glm5.core.resources import configs_dir
from glm5.data.tokenize_cli import TokenizeConfig, run

TEXTS = ["The interpreter reads a line, parses it and runs the statement.",
         "Lists keep their order; dictionaries map keys to values.",
         "def add(a, b):\n    return a + b\n",
         "静水流深，言语不多的人往往想得更远。"]


def _shards(tmp: Path) -> Path:
    for split, n in (("train", 60), ("validation", 8)):
        with gzip.open(tmp / f"{split}.jsonl.gz", "wt") as f:
            for i in range(n):
                text = " ".join(TEXTS[(i + j) % len(TEXTS)] for j in range(3))
                f.write(json.dumps({"text": text, "source": "t", "lang": "en", "domain": ["tech", "code"][i % 2]}) + "\n")
    run(TokenizeConfig(splits={"train": [str(tmp / "train.jsonl.gz")], "validation": [str(tmp / "validation.jsonl.gz")]},
                       output=str(tmp / "tokens"), tokenizer="bundled:tokenizer-8k"))
    return tmp / "tokens"


def test_glm5_train_cli_end_to_end_and_plot(tmp_path, capsys):
    tokens = _shards(tmp_path)
    run_dir = tmp_path / "run"
    argv = ["train", "--config", "configs/train/tiny.toml",
            "--model.overrides={hidden_size = 32, num_hidden_layers = 2, intermediate_size = 64, "
            "moe_intermediate_size = 16, block_position_embedding = true}",
            f"--data.train_path={json.dumps(str(tokens / 'train'))}",
            f"--data.val_path={json.dumps(str(tokens / 'validation'))}",
            "--data.batch_size=2", "--data.seq_len=48", "--train.steps=4", "--schedule.warmup_steps=1",
            "--train.objectives={clm = 1.0, glm = 1.0}", "--checkpoint.every=2",
            f"--log.run_dir={json.dumps(str(run_dir))}", "--log.progress=false", "--log.eval_batches=2",
            "--log.measure_peak=false"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["val_loss"] > 0 and summary["unigram_loss"] > 0
    assert (run_dir / "final" / "tokenizer.json").is_file() and (run_dir / "final" / "config.json").is_file()
    recs = read_metrics(run_dir / "metrics.jsonl")
    assert recs[-1]["event"] == "final"
    assert main(["train"] + argv[1:] + ["--resume", "auto", "--train.steps=5"]) == 0  # continues 4 -> 5
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r][-1] == 5
    assert main(["plot", str(run_dir)]) == 0
    for name in ("loss", "lr", "grad_norm", "expert_load"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 1000


def test_bad_override_is_rejected(capsys):
    assert main(["train", "--optim.lrr=1"]) == 2
    assert "optim.lrr" in capsys.readouterr().err


def test_shipped_train_configs_load():
    from glm5.core.config import load_config
    from glm5.train.config import TrainConfig
    for path in sorted((configs_dir() / "train").glob("*.toml")):
        cfg = load_config(TrainConfig, path)
        assert cfg.train.steps > 0 or cfg.train.mtp_init != "none", path  # 0 steps: a closed-form fit alone
