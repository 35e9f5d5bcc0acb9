"""Training part of a model on a frozen rest (`train.trainable`), and the MTP layer's self-distillation target
(`train.mtp_target = "self"`): frozen parameters stay bit-identical, the trunk runs without autograd, the
`self` loss is the KL a reference computes by hand (fused and from logits), config errors name the key,
chat JSONL data rendered by the trainer, resume."""

import json

import pytest
import torch
import torch.nn.functional as F

from glm5.core.config import ConfigError, from_dict
from glm5.model.config import ModelConfig
from glm5.model.hf_adapter import save_pretrained
from glm5.model.model import GLM5ForCausalLM
from glm5.train.config import TrainConfig
from glm5.train.data import SyntheticData
from glm5.train.loss import linear_self_kl
from glm5.train.step import IGNORE, forward_micro, mtp_labels
from glm5.train.trainer import Trainer, trainable_names

MODEL = {"vocab_size": 96, "hidden_size": 48, "num_hidden_layers": 2, "intermediate_size": 96,
         "moe_intermediate_size": 24, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
         "pad_token_id": 0, "eos_token_id": [1]}


def config(run_dir, **sections) -> TrainConfig:
    d = {"model": {"name": "tiny", "overrides": dict(MODEL)}, "optim": {"lr": 3e-3},
         "schedule": {"warmup_steps": 1}, "train": {"steps": 4},
         "balance": {"bias_update_rate": 1e-2, "seq_aux_coef": 1e-3},
         "log": {"run_dir": str(run_dir), "progress": False, "eval_batches": 1, "measure_peak": False}}
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return from_dict(TrainConfig, d)


def make(run_dir, **sections) -> Trainer:
    return Trainer(config(run_dir, **sections), data=SyntheticData(96, 3, 16, seed=1))


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("target", ["self", "data"])
def test_trainable_mtp_changes_only_the_mtp_layer(tmp_path, target):
    t = make(tmp_path, train={"trainable": "mtp", "mtp_target": target, "mtp_weight": 1.0})
    mtp = set(trainable_names(t.raw_model, "mtp"))
    assert mtp and all(n.startswith("model.layers.2.") for n in mtp)
    in_optimizer = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in t.raw_model.named_parameters() if n in mtp}
    assert all(p.requires_grad == (n in mtp) for n, p in t.raw_model.named_parameters())
    before = state(t.raw_model)
    t.fit()
    after = state(t.raw_model)
    frozen_changed = [k for k in before if not k.startswith("model.layers.2.") and not torch.equal(before[k], after[k])]
    assert frozen_changed == []  # weights, the tied embedding / lm_head and the trunk's expert biases
    moved = {k for k in mtp if not torch.equal(before[k], after[k])}
    for key in ("eh_proj.weight", "self_attn.o_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        assert f"model.layers.2.{key}" in moved
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert not torch.equal(before[bias], after[bias])  # the MTP router still balances
    assert all(h["mtp_loss"] > 0 for h in t.history)
    assert all(("mtp_agree" in h) == (target == "self") for h in t.history)


def test_frozen_trunk_runs_without_autograd(tmp_path):
    t = make(tmp_path, train={"trainable": "mtp", "mtp_target": "self", "mtp_weight": 1.0})
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen.setdefault(name, torch.is_grad_enabled())
        return hook
    for name, layer in (("trunk", t.raw_model.model.layers[0]), ("mtp", t.raw_model.model.layers[2])):
        layer.self_attn.register_forward_hook(record(name))
    t.train_step()
    assert seen == {"trunk": False, "mtp": True}


def test_trainable_indexer_changes_only_the_indexers(tmp_path):
    t = make(tmp_path, train={"trainable": "indexer"})
    before = state(t.raw_model)
    t.fit()
    after = state(t.raw_model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".indexer." in k for k in changed)
    assert all(h["indexer_kl"] > 0 and "mtp_loss" not in h for h in t.history)


def _reference_self_kl(model, batch):
    """KL(softmax(main logits[t+1]) || softmax(MTP logits[t])) summed over the MTP positions, by hand."""
    out = model(batch["input_ids"], position_ids=batch.get("position_ids"), segment_ids=batch.get("segment_ids"),
                return_mtp=True)
    keep = mtp_labels(batch["labels"]) != IGNORE
    total, agree = torch.zeros(()), 0
    B, T = batch["input_ids"].shape
    for b in range(B):
        for t in range(T - 1):
            if keep[b, t]:
                logp = torch.log_softmax(out.logits[b, t + 1].detach(), -1)
                logq = torch.log_softmax(out.mtp_logits[b, t], -1)
                total = total + (logp.exp() * (logp - logq)).sum()
                p = logp
                agree += int(logq.argmax() == p.argmax())
    return total, agree


@pytest.mark.parametrize("trainable", ["mtp", "all"])
@pytest.mark.parametrize("fused", [True, False])
def test_self_target_equals_hand_computed_kl(tmp_path, trainable, fused):
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", **MODEL)).init_weights(seed=3)
    with torch.no_grad():  # sharper distributions than the init's near-uniform ones
        model.lm_head.weight.mul_(30)
    batch = SyntheticData(96, 2, 12, seed=4).next_batch("clm")
    batch["labels"][0, 5] = IGNORE  # a document end inside the row: no MTP term at t = 4 and t = 5
    ref, ref_agree = _reference_self_kl(model, batch)
    ref.backward()
    ref_grad = model.model.layers[2].eh_proj.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    if trainable == "mtp":
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("model.layers.2."))
    balance = config(tmp_path).balance
    res = forward_micro(model, batch, "clm", 1.0, balance, fused_ce=fused, trainable=trainable, mtp_target="self")
    torch.testing.assert_close(res.mtp_sum, ref, rtol=1e-4, atol=1e-5)
    assert res.mtp_agree == ref_agree
    assert res.mtp_tokens == int((mtp_labels(batch["labels"]) != IGNORE).sum())
    res.mtp_sum.backward()
    scale = float(ref_grad.abs().max())
    torch.testing.assert_close(model.model.layers[2].eh_proj.weight.grad, ref_grad, rtol=1e-3, atol=1e-4 * scale)
    if trainable == "mtp":  # the frozen pass's LM loss is the trunk's own CE
        out = model(batch["input_ids"])
        lm = F.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum")
        torch.testing.assert_close(res.lm_sum, lm.detach(), rtol=1e-5, atol=1e-4)


def test_linear_self_kl_gradients_match_autograd():
    torch.manual_seed(0)
    N, H, V = 37, 16, 50
    z = torch.randn(N, H, requires_grad=True)
    h = torch.randn(N, H)
    w = (torch.randn(V, H) * 2).requires_grad_(True)
    valid = torch.rand(N) > 0.3
    labels = torch.randint(0, V, (N,))
    labels[::4] = IGNORE
    kl, ce, agree = linear_self_kl(z, h, w, valid, labels, chunk=8)
    (kl * 1.7).backward()
    gz, gw = z.grad.clone(), w.grad.clone()
    z.grad = w.grad = None
    logp = torch.log_softmax(h @ w.detach().t(), -1)
    logq = torch.log_softmax(z @ w.t(), -1)
    ref = ((logp.exp() * (logp - logq)).sum(-1) * valid).sum()
    (ref * 1.7).backward()
    torch.testing.assert_close(kl, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gz, z.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)
    ref_ce = F.cross_entropy(logp, labels, ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(ce, ref_ce, rtol=1e-5, atol=1e-5)
    assert int(agree) == int(((logq.argmax(-1) == logp.argmax(-1)) & valid).sum())


@pytest.mark.parametrize("train, key", [
    ({"trainable": "everything"}, "train.trainable"),
    ({"mtp_target": "teacher"}, "train.mtp_target"),
    ({"trainable": "mtp", "mtp_weight": 0.0}, "train.trainable"),
    ({"mtp_target": "self", "mtp_weight": 0.0}, "train.mtp_target"),
    ({"trainable": "indexer", "mtp_target": "self"}, "train.mtp_target"),
    ({"trainable": "mtp", "objectives": {"clm": 1.0, "glm": 1.0}}, "train.objectives"),
])
def test_config_errors_name_the_key(tmp_path, train, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(tmp_path, train=train)


def test_model_without_the_trained_part_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"train\.trainable = 'mtp'.*no MTP"):
        make(tmp_path, model={"overrides": {**MODEL, "num_nextn_predict_layers": 0}}, train={"trainable": "mtp"})
    with pytest.raises(ValueError, match=r"train\.mtp_target = 'self'.*no MTP"):
        make(tmp_path, model={"overrides": {**MODEL, "num_nextn_predict_layers": 0}}, train={"mtp_target": "self"})


def test_frozen_run_resumes_exactly(tmp_path):
    sections = dict(train={"steps": 5, "trainable": "mtp", "mtp_target": "self", "mtp_weight": 1.0},
                    checkpoint={"resume": "auto"})
    full = make(tmp_path / "a", **sections)
    full.fit()
    part = make(tmp_path / "b", **sections)
    for _ in range(2):
        part.train_step()
    ckpt = part.save()
    from glm5.core.io import LazyTensors
    assert sorted(p.name for p in (ckpt / "model").iterdir()) == ["trained.safetensors"]  # only what trains
    saved = set(LazyTensors([ckpt / "model" / "trained.safetensors"]).where)
    assert saved and all(k.startswith("model.layers.2.") for k in saved)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in saved
    resumed = make(tmp_path / "b", **sections)
    assert resumed.step == 2
    resumed.fit()
    assert [h["mtp_loss"] for h in resumed.history] == [h["mtp_loss"] for h in full.history][2:]


def test_chat_jsonl_is_rendered_with_the_models_tokenizer(tmp_path):
    from glm5.data.tokenizer import load_tokenizer
    from glm5.train.chat_data import ChatData
    tok = load_tokenizer("bundled:tokenizer-8k")
    ckpt = tmp_path / "ckpt"
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", hidden_size=32, num_hidden_layers=1,
                                                    intermediate_size=64, moe_intermediate_size=16,
                                                    first_k_dense_replace=1)).init_weights(seed=0)
    save_pretrained(model, ckpt)
    tok.save(ckpt)
    chat = tmp_path / "chat.jsonl"
    convs = [{"messages": [{"role": "user", "content": f"question {i}"},
                           {"role": "assistant", "content": "answer " * (i + 1)}]} for i in range(9)]
    chat.write_text("".join(json.dumps(c) + "\n" for c in convs))
    sections = dict(model={"name": str(ckpt), "overrides": {}},
                    data={"train_path": str(chat), "val_path": str(chat), "batch_size": 2, "seq_len": 40})
    cfg = config(tmp_path / "run", **sections)
    one = ChatData(cfg)
    tok = one.tokenizer
    first = tok.apply_chat_template(convs[0]["messages"], add_generation_prompt=False)
    prompt = tok.apply_chat_template(convs[0]["messages"][:1], add_generation_prompt=True)
    ids, mask = one.docs[0]
    assert ids.tolist() == first and mask.tolist() == [False] * len(prompt) + [True] * (len(first) - len(prompt))
    assert "answer" in tok.decode(ids[mask].tolist()) and "question" not in tok.decode(ids[mask].tolist())
    b = one.next_batch()
    assert set(b) == {"input_ids", "labels", "position_ids", "segment_ids"} and b["input_ids"].shape == (2, 40)
    targets = b["labels"][b["labels"] != IGNORE]
    assert len(targets) and "question" not in tok.decode(targets.tolist())  # the assistant turns only
    # elastic: two data ranks read the one-rank rows; a resumed source continues exactly
    ranks = [ChatData(cfg, rank=r, world_size=2) for r in range(2)]
    again = ChatData(cfg)
    for _ in range(4):  # past an epoch boundary
        want = torch.cat([again.next_batch()["input_ids"] for _ in range(2)])
        got = torch.cat([r.next_batch()["input_ids"] for r in ranks])
        assert torch.equal(want, got)
    resumed = ChatData(cfg)
    resumed.load_state_dict(again.state_dict())
    assert torch.equal(resumed.next_batch()["input_ids"], again.next_batch()["input_ids"])
    # the trainer picks the chat source from the path, and `final/` carries the source's tokenizer files
    t = Trainer(from_dict(TrainConfig, {**json.loads(json.dumps({
        "model": {"name": str(ckpt)}, "data": sections["data"], "train": {"steps": 2, "trainable": "mtp",
                                                                              "mtp_target": "self", "mtp_weight": 1.0},
        "log": {"run_dir": str(tmp_path / "run"), "progress": False, "eval_batches": 1, "measure_peak": False}}))}))
    summary = t.fit()
    assert "val_mtp_agree" in summary and summary["val_mtp_loss"] > 0
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "run" / "final" / name).read_bytes() == (ckpt / name).read_bytes()


def test_lstsq_warm_start_solves_the_least_squares_problem():
    from glm5.train.mtp_init import fit_mtp_lstsq
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", **MODEL)).init_weights(seed=5)
    data = SyntheticData(96, 4, 16, seed=6)
    batches = [data.next_batch("clm") for _ in range(3)]
    balance = config("unused").balance

    def self_kl() -> float:
        with torch.no_grad():
            return sum(float(forward_micro(model, b, "clm", 1.0, balance, trainable="mtp", mtp_target="self").mtp_sum)
                       for b in batches)

    def unit(v):
        return v / v.pow(2).mean(-1, keepdim=True).add(model.config.rms_norm_eps).sqrt()
    before = self_kl()
    info = fit_mtp_lstsq(model, batches, ridge=1e-9)
    layer = model.model.layers[2]
    # eh_proj is the least-squares map [rms-normalised e_{t+1}; rms-normalised h_t] -> h_{t+1}
    xs, ys = [], []
    with torch.no_grad():
        for b in batches:
            h = model(b["input_ids"]).hidden_states
            e = model.model.embed_tokens(b["input_ids"][:, 1:])
            keep = (mtp_labels(b["labels"]) != IGNORE)[:, :-1]
            xs.append(torch.cat([unit(e), unit(h[:, :-1])], -1)[keep])
            ys.append(h[:, 1:][keep])
    x, y = torch.cat(xs).double(), torch.cat(ys).double()
    ref = torch.linalg.lstsq(x, y).solution.t().float()
    assert info["positions"] == x.shape[0]
    torch.testing.assert_close(layer.eh_proj.weight, ref, rtol=1e-3, atol=1e-4)
    assert torch.equal(layer.mlp.experts.down_proj, torch.zeros_like(layer.mlp.experts.down_proj))
    assert layer.self_attn.o_proj.weight.abs().sum() > 0 and layer.mlp.shared_experts.down_proj.weight.abs().sum() > 0
    assert self_kl() < 0.5 * before  # the self-distillation KL the fit stands for


def test_trainer_lstsq_warm_start_keeps_the_trunk(tmp_path):
    t = make(tmp_path, train={"trainable": "mtp", "mtp_target": "self", "mtp_weight": 1.0, "mtp_init": "lstsq",
                              "mtp_init_batches": 2, "steps": 2})
    before = state(t.raw_model)
    t.fit()
    after = state(t.raw_model)
    assert [k for k in before if not k.startswith("model.layers.2.") and not torch.equal(before[k], after[k])] == []
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    init = [r for r in recs if r.get("event") == "mtp_init"]
    assert len(init) == 1 and init[0]["positions"] == 2 * 3 * 15 and "init_val_mtp_agree" in init[0]
    resumed = make(tmp_path, train={"trainable": "mtp", "mtp_target": "self", "mtp_weight": 1.0, "mtp_init": "lstsq",
                                    "mtp_init_batches": 2, "steps": 3}, checkpoint={"resume": "auto"})
    resumed.fit()  # resumed past step 0: no second fit
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("event") == "mtp_init" for r in recs) == 1


def _tiny_checkpoint(path):
    """A tiny model with an MTP layer, saved with the bundled tokenizer (a GLM chat template)."""
    from glm5.data.tokenizer import load_tokenizer
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                                    moe_intermediate_size=16, first_k_dense_replace=1,
                                                    num_attention_heads=2, num_key_value_heads=2)).init_weights(seed=0)
    save_pretrained(model, path)
    load_tokenizer("bundled:tokenizer-8k").save(path)
    return path


def test_recipe_writes_a_checkpoint_with_the_inputs_files(tmp_path):
    from glm5.model.hf_adapter import from_pretrained
    from glm5.train.mtp_recipe import train_mtp
    src = _tiny_checkpoint(tmp_path / "src")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                      {"role": "assistant", "content": f"answer {i} " * 5}]}) + "\n"
                            for i in range(12)))
    lines = []
    out = train_mtp(src, tmp_path / "out", minutes=0.5, log=lines.append,
                    overrides=[f"--data.train_path={chat}", f"--data.val_path={chat}", "--data.seq_len=64",
                               "--train.steps=3", "--train.mtp_init_batches=0", "--log.measure_peak=false"])
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    before, after = from_pretrained(src), from_pretrained(out)
    changed = {k for k, v in before.state_dict().items() if not torch.equal(v, after.state_dict()[k])}
    assert changed and all(k.startswith("model.layers.1.") for k in changed)  # the MTP layer only
    assert any("closed-form fit done" in line for line in lines) and any(line.startswith("mtp step") for line in lines)
    assert (tmp_path / "out.run" / "metrics.jsonl").is_file()  # the resumable run next to it


def test_self_answers_are_the_models_greedy_output(tmp_path):
    from glm5.distill.mtp import self_answers
    from glm5.infer.llm import LLM
    from glm5.infer.sampling import SamplingParams
    src = _tiny_checkpoint(tmp_path / "src")
    path = self_answers(src, tmp_path / "answers.jsonl", prompts=3, max_tokens=6, log=lambda s: None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    llm = LLM(str(src), dtype="float32")
    prompt = llm.tokenizer.apply_chat_template(rows[0]["messages"][:-1], add_generation_prompt=True)
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert rows[0]["messages"][-1]["content"] == llm.tokenizer.decode(again.token_ids, skip_special_tokens=True)


def test_fit_alone_with_zero_steps(tmp_path):
    t = make(tmp_path, train={"trainable": "mtp", "mtp_target": "self", "mtp_weight": 1.0, "mtp_init": "lstsq",
                              "mtp_init_batches": 2, "steps": 0})
    before = state(t.raw_model)
    summary = t.fit()
    assert t.history == [] and "val_mtp_agree" in summary
    assert not torch.equal(before["model.layers.2.eh_proj.weight"], t.raw_model.state_dict()["model.layers.2.eh_proj.weight"])
    assert (tmp_path / "final" / "config.json").is_file()
    with pytest.raises(ConfigError, match=r"train\.steps"):
        config(tmp_path, train={"steps": 0})
