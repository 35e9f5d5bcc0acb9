"""The training loop on a very small model and synthetic bigram data: learning, objectives, MTP, the
non-finite guard, exact resume, checkpoint rotation, the final HF-format model."""

import json
import math

import pytest
import torch

from glm5.core.config import from_dict
from glm5.model.hf_adapter import from_pretrained
from glm5.train.checkpoint import resolve_resume, step_dirs
from glm5.train.config import TrainConfig
from glm5.train.data import SyntheticData
from glm5.train.trainer import Trainer

MODEL = {"vocab_size": 96, "hidden_size": 48, "num_hidden_layers": 2, "intermediate_size": 96,
         "moe_intermediate_size": 24, "block_position_embedding": True, "pad_token_id": 0, "eos_token_id": [1]}


def make(run_dir, steps=6, data=None, **sections):
    d = {"model": {"name": "tiny", "overrides": dict(MODEL)},
         "optim": {"lr": 3e-3}, "schedule": {"warmup_steps": 2},
         "train": {"steps": steps},
         "log": {"run_dir": str(run_dir), "progress": False, "eval_batches": 1, "measure_peak": False}}
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    cfg = from_dict(TrainConfig, d)
    return Trainer(cfg, data=data or SyntheticData(96, 4, 24, seed=1))


def test_30_steps_lower_the_loss_and_report_mtp(tmp_path):
    t = make(tmp_path, steps=30)
    summary = t.fit()
    losses = [h["loss"] for h in t.history]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    assert all("mtp_loss" in h and h["mtp_loss"] > 0 for h in t.history)
    assert summary["val_loss"] < summary["unigram_loss"]
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["event"] == "config" and recs[-1]["event"] == "final"
    assert any("expert_load" in r for r in recs)


@pytest.mark.parametrize("objectives", [{"clm": 1.0}, {"glm": 1.0}, {"clm": 1.0, "glm": 1.0}])
def test_each_objective_runs(tmp_path, objectives):
    t = make(tmp_path, steps=3, train={"objectives": objectives, "grad_accum": 2, "mtp_weight": 0.3})
    t.fit()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in t.history)
    drawn = {k for h in t.history for k, n in h["objectives"].items() if n}
    assert drawn == {k for k, w in objectives.items() if w}
    assert all(("mtp_loss" in h) == (h["objectives"].get("clm", 0) > 0) for h in t.history)


def test_no_mtp_when_weight_zero(tmp_path):
    t = make(tmp_path, steps=2, train={"mtp_weight": 0.0})
    t.fit()
    assert all("mtp_loss" not in h for h in t.history)


def test_nonfinite_step_is_skipped_with_unchanged_weights(tmp_path):
    t = make(tmp_path, steps=5, stability={"max_bad_steps": 3, "nan_lr_factor": 0.5})
    w = t.raw_model.lm_head.weight
    w.register_hook(lambda g: g * float("inf") if t.step == 2 else g)
    for _ in range(2):
        t.train_step()
    before = {n: p.detach().clone() for n, p in t.raw_model.named_parameters()}
    opt_state = {k: v.clone() for k, v in t.optimizer.state[w].items()}
    m = t.train_step()
    assert m.get("skipped") and t.guard.bad_steps == 1 and t.guard.lr_scale == 0.5
    assert "lm_head.weight" in t.guard.last_bad
    for n, p in t.raw_model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert all(torch.equal(t.optimizer.state[w][k], v) for k, v in opt_state.items())
    m = t.train_step()
    assert not m.get("skipped") and not torch.equal(w, before["lm_head.weight"])


def test_resume_reproduces_uninterrupted_losses(tmp_path):
    sections = dict(train={"steps": 7, "objectives": {"clm": 1.0, "glm": 0.5}, "grad_accum": 2},
                    optim={"name": "muon"}, checkpoint={"resume": "auto"})
    full = make(tmp_path / "a", **sections)
    full.model.config.expert_dropout = 0.1  # exercises the torch RNG across the resume
    full.fit()
    part = make(tmp_path / "b", **sections)
    part.model.config.expert_dropout = 0.1
    for _ in range(3):
        part.train_step()
    part.save()
    resumed = make(tmp_path / "b", **sections)
    resumed.model.config.expert_dropout = 0.1
    assert resumed.step == 3
    resumed.fit()
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history][3:]


def test_checkpoint_rotation_and_final_model(tmp_path):
    t = make(tmp_path, steps=4, checkpoint={"every": 1, "keep_last": 2})
    t.fit()
    dirs = step_dirs(tmp_path / "checkpoints")
    assert [d.name for d in dirs] == ["step_00000003", "step_00000004"]
    (tmp_path / "checkpoints" / ".tmp-step_00000009-x").mkdir()  # a write killed half-way
    assert resolve_resume("auto", tmp_path / "checkpoints") == dirs[-1]
    loaded = from_pretrained(tmp_path / "final", dtype=torch.float32)
    ids = torch.randint(0, 96, (1, 8))
    t.raw_model.eval()
    torch.testing.assert_close(loaded(ids).logits, t.raw_model(ids).logits)
    # continued pretraining: model.name = a checkpoint directory starts from its weights
    cont = make(tmp_path / "cont", model={"name": str(tmp_path / "final"), "overrides": {}})
    for (n, p), q in zip(cont.raw_model.named_parameters(), t.raw_model.parameters()):
        assert torch.equal(p, q), n


def test_incompatible_objective_fails_early(tmp_path):
    with pytest.raises(ValueError, match="block_position_embedding"):
        make(tmp_path, model={"overrides": {**MODEL, "block_position_embedding": False}},
             train={"objectives": {"clm": 1.0, "glm": 0.5}})


def test_time_budget_drives_the_schedule(tmp_path):
    import time
    t = make(tmp_path, steps=10, schedule={"name": "linear", "warmup_steps": 0, "min_lr_ratio": 0.0})
    t.time_budget = (time.monotonic() - 50.0, 100.0)  # half the wall-time budget already spent
    assert t._set_lr() == pytest.approx(3e-3 * (1 - 5 / 9), rel=0.05)
    t.time_budget = None
    assert t._set_lr() == pytest.approx(3e-3)


def test_activation_checkpointing_gives_the_same_training(tmp_path):
    plain = make(tmp_path / "a", steps=2)
    ckpt = make(tmp_path / "b", steps=2, precision={"activation_checkpointing": True})
    assert ckpt.raw_model.gradient_checkpointing
    losses = [[plain.train_step()["loss"] for _ in range(2)], [ckpt.train_step()["loss"] for _ in range(2)]]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (n, p), q in zip(plain.raw_model.named_parameters(), ckpt.raw_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_bf16_autocast_step_runs(tmp_path):
    t = make(tmp_path, steps=1, precision={"dtype": "bf16"})
    m = t.train_step()
    assert t.autocast_dtype == torch.bfloat16 and math.isfinite(m["loss"])
    assert all(p.dtype == torch.float32 for p in t.raw_model.parameters())  # fp32 master weights


KILL_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_train_loop import make
make({run!r}, steps=100000, checkpoint={{"every": 1, "keep_last": 2}}).fit()
"""


@pytest.mark.slow
def test_kill_9_during_checkpointing_leaves_a_loadable_checkpoint(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), run=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 120
    while len(step_dirs(tmp_path / "checkpoints")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.37)  # land somewhere inside the next checkpoint write
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    latest = resolve_resume("auto", tmp_path / "checkpoints")
    assert latest is not None
    resumed = make(tmp_path, steps=100000, checkpoint={"resume": "auto"})
    assert resumed.step == int(latest.name.split("_")[1]) and resumed.step >= 2
    resumed.train_step()


def test_final_model_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    t = make(tmp_path, steps=2, model={"overrides": {**MODEL, "block_position_embedding": False}})
    t.fit()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (2, 10))
    t.raw_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, t.raw_model(ids).logits, rtol=1e-4, atol=1e-4)


def test_synthetic_data_ranks_split_the_global_batch():
    """Elastic order in the synthetic source: data rank r of W reads rows [rB, (r+1)B) of the batch one
    process reads with W*B rows, for training and validation, and the counter is global."""
    one = SyntheticData(96, 6, 8, seed=2)
    parts = [SyntheticData(96, 2, 8, seed=2, rank=r, world_size=3) for r in range(3)]
    for objective in ("clm", "glm", "clm"):
        ref = one.next_batch(objective)
        got = [p.next_batch(objective) for p in parts]
        assert all(torch.equal(torch.cat([g[k] for g in got]), ref[k]) for k in ref)
    assert all(p.state_dict() == one.state_dict() for p in parts)
    val = [p.val_batches(2) for p in parts]
    for k, ref in enumerate(one.val_batches(2)):
        assert torch.equal(torch.cat([v[k]["input_ids"] for v in val]), ref["input_ids"])
