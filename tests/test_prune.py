"""`glm5 prune` (glm5/distill/prune.py): importance-guided depth / width / expert pruning of a GLM-5 checkpoint.

The teacher is a tiny random Llama converted exactly into GLM-5 (upcycled experts, as the embedded model).
References written here, apart from the product: a plain loop for the neuron importances; the teacher with
the pruned neurons zeroed (masking = slicing); transformers' GlmMoeDsa with a layer deleted from its
ModuleList (depth); transformers loading every pruned checkpoint (its logits = glm5's).
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import glm5
from glm5.cli.main import main
from glm5.convert.llama import convert_llama
from glm5.distill.prune import PruneConfig, PruneError, prune, validate
from glm5.model.config import ModelConfig

transformers = pytest.importorskip("transformers")

from .test_convert_llama import OPTS, VOCAB, _source  # noqa: E402

CALIB = dict(calib_tokens=256, layer_calib_tokens=128, seq_len=32)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    d = tmp_path_factory.mktemp("prune")
    _source(d / "llama", tie_word_embeddings=True, intermediate_size=128)
    convert_llama(d / "llama", d / "teacher", OPTS)
    corpus = d / "calib.jsonl"
    g = torch.Generator().manual_seed(3)
    lines = [" ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB, (60,), generator=g)) for _ in range(40)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return d / "teacher", str(corpus)


def _ids(seed=1, T=24):
    return torch.randint(3, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


def _logits(path, ids):
    with torch.no_grad():
        return glm5.from_pretrained(path)(ids).logits


def _hf_matches(path, ids, want):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        got = hf.eval()(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 1e-4


def test_removing_redundancy_is_exact(teacher, tmp_path):
    """Upcycled copies split into 2 experts, 1 indexer head (index_topk >= T), 1 non-rotary dim (the
    converted K-nope rows are zero): fewer parameters, the same logits, in glm5 and transformers."""
    src, corpus = teacher
    spec = PruneConfig(n_routed_experts=2, index_n_heads=1, qk_nope_head_dim=1, calibration=corpus, **CALIB)
    rec = prune(src, tmp_path / "s", spec, log=None)
    assert rec["parameters_after"] < 0.75 * rec["parameters_before"]
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["routed_scaling_factor"]) == (2, 2, 2.0)
    assert cfg["index_n_heads"] == 1 and cfg["qk_nope_head_dim"] == 1 and cfg["glm5_pruning"]["split_copies"]
    assert (tmp_path / "s" / "tokenizer.json").is_file()
    ids = _ids()
    want, got = _logits(src, ids), _logits(tmp_path / "s", ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    _hf_matches(tmp_path / "s", ids, got)


def _reference_importance(model, rows):
    """Per SwiGLU (dense MLP, shared expert, routed copy 0): mean |silu(g x) * (u x)| x ||down column||,
    by a plain per-token loop over the layer inputs captured from transformers' model."""
    hf_inputs = {}
    hooks = [layer.post_attention_layernorm.register_forward_hook(
        lambda m, a, o, i=i: hf_inputs.setdefault(i, []).append(o.reshape(-1, o.shape[-1])))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        for r in rows:
            model(input_ids=r[None, :-1])
    for h in hooks:
        h.remove()
    out = {}
    for i, layer in enumerate(model.model.layers):
        x = torch.cat(hf_inputs[i])
        mlp = layer.mlp
        sw = mlp if hasattr(mlp, "gate_proj") else mlp.shared_experts
        mods = {"mlp" if sw is mlp else "shared": (sw.gate_proj.weight, sw.up_proj.weight, sw.down_proj.weight)}
        for key, (g, u, d) in mods.items():
            score = torch.zeros(g.shape[0])
            for t in range(x.shape[0]):
                score += (F.silu(g @ x[t]) * (u @ x[t])).abs()
            out[f"{i}.{key}"] = score * d.norm(dim=0)
    return out


def test_width_pruning_keeps_the_most_important_neurons_and_equals_masking(teacher, tmp_path):
    src, corpus = teacher
    spec = PruneConfig(intermediate_size=40, shared_intermediate_size=24, moe_intermediate_size=12,
                       n_routed_experts=2, calibration=corpus, **CALIB)
    rec = prune(src, tmp_path / "s", spec, log=None)
    kept = json.loads((tmp_path / "s" / "pruning.json").read_text())["neurons_kept"]
    from glm5.distill.prune import calibration_rows
    rows = calibration_rows(src, spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=torch.float32)
    ref = _reference_importance(hf.eval(), rows)
    assert kept["0.mlp"] == ref["0.mlp"].topk(40).indices.sort().values.tolist()
    assert kept["1.shared"] == ref["1.shared"].topk(24).indices.sort().values.tolist()
    # masking the teacher's dropped neurons (zero down columns) = the pruned student
    masked = copy.deepcopy(glm5.from_pretrained(src))
    with torch.no_grad():
        for i, layer in enumerate(masked.model.layers):
            mlp = layer.mlp
            if hasattr(mlp, "gate_proj"):
                drop = sorted(set(range(mlp.down_proj.weight.shape[1])) - set(kept[f"{i}.mlp"]))
                mlp.down_proj.weight[:, drop] = 0
                continue
            drop = sorted(set(range(mlp.shared_experts.down_proj.weight.shape[1])) - set(kept[f"{i}.shared"]))
            mlp.shared_experts.down_proj.weight[:, drop] = 0
            keep_r = sum(kept[f"{i}.experts"], [])  # one pruned copy, split in 2 experts of 12 neurons
            assert len(keep_r) == 24 == len(set(keep_r))
            assert keep_r == sorted(keep_r) and kept[f"{i}.experts"][0] == keep_r[:12]
            drop_r = sorted(set(range(mlp.experts.down_proj.shape[2])) - set(keep_r))
            mlp.experts.down_proj[:, :, drop_r] = 0
        ids = _ids()
        want = masked(ids).logits
    got = _logits(tmp_path / "s", ids)
    assert rec["parameters_after"] < rec["parameters_before"]
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    _hf_matches(tmp_path / "s", ids, got)


@pytest.mark.parametrize("metric", ["loss", "cosine"])
def test_depth_pruning_drops_the_least_important_layer(teacher, tmp_path, metric):
    src, corpus = teacher
    spec = PruneConfig(num_hidden_layers=2, layer_metric=metric, calibration=corpus, **CALIB)
    rec = prune(src, tmp_path / "s", spec, log=None)
    scores = rec["layer_scores"]
    dropped = min(range(3), key=lambda i: scores[i])
    assert rec["layers_kept"] == [i for i in range(3) if i != dropped]
    # reference: transformers' teacher with that layer deleted from its ModuleList
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=torch.float32)
    del hf.model.layers[dropped]
    hf.config.num_hidden_layers = 2
    ids = _ids()
    with torch.no_grad():
        want = hf.eval()(input_ids=ids, use_cache=False).logits
    got = _logits(tmp_path / "s", ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    if metric == "loss":  # the recorded score is the calibration loss without the layer minus with it
        from glm5.distill.prune import calibration_rows
        sub = calibration_rows(src, spec)[: spec.layer_calib_tokens // spec.seq_len]
        with torch.no_grad():
            full = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager",
                                                                     dtype=torch.float32).eval()
            base = F.cross_entropy(full(input_ids=sub[:, :-1]).logits.flatten(0, 1), sub[:, 1:].flatten())
            drop = F.cross_entropy(hf(input_ids=sub[:, :-1], use_cache=False).logits.flatten(0, 1),
                                   sub[:, 1:].flatten())
        assert abs(scores[dropped] - (drop - base).item()) < 1e-3


def _reference_refit(src, student, rows):
    """Per main layer, numpy's least squares of the teacher's MLP outputs on the student's down-projection
    inputs, both computed with transformers' models (hooks on the teacher's MLP; the student's gate/up
    rows read from its checkpoint), the routing weights by the config's formula: [H, F] per layer."""
    import numpy as np
    t = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=torch.float32)
    s = transformers.AutoModelForCausalLM.from_pretrained(student, attn_implementation="eager", dtype=torch.float32)
    io = {}
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o, i=i: io.setdefault(i, []).append(
        (a[0].reshape(-1, a[0].shape[-1]), o.reshape(-1, o.shape[-1])))) for i, layer in enumerate(t.model.layers)]
    with torch.no_grad():
        t.eval()(input_ids=rows[:, :-1], use_cache=False)
    for h in hooks:
        h.remove()
    cfg, out = s.config, {}
    for i, layer in enumerate(s.model.layers):
        x = torch.cat([a for a, _ in io[i]]).double().detach()
        y = torch.cat([b for _, b in io[i]]).double().detach()

        def act(sw, x=x):
            return F.silu(x @ sw.gate_proj.weight.double().T) * (x @ sw.up_proj.weight.double().T)
        mlp = layer.mlp
        if hasattr(mlp, "gate_proj"):
            feats = act(mlp)
        else:  # every routed part is selected (split copies): weight = normalised sigmoid score x scaling
            scores = torch.sigmoid(x @ mlp.gate.weight.double().T)  # [N, E]
            assert cfg.num_experts_per_tok == scores.shape[1]
            w = scores / scores.sum(-1, keepdim=True) if cfg.norm_topk_prob else scores
            w = w * cfg.routed_scaling_factor
            gu, inter = mlp.experts.gate_up_proj.double(), mlp.experts.down_proj.shape[-1]
            routed = [F.silu(x @ gu[e, :inter].T) * (x @ gu[e, inter:].T) * w[:, e:e + 1]
                      for e in range(scores.shape[1])]
            feats = torch.cat([act(mlp.shared_experts), *routed], 1)
        out[i] = torch.from_numpy(np.linalg.lstsq(feats.detach().numpy(), y.numpy(), rcond=None)[0].T)
    return out


def test_reconstruct_is_least_squares_on_the_teachers_mlp_outputs(teacher, tmp_path):
    """`reconstruct` refits every main layer's down-projections (dense; shared + routed parts jointly) to
    numpy's least-squares solution on transformers' teacher MLP inputs/outputs, lowers the MLP output error,
    and transformers still computes the student's logits."""
    src, corpus = teacher
    spec = PruneConfig(intermediate_size=40, shared_intermediate_size=24, moe_intermediate_size=12,
                       n_routed_experts=2, calibration=corpus, reconstruct=True, reconstruct_tokens=512,
                       reconstruct_ridge=1e-12, **CALIB)
    rec = prune(src, tmp_path / "s", spec, log=None)
    r = rec["reconstruct"]
    assert r["tokens"] >= 512 and r["mlp_error_after"] < 0.9 * r["mlp_error_before"]
    from glm5.distill.prune import calibration_rows
    ref = _reference_refit(src, tmp_path / "s", calibration_rows(src, spec, spec.reconstruct_tokens))
    got = glm5.from_pretrained(tmp_path / "s")
    for i, layer in enumerate(got.model.main_layers):
        mlp = layer.mlp
        w = (mlp.down_proj.weight if hasattr(mlp, "down_proj") else
             torch.cat([mlp.shared_experts.down_proj.weight, *mlp.experts.down_proj.unbind(0)], 1))
        assert (w.double() - ref[i]).abs().max().item() <= 1e-3 * ref[i].abs().max().item(), i
    ids = _ids()
    _hf_matches(tmp_path / "s", ids, _logits(tmp_path / "s", ids))


def test_reconstruct_keeps_an_exact_prune_exact(teacher, tmp_path):
    """Nothing lossy removed (the copies split, one indexer head): the teacher's outputs are reachable, so
    the refit finds the teacher's own down-projections and the logits stay the teacher's."""
    src, corpus = teacher
    spec = PruneConfig(n_routed_experts=2, index_n_heads=1, calibration=corpus, reconstruct=True,
                       reconstruct_tokens=512, reconstruct_ridge=1e-12, **CALIB)
    rec = prune(src, tmp_path / "s", spec, log=None)
    assert rec["reconstruct"]["mlp_error_before"] < 1e-9 and rec["reconstruct"]["mlp_error_after"] < 1e-9
    ids = _ids()
    want, got = _logits(src, ids), _logits(tmp_path / "s", ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


BAD = [
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(num_hidden_layers=9), "num_hidden_layers"),
    (dict(n_routed_experts=0), "n_routed_experts"),
    (dict(n_routed_experts=1), "n_routed_experts"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(index_n_heads=10), "index_n_heads"),
    (dict(moe_intermediate_size=7), "moe_intermediate_size"),  # 64 shared neurons: not a multiple of 7
    (dict(moe_intermediate_size=16, shared_intermediate_size=40), "shared_intermediate_size"),
    (dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
    (dict(intermediate_size=2.5), "intermediate_size"),
    (dict(reconstruct=True, reconstruct_tokens=8), "reconstruct_tokens"),
    (dict(reconstruct_ridge=0.0), "reconstruct_ridge"),
]


@pytest.mark.parametrize("kw,key", BAD)
def test_invalid_specs_are_refused_naming_the_parameter(teacher, kw, key):
    src, _ = teacher
    with pytest.raises(PruneError, match=key):
        validate(PruneConfig(**kw), ModelConfig.from_pretrained(src))


def test_split_needs_enough_neurons(teacher, tmp_path):
    src, corpus = teacher  # routed copies of 64 neurons: 4 parts of 32 need 128
    with pytest.raises(PruneError, match="moe_intermediate_size"):
        prune(src, tmp_path / "s", PruneConfig(moe_intermediate_size=32, calibration=corpus, **CALIB), log=None)
    assert not (tmp_path / "s").exists()


def test_cli(teacher, tmp_path, capsys):
    src, corpus = teacher
    out = tmp_path / "s"
    assert main(["prune", str(src), str(out), "--n_routed_experts=2", f"--calibration={corpus}",
                 "--calib_tokens=128", "--layer_calib_tokens=64", "--seq_len=32"]) == 0
    assert "parameters" in capsys.readouterr().out and (out / "config.json").is_file()
    assert main(["prune", str(src), str(tmp_path / "bad"), "--index_n_heads=99"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "index_n_heads" in err[0]
    assert main(["prune", str(src), str(tmp_path / "bad"), "--no_such_key=1"]) == 2
    assert not (tmp_path / "bad").exists()
