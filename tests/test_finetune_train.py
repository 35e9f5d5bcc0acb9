"""`glm5 finetune`: resumable LoRA SFT, the full-FT recipe (LR from the pretraining run, 8-bit AdamW vs
fp32 AdamW), gradual unfreezing, mixed-domain sampling, new domain tokens loading in transformers."""

import gzip
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from glm5.cli.finetune import main as finetune_main
from glm5.core.config import load_config
from glm5.core.resources import bundled
from glm5.data.shards import ShardWriter
from glm5.data.tokenizer import load_tokenizer
from glm5.finetune.config import FinetuneConfig
from glm5.finetune.domain import UnfreezeSchedule, add_domain_tokens
from glm5.finetune.trainer import FinetuneTrainer
from glm5.model.hf_adapter import save_pretrained
from glm5.train.config import OptimConfig
from glm5.train.optim import build_optimizer

from ._tiny import tiny_model

TOKENIZER = bundled("tokenizer-8k")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny base checkpoint with the bundled tokenizer, a 30-conversation train file, and the
    pretraining run's metrics.jsonl next to it (as `glm5 train` leaves RUN_DIR/final)."""
    root = tmp_path_factory.mktemp("ft")
    save_pretrained(tiny_model(seed=0, vocab_size=8192, num_hidden_layers=2), root / "run" / "final")
    load_tokenizer(TOKENIZER).save(root / "run" / "final")
    (root / "run" / "metrics.jsonl").write_text(json.dumps({"event": "config", "config": {"optim": {"lr": 4e-3}}}) + "\n")
    with gzip.open(bundled("sft/train.jsonl.gz"), "rt", encoding="utf-8") as f:
        (root / "train.jsonl").write_text("".join(f.readlines()[::45]))
    return root


def _args(base, run, steps, *extra):
    return ["--config", "configs/finetune/lora.toml", f"--model.name={base}/run/final",
            f"--data.train_path={base}/train.jsonl", "--data.batch_size=2", "--data.seq_len=96",
            f"--train.steps={steps}", f"--log.run_dir={run}", "--log.measure_peak=false", "--log.progress=false",
            "--log.eval_batches=1", "--checkpoint.every=0", *extra]


def test_lora_sft_resumes_exactly(base, tmp_path, capsys):
    assert finetune_main(_args(base, tmp_path / "a", 4)) == 0
    # the same run interrupted after 2 steps (checkpoint at exit), then resumed to 4
    assert finetune_main(_args(base, tmp_path / "b", 2)) == 0
    assert finetune_main(_args(base, tmp_path / "b", 4, "--resume", "auto")) == 0
    a = load_file(tmp_path / "a/final/adapter_model.safetensors")
    b = load_file(tmp_path / "b/final/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[next(k for k in a if "lora_B" in k)], torch.zeros(1))  # it trained
    ckpt = sorted((tmp_path / "b/checkpoints").iterdir())[-1] / "model"
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "config.json").exists()  # adapter only
    log = [json.loads(line) for line in open(tmp_path / "a/metrics.jsonl")]
    assert any("loss" in r for r in log) and log[-1]["event"] == "final"
    out = capsys.readouterr().out
    assert "trainable of" in out and '"method": "lora"' in out


def test_bad_configs_exit_2(base, tmp_path, capsys):
    assert finetune_main(_args(base, tmp_path, 1, "--method", "prefix")) == 2
    assert "data.pack = false" in capsys.readouterr().err
    assert finetune_main(_args(base, tmp_path, 1, "--lora.targets=[\"q_proj\"]")) == 2
    assert "['q_proj'] match no module" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{oops\n')
    assert finetune_main(_args(base, tmp_path, 1, f"--data.train_path={bad}")) == 2
    assert "bad.jsonl:2:" in capsys.readouterr().err


def test_full_recipe_lr_is_pretraining_lr_over_10(base):
    cfg = load_config(FinetuneConfig, "configs/finetune/full.toml", [f"--model.name={base}/run/final"])
    assert cfg.resolved_lr() == pytest.approx(4e-4)
    assert cfg.optim.name == "adamw8bit" and cfg.precision.activation_checkpointing


def test_8bit_adamw_tracks_fp32_adamw_with_a_quarter_of_the_state():
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    models = [tiny_model(seed=1).train() for _ in range(2)]
    opts = [build_optimizer(m, OptimConfig(name=n, lr=3e-3, weight_decay=0.0)) for m, n in
            zip(models, ("adamw8bit", "adamw"))]
    losses = [[], []]
    x = torch.randint(2, 512, (4, 24), generator=torch.Generator().manual_seed(0))  # memorise one batch
    for step in range(12):
        for i, (m, o) in enumerate(zip(models, opts)):
            logits = m(x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            o.step()
            o.zero_grad()
            losses[i].append(float(loss.detach()))
    q8, f32 = np.array(losses[0]), np.array(losses[1])
    assert f32[-1] < f32[0] - 0.1 and q8[-1] < q8[0] - 0.1  # both learn
    assert np.abs(q8 - f32).max() < 0.02 * f32[0]  # and the same way

    def state_bytes(opt):  # distinct storages: bnb shares one 256-entry code map between parameters
        seen = {t.untyped_storage().data_ptr(): t for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.numel() > 1}
        return sum(t.numel() * t.element_size() for t in seen.values())

    trained = list(opts[0].state)  # (the indexer gets no gradient at this length: no state)
    big = sum(p.numel() for p in trained if p.numel() >= 4096)  # bnb quantises these
    small = sum(p.numel() for p in trained if p.numel() < 4096)
    assert state_bytes(opts[1]) == 8 * (big + small)
    assert state_bytes(opts[0]) < 2.1 * big + 8 * small  # 2 bytes per quantised parameter (+ block scales)


def test_unfreeze_schedule_top_down():
    model = tiny_model(seed=2, num_hidden_layers=3)
    sched = UnfreezeSchedule(model, every=2)
    assert sched.groups_at(0) == 1 and sched.groups_at(3) == 2 and sched.groups_at(100) == 5
    at0 = sched.trainable_names(0)
    assert set(at0) == {"lm_head.weight", "model.norm.weight"}
    at2 = set(sched.trainable_names(2)) - set(at0)
    assert at2 and all(n.startswith("model.layers.2.") for n in at2)
    assert "model.embed_tokens.weight" in sched.trainable_names(8) and "model.embed_tokens.weight" not in \
        sched.trainable_names(7)
    sched.apply(2)
    x = torch.randint(2, 512, (2, 8))
    model(x).logits.sum().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n in set(at0) | at2 if ".indexer." not in n}  # (top-k: no indexer gradient)


def test_domain_adaptation_run_with_general_replay(base, tmp_path):
    shards = tmp_path / "general"
    tok = load_tokenizer(base / "run" / "final")
    w = ShardWriter(shards, tok.vocab_size, {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id})
    for k in range(40):
        w.add(np.array(tok.encode(f"General text number {k}: the quick brown fox.")), source="s", lang="en",
              domain="general")
    w.close()
    args = _args(base, tmp_path / "run", 6, "--method", "full", "--domain.unfreeze_every=2",
                 f"--domain.general_path={shards}", "--domain.general_ratio=0.5",
                 '--domain.new_tokens=["<|manpage|>", "<|pydoc|>"]', "--log.every=1")
    assert finetune_main(args) == 0
    log = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in log if "loss" in r and "unfrozen_groups" in r]
    assert [r["unfrozen_groups"] for r in steps] == [1, 1, 2, 2, 3, 3]
    assert 0 < steps[-1]["general_batches"] < 6
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["vocab_size"] == 8194


def test_new_domain_tokens_load_in_transformers(base, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(seed=3, vocab_size=8192)
    tok = load_tokenizer(TOKENIZER)
    mean_embed = model.model.embed_tokens.weight.mean(0)
    new_tok = add_domain_tokens(model, tok, ["<|manpage|>", "<|pydoc|>", "<|manpage|>"])
    ids = [new_tok.token_to_id("<|manpage|>"), new_tok.token_to_id("<|pydoc|>")]
    assert ids == [8192, 8193] and tok.token_to_id("<|manpage|>") is None  # the old tokenizer is untouched
    assert torch.allclose(model.model.embed_tokens.weight[8193], mean_embed)
    save_pretrained(model, tmp_path)
    new_tok.save(tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "see <|manpage|> ls"
    assert hf_tok.encode(text, add_special_tokens=False) == new_tok.encode(text)
    assert ids[0] in new_tok.encode(text)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    x = torch.tensor([new_tok.encode(text)])
    with torch.no_grad():
        assert (hf(x).logits - model.eval()(x).logits).abs().max() <= 1e-4


def test_trainer_reports_trainable_fraction(base):
    cfg = load_config(FinetuneConfig, "configs/finetune/lora.toml",
                      [f"--model.name={base}/run/final", f"--data.train_path={base}/train.jsonl", "--data.val_path=",
                       "--lora.targets=[\"attn\"]", "--lora.r=2"])
    t = FinetuneTrainer(cfg)
    rep = t.raw_model.trainable_report()
    assert 0 < rep["trainable_fraction"] < 0.02
    assert all("lora_" in n for n, p in t.raw_model.named_parameters() if p.requires_grad)
