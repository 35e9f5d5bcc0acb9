"""`glm5 prune`: a smaller GLM-5-architecture student cut out of a GLM-5 checkpoint, guided by importance
measured on calibration text (NVIDIA's Minitron recipe: score, prune once, then heal by distillation with
`glm5 distill`). The student keeps the architecture: MLA, the sigmoid-routed MoE with its shared expert,
the DSA indexer and the MTP layer.

    glm5 prune CHECKPOINT OUT --num_hidden_layers 24 --intermediate_size 1024 ...

Axes (each optional; what is not given is kept):
- depth `num_hidden_layers`: drop the main layers whose removal costs least. `layer_metric = "loss"`
  measures, per layer, the calibration loss with that layer skipped (its output replaced by its input);
  `"cosine"` is ShortGPT's block influence, 1 - cos(input, output), from one pass. The MTP layer stays.
- MLP width: `intermediate_size` (dense layers), `moe_intermediate_size` (each routed expert) and
  `shared_intermediate_size` (the shared expert(s) in all; must be a multiple of the new
  `moe_intermediate_size`, which sets `n_shared_experts`). A SwiGLU neuron's importance is its mean
  |silu(gate x) * (up x)| over calibration tokens (routed experts: weighted by the router) times the norm
  of its down-projection column.
- experts: `n_routed_experts` keeps the experts with the most router-weighted output mass;
  `num_experts_per_tok` follows (clipped to the experts kept) unless given. Routed experts that are exact
  copies behind a tied router (a sparsely upcycled MLP, as `glm5 convert` writes) have one importance:
  their copy is pruned once, and with `split_copies` (default) the neurons kept are split across the
  experts kept, all of which are selected (top-k = experts, `routed_scaling_factor` = experts), so the
  routed sum is exactly the pruned copy and no parameter holds a duplicate.
- DSA indexer heads `index_n_heads`: heads ranked by |weights_proj| mass times their query norm. With
  `index_topk` >= the context the indexer does not change any logit.
- `qk_nope_head_dim`: the non-rotary query/key dims with the least |q| * |k| weight mass; queries are
  rescaled so that the softmax scale 1/sqrt(qk_head_dim) of the new head dim gives the same scores.

`reconstruct` (off by default) then refits, per main layer, the student's MLP down-projections (dense
layers: the SwiGLU's; MoE layers: the shared expert's and every kept routed expert's, jointly) by ridge
least squares so that the pruned MLP reproduces the teacher's MLP output on the teacher's own layer
inputs over `reconstruct_tokens` calibration tokens (layer-wise output reconstruction, as in the
post-training pruning literature: the kept neurons take over what the removed ones wrote). The gate/up
rows stay those of the teacher; the MTP layer is pruned, not refitted.

The output is a plain `glm_moe_dsa` checkpoint (tokenizer copied) with a `glm5_pruning` record: the
spec, the parameter counts, and per axis what was kept. A spec that would leave an invalid config is
refused before any compute, naming the parameter.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from glm5.core.io import atomic_dir, save_sharded
from glm5.model.config import ModelConfig
from glm5.model.hf_adapter import from_pretrained, load_config, state_dict_to_hf
from glm5.model.layers import SwiGLU
from glm5.model.model import GLM5ForCausalLM
from glm5.model.moe import MoE

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")


class PruneError(ValueError):
    """A pruning spec that the checkpoint cannot take (the message names the parameter)."""


@dataclass(kw_only=True)
class PruneConfig:
    num_hidden_layers: int | None = None  # main layers kept (depth)
    intermediate_size: int | None = None  # dense-layer SwiGLU width
    moe_intermediate_size: int | None = None  # width of each routed expert
    shared_intermediate_size: int | None = None  # shared expert(s) width in all (multiple of the expert width)
    n_routed_experts: int | None = None  # routed experts kept per MoE layer
    num_experts_per_tok: int | None = None  # top-k after pruning (default: min(old top-k, experts kept))
    index_n_heads: int | None = None  # DSA indexer heads kept
    qk_nope_head_dim: int | None = None  # non-rotary query/key dims kept per head
    split_copies: bool = True  # upcycled (identical) experts: split the kept neurons across the kept experts
    layer_metric: Literal["loss", "cosine"] = "loss"
    reconstruct: bool = False  # refit the MLP down-projections to the teacher's MLP outputs (module docstring)
    reconstruct_tokens: int = 32768  # calibration tokens the refit sees (the importance rows' text, more of it)
    reconstruct_ridge: float = 1e-4  # ridge, relative to the mean feature energy (diagonal of the Gram matrix)
    calibration: str = "bundled:corpus/train.jsonl.gz"  # JSONL with "text"
    calib_tokens: int = 8192  # tokens scored for the importances
    layer_calib_tokens: int = 2048  # of which the drop-one-layer losses use the first
    seq_len: int = 256
    seed: int = 0


def _need(ok: bool, key: str, value, why: str) -> None:
    if not ok:
        raise PruneError(f"prune: {key} = {value!r}: {why}")


def validate(spec: PruneConfig, cfg: ModelConfig) -> None:
    """Refuse a spec the checkpoint cannot take, before anything is computed (names the parameter)."""
    _need(cfg.attention_kind == "dsa", "model_type", cfg.model_type,
          "glm5 prune slices GLM-5's MLA and indexer tensors; only glm_moe_dsa / glm5_ext checkpoints")

    def bounded(key: str, old: int, low: int = 1):
        v = getattr(spec, key)
        if v is not None:
            _need(isinstance(v, int) and low <= v <= old, key, v, f"must be an integer in [{low}, {old}] "
                  f"(the checkpoint has {old}; pruning only removes)")
    bounded("num_hidden_layers", cfg.num_hidden_layers)
    bounded("intermediate_size", cfg.intermediate_size)
    bounded("moe_intermediate_size", cfg.moe_intermediate_size)
    bounded("shared_intermediate_size", cfg.moe_intermediate_size * cfg.n_shared_experts)
    bounded("n_routed_experts", cfg.n_routed_experts, low=min(2, cfg.n_routed_experts))  # transformers' router
    # takes each group's top-2 scores: a 1-expert MoE would not load there
    bounded("index_n_heads", cfg.index_n_heads)
    bounded("qk_nope_head_dim", cfg.qk_nope_head_dim)
    experts = spec.n_routed_experts or cfg.n_routed_experts
    if spec.num_experts_per_tok is not None:
        _need(1 <= spec.num_experts_per_tok <= experts, "num_experts_per_tok", spec.num_experts_per_tok,
              f"must be in [1, n_routed_experts = {experts}]")
    if spec.n_routed_experts is not None and cfg.n_group > 1:
        _need(spec.n_routed_experts % cfg.n_group == 0 and spec.n_routed_experts // cfg.n_group >= 2,
              "n_routed_experts", spec.n_routed_experts,
              f"group-limited routing (n_group = {cfg.n_group}) needs a multiple of n_group with >= 2 per group")
    width = spec.moe_intermediate_size or cfg.moe_intermediate_size
    if spec.shared_intermediate_size is not None:
        _need(spec.shared_intermediate_size % width == 0, "shared_intermediate_size",
              spec.shared_intermediate_size, f"must be a multiple of moe_intermediate_size = {width} (it sets "
              "n_shared_experts)")
    elif spec.moe_intermediate_size is not None:
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        _need(shared % width == 0, "moe_intermediate_size", width,
              f"the shared expert width {shared} is not a multiple of it: give shared_intermediate_size too")
    _need(spec.calib_tokens >= spec.seq_len and spec.layer_calib_tokens >= spec.seq_len, "calib_tokens",
          spec.calib_tokens, f"calib_tokens and layer_calib_tokens must be >= seq_len = {spec.seq_len}")
    _need(spec.seq_len >= 2, "seq_len", spec.seq_len, "must be >= 2")
    _need(spec.reconstruct_tokens >= spec.seq_len, "reconstruct_tokens", spec.reconstruct_tokens,
          f"must be >= seq_len = {spec.seq_len}")
    _need(spec.reconstruct_ridge > 0, "reconstruct_ridge", spec.reconstruct_ridge,
          "must be > 0 (a dead neuron makes the plain normal equations singular; 1e-12 is fine)")


# A layer's refit solves one ridge system over all its kept MLP neurons (shared + routed experts): its Gram
# matrix grows with their square (8,192 neurons: 512 MB in float64 per layer, every layer's held at once).
RECONSTRUCT_MAX_NEURONS = 8192


def pruned_widths(spec: PruneConfig, cfg: ModelConfig, split: int | None) -> tuple[int, int, int, int]:
    """(dense width, routed experts kept, each one's width, shared width in all) of the student. `split`:
    see `split_plan`."""
    I_moe = spec.moe_intermediate_size or split or cfg.moe_intermediate_size
    shared = spec.shared_intermediate_size or (cfg.moe_intermediate_size * cfg.n_shared_experts
                                               if spec.moe_intermediate_size is None else I_moe * cfg.n_shared_experts)
    return spec.intermediate_size or cfg.intermediate_size, spec.n_routed_experts or cfg.n_routed_experts, I_moe, shared


def check_reconstruct(spec: PruneConfig, cfg: ModelConfig, split: int | None) -> None:
    """Refuse a refit whose per-layer system would be too large, before any compute (names the key)."""
    if not spec.reconstruct:
        return
    dense, E2, I_moe, shared = pruned_widths(spec, cfg, split)
    moe = shared + E2 * I_moe if "sparse" in cfg.mlp_layer_types else 0
    widest = max(dense if "dense" in cfg.mlp_layer_types else 0, moe)
    _need(widest <= RECONSTRUCT_MAX_NEURONS, "reconstruct", spec.reconstruct,
          f"a layer keeps {widest} MLP neurons (shared + routed experts), above the {RECONSTRUCT_MAX_NEURONS} one "
          "joint refit solves; prune the experts further or set reconstruct = false")


# ---- importance ----------------------------------------------------------------------------------------
@dataclass
class Importance:
    neurons: dict[str, torch.Tensor]  # module path -> [I] (experts: [E, I])
    expert_mass: dict[int, torch.Tensor]  # layer -> [E] router weight mass
    index_heads: dict[int, torch.Tensor]  # layer -> [N]
    layers: torch.Tensor  # [L] cost of dropping each main layer (higher = keep)
    base_loss: float


def calibration_rows(checkpoint: Path, spec: PruneConfig, tokens: int | None = None) -> torch.Tensor:
    """[R, seq_len + 1] packed rows of the calibration text in the checkpoint's own tokenizer (about
    `tokens`, default `calib_tokens`; more tokens extend the same shuffled text)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from .data import pack, read_texts  # noqa: PLC0415
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    texts = read_texts(spec.calibration)
    gen = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(len(texts), generator=gen).tolist()
    n = spec.calib_tokens if tokens is None else tokens
    rows = pack(tok, [texts[i] for i in order], spec.seq_len, n + n // spec.seq_len)
    return rows


def _swiglu_hidden(m: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    return F.silu(m.gate_proj(x)) * m.up_proj(x)


@torch.no_grad()
def measure(model: GLM5ForCausalLM, rows: torch.Tensor, spec: PruneConfig, log=print) -> Importance:
    """Every importance the spec needs, from forward hooks on the model's own forward."""
    cfg = model.config
    sums: dict[str, torch.Tensor] = {}
    mass: dict[int, torch.Tensor] = {}
    heads: dict[int, torch.Tensor] = {}
    handles = []

    def add(key: str, v: torch.Tensor):
        sums[key] = sums[key] + v if key in sums else v.clone()

    def swiglu_hook(key: str):
        def hook(m, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            add(key, _swiglu_hidden(m, x).abs().sum(0))
        return hook

    def experts_hook(layer: int, key: str):
        def hook(m, args):
            x, idx, w = args[0].float(), args[1], args[2].float()
            E, I = m.gate_up_proj.shape[0], m.inter
            acc = torch.zeros(E, I)
            for e in range(E):
                tok, slot = torch.where(idx == e)
                if tok.numel():
                    gu = m.gate_up_proj[e].float()
                    h = F.silu(x[tok] @ gu[:I].T) * (x[tok] @ gu[I:].T)
                    acc[e] += (h.abs() * w[tok, slot, None]).sum(0)
            add(key, acc)
            mass[layer] = mass.get(layer, torch.zeros(E)) + torch.zeros(E).index_add_(0, idx.reshape(-1),
                                                                                      w.reshape(-1))
        return hook

    def indexer_hook(layer: int, m):
        def hook(attn, args):  # the attention's input is the indexer's x (it may skip the indexer's own forward)
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            wq = m.wq_b.weight.float().view(m.n_heads, m.head_dim, -1).norm(dim=(1, 2))
            heads[layer] = heads.get(layer, torch.zeros(m.n_heads)) + F.linear(x, m.weights_proj.weight.float()
                                                                              ).abs().sum(0) * wq
        return hook

    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            handles.append(mlp.shared_experts.register_forward_pre_hook(swiglu_hook(f"{i}.shared")))
            handles.append(mlp.experts.register_forward_pre_hook(experts_hook(i, f"{i}.experts")))
        else:
            handles.append(mlp.register_forward_pre_hook(swiglu_hook(f"{i}.mlp")))
        idx_mod = getattr(layer.self_attn, "indexer", None)
        if idx_mod is not None:
            handles.append(layer.self_attn.register_forward_pre_hook(indexer_hook(i, idx_mod)))
    t0, losses = time.perf_counter(), []
    try:
        for b in range(0, len(rows), 4):
            batch = rows[b:b + 4]
            out = model(batch[:, :-1], return_mtp=cfg.num_nextn_predict_layers > 0)
            losses.append(F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten(),
                                          reduction="sum").item())
    finally:
        for h in handles:
            h.remove()
    n_tok = rows[:, 1:].numel()
    base = sum(losses) / n_tok
    if log:
        log(f"[prune] importances from {n_tok:,} calibration tokens in {time.perf_counter() - t0:.0f}s "
            f"(loss {base:.3f})")
    neurons = {}
    for key, v in sums.items():
        layer, part = key.split(".")
        mods = model.model.layers[int(layer)].mlp
        if part == "experts":
            down = mods.experts.down_proj.float().norm(dim=1)  # [E, I]: column norms per expert
        else:
            sw = mods.shared_experts if part == "shared" else mods
            down = sw.down_proj.weight.float().norm(dim=0)
        neurons[key] = v * down
    layers = torch.zeros(cfg.num_hidden_layers)
    if spec.num_hidden_layers is not None and spec.num_hidden_layers < cfg.num_hidden_layers:
        layers = layer_importance(model, rows, spec, log)
    return Importance(neurons, mass, heads, layers, base)


def _forward_hooked(model: GLM5ForCausalLM, rows: torch.Tensor, handles: list) -> None:
    """Run the model over the rows (4 at a time, inputs only) for its hooks' sake, then remove them."""
    try:
        for b in range(0, len(rows), 4):
            model(rows[b:b + 4, :-1])
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def layer_importance(model: GLM5ForCausalLM, rows: torch.Tensor, spec: PruneConfig, log=print) -> torch.Tensor:
    """[L]: drop-one-layer calibration loss minus the full model's ("loss"), or 1 - cos(in, out) ("cosine")."""
    cfg = model.config
    sub = rows[: max(1, spec.layer_calib_tokens // spec.seq_len)]
    main = model.model.main_layers
    t0 = time.perf_counter()
    if spec.layer_metric == "cosine":
        score = torch.zeros(cfg.num_hidden_layers)

        def cos_hook(i):
            def hook(m, args, out):
                score[i] += (1 - F.cosine_similarity(args[0].float(), out[0].float(), dim=-1)).mean()
            return hook
        _forward_hooked(model, sub, [layer.register_forward_hook(cos_hook(i)) for i, layer in enumerate(main)])
        return score

    def loss() -> float:
        total = 0.0
        for b in range(0, len(sub), 4):
            batch = sub[b:b + 4]
            logits = model(batch[:, :-1]).logits.float()
            total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        return total / sub[:, 1:].numel()

    base = loss()
    score = torch.zeros(cfg.num_hidden_layers)
    for i, layer in enumerate(main):
        h = layer.register_forward_hook(lambda m, args, out: (args[0],) + tuple(out[1:]))
        try:
            score[i] = loss() - base
        finally:
            h.remove()
        if log:
            log(f"[prune] layer {i}: loss +{score[i]:.4f} without it ({time.perf_counter() - t0:.0f}s)")
    return score


# ---- reconstruction ------------------------------------------------------------------------------------
def mlp_features(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[N, F]: what an MLP's down-projections read, so that its output is features @ [downs].T. Dense:
    silu(gate x) * (up x); MoE: the shared expert's, then each routed expert's times its routing weight
    (zero where the router did not pick it), experts in order."""
    if not isinstance(mlp, MoE):
        return _swiglu_hidden(mlp, x)
    parts = [_swiglu_hidden(mlp.shared_experts, x)]
    _, _, w, idx = mlp.gate(x)
    ex = mlp.experts
    for e in range(ex.n_experts):
        we = (w * (idx == e)).sum(-1)  # [N]
        h = torch.zeros(x.shape[0], ex.inter, dtype=x.dtype)
        tok = we.nonzero().squeeze(1)
        if tok.numel():
            gu = ex.gate_up_proj[e].float()
            xt = x[tok]
            h[tok] = F.silu(xt @ gu[:ex.inter].T) * (xt @ gu[ex.inter:].T) * we[tok, None]
        parts.append(h)
    return torch.cat(parts, 1)


def _set_downs(mlp: torch.nn.Module, w: torch.Tensor) -> None:
    """Write the refitted [H, F] down-projection back into the MLP (the inverse of `mlp_features`' layout)."""
    if not isinstance(mlp, MoE):
        mlp.down_proj.weight.copy_(w)
        return
    s = mlp.shared_experts.down_proj.weight.shape[1]
    mlp.shared_experts.down_proj.weight.copy_(w[:, :s])
    I = mlp.experts.inter
    for e in range(mlp.experts.n_experts):
        mlp.experts.down_proj[e].copy_(w[:, s + e * I: s + (e + 1) * I])


def _downs(mlp: torch.nn.Module) -> torch.Tensor:
    if not isinstance(mlp, MoE):
        return mlp.down_proj.weight.float()
    return torch.cat([mlp.shared_experts.down_proj.weight.float(), *mlp.experts.down_proj.float().unbind(0)], 1)


@torch.no_grad()
def reconstruct(teacher: GLM5ForCausalLM, student: GLM5ForCausalLM, layers_kept: list[int], rows: torch.Tensor,
                ridge: float, log=print) -> dict:
    """Refit the student's main-layer MLP down-projections in place: for student layer i (teacher layer
    layers_kept[i]), minimise sum ||features(x) W.T - y||^2 + ridge * mean(diag G) * ||W||^2 over the
    teacher's MLP inputs x and outputs y on `rows` (one teacher pass; the normal equations accumulated in
    float64). Returns the mean relative squared error of the layers' MLP outputs before and after."""
    acc: dict[int, list[torch.Tensor]] = {}

    def hook(i: int):
        def h(m, args, out):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            y = (out[0] if isinstance(out, tuple) else out).reshape(-1, x.shape[-1]).float()
            f = mlp_features(student.model.layers[i].mlp, x)
            terms = [(f.T @ f).double(), (f.T @ y).double(), (y * y).sum().double()]
            acc[i] = terms if i not in acc else [a + b for a, b in zip(acc[i], terms)]
        return h

    t0 = time.perf_counter()
    _forward_hooked(teacher, rows, [teacher.model.layers[t].mlp.register_forward_hook(hook(i))
                                    for i, t in enumerate(layers_kept)])
    before, after = [], []
    for i, (G, C, yy) in sorted(acc.items()):
        mlp = student.model.layers[i].mlp

        def err(w: torch.Tensor) -> float:  # ||F W.T - Y||^2 / ||Y||^2 from the accumulated sums
            return float((torch.einsum("hf,fg,hg->", w, G, w) - 2 * torch.einsum("hf,fh->", w, C) + yy) / yy)
        w0 = _downs(mlp).double()
        reg = ridge * G.diagonal().mean() * torch.eye(len(G), dtype=G.dtype)
        w = torch.linalg.solve(G + reg, C).T  # [H, F]
        before.append(err(w0))
        after.append(err(w))
        _set_downs(mlp, w.float())
    res = {"tokens": int(rows[:, 1:].numel()), "ridge": ridge, "mlp_error_before": round(sum(before) / len(before), 5),
           "mlp_error_after": round(sum(after) / len(after), 5), "seconds": round(time.perf_counter() - t0, 1)}
    if log:
        log(f"[prune] reconstruct: MLP output error {res['mlp_error_before']:.4f} -> {res['mlp_error_after']:.4f} "
            f"(mean over {len(acc)} layers, {res['tokens']:,} tokens) in {res['seconds']}s")
    return res


# ---- surgery -------------------------------------------------------------------------------------------
def _topk_sorted(score: torch.Tensor, k: int) -> torch.Tensor:
    return score.topk(k).indices.sort().values


def _copies(tensors: dict[str, torch.Tensor], prefix: str, n: int) -> bool:
    """Routed experts of one layer all equal, behind a router whose rows and bias are equal too."""
    g = tensors[f"{prefix}.gate.weight"]
    b = tensors[f"{prefix}.gate.e_score_correction_bias"]
    if n < 2 or not (g == g[:1]).all() or not (b == b[:1]).all():
        return False
    return all(torch.equal(tensors[f"{prefix}.experts.{e}.{p}.weight"], tensors[f"{prefix}.experts.0.{p}.weight"])
               for e in range(1, n) for p in ("gate_proj", "up_proj", "down_proj"))


def _slice_swiglu(src: dict, dst: dict, old: str, new: str, keep: torch.Tensor) -> None:
    dst[f"{new}.gate_proj.weight"] = src[f"{old}.gate_proj.weight"][keep].clone()
    dst[f"{new}.up_proj.weight"] = src[f"{old}.up_proj.weight"][keep].clone()
    dst[f"{new}.down_proj.weight"] = src[f"{old}.down_proj.weight"][:, keep].clone()


def split_plan(spec: PruneConfig, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> int | None:
    """The width of each kept expert when the routed experts are pruned as one upcycled copy split across
    them (default: the copy's width / experts kept, which is exact), or None (no split). Refuses a split
    that needs more neurons than the copy has (before any compute)."""
    asked = spec.n_routed_experts is not None or spec.moe_intermediate_size is not None
    if not (spec.split_copies and asked and upcycled_copies(cfg, tensors)):
        return None
    E2 = spec.n_routed_experts or cfg.n_routed_experts
    I2 = spec.moe_intermediate_size or cfg.moe_intermediate_size // E2
    shared = spec.shared_intermediate_size or cfg.moe_intermediate_size * cfg.n_shared_experts
    _need(I2 >= 1 and shared % I2 == 0, "shared_intermediate_size", shared,
          f"must be a multiple of the split experts' width {I2} (it sets n_shared_experts)")
    _need(spec.num_experts_per_tok in (None, E2), "num_experts_per_tok", spec.num_experts_per_tok,
          f"the routed experts are upcycled copies: split_copies selects all {E2} kept parts (or pass "
          "--split_copies=false)")
    _need(E2 * I2 <= cfg.moe_intermediate_size, "moe_intermediate_size", I2,
          f"the routed experts are upcycled copies of {cfg.moe_intermediate_size} neurons: {E2} parts of {I2} "
          f"need {E2 * I2} (or pass --split_copies=false)")
    return I2


def prune_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], imp: Importance, spec: PruneConfig,
                  split: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(new config, new HF-named tensors, record of what was kept). `split`: see `split_plan`."""
    L = cfg.num_hidden_layers
    keep_layers = list(range(L))
    if spec.num_hidden_layers is not None and spec.num_hidden_layers < L:
        keep_layers = _topk_sorted(imp.layers, spec.num_hidden_layers).tolist()
    old_ids = keep_layers + list(range(L, L + cfg.num_nextn_predict_layers))  # the MTP layers stay, renumbered
    E, A = cfg.n_routed_experts, cfg.num_experts_per_tok
    I_dense, E2, I_moe, shared_new = pruned_widths(spec, cfg, split)
    nope_old, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    nope = spec.qk_nope_head_dim or nope_old
    H, V = cfg.num_attention_heads, cfg.v_head_dim
    n_idx = spec.index_n_heads or cfg.index_n_heads
    out: dict[str, torch.Tensor] = {}
    record: dict = {"layers_kept": keep_layers, "experts": {}, "split_copies": [], "neurons_kept": {}}
    neurons = record["neurons_kept"]  # "{old layer}.mlp|shared|experts" -> kept indices (experts: per expert)
    copies_all = split is not None
    top_k = spec.num_experts_per_tok or min(A, E2)
    scaling = cfg.routed_scaling_factor
    if copies_all:
        top_k, scaling = E2, cfg.routed_scaling_factor * E2  # every kept part selected, each at full weight
    for k, v in tensors.items():
        if not k.startswith("model.layers."):
            out[k] = v
    for new_i, old_i in enumerate(old_ids):
        src, dst = f"model.layers.{old_i}", f"model.layers.{new_i}"
        layer = {k[len(src) + 1:]: v for k, v in tensors.items() if k.startswith(src + ".")}
        for name, v in layer.items():
            if not name.startswith(("mlp.", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.indexer.")):
                out[f"{dst}.{name}"] = v
        # attention: non-rotary dims
        qb, kvb = layer["self_attn.q_b_proj.weight"], layer["self_attn.kv_b_proj.weight"]
        if nope < nope_old:
            q3 = qb.view(H, nope_old + rope, -1)
            kv3 = kvb.view(H, nope_old + V, -1)
            w = (q3[:, :nope_old].norm(dim=-1) * kv3[:, :nope_old].norm(dim=-1)).sum(0)  # [nope_old]
            dims = _topk_sorted(w, nope)
            ratio = ((nope + rope) / (nope_old + rope)) ** 0.5  # same scores under the new 1/sqrt(qk_head_dim)
            qb = torch.cat([q3[:, dims], q3[:, nope_old:]], dim=1).mul(ratio).reshape(-1, qb.shape[-1])
            kvb = torch.cat([kv3[:, dims], kv3[:, nope_old:]], dim=1).reshape(-1, kvb.shape[-1])
            record.setdefault("nope_dims", {})[new_i] = dims.tolist()
        out[f"{dst}.self_attn.q_b_proj.weight"], out[f"{dst}.self_attn.kv_b_proj.weight"] = qb.clone(), kvb.clone()
        # indexer heads
        if "self_attn.indexer.wq_b.weight" in layer:
            D = cfg.index_head_dim
            keep_h = torch.arange(cfg.index_n_heads)
            if n_idx < cfg.index_n_heads:
                keep_h = _topk_sorted(imp.index_heads[old_i], n_idx)
            for name, v in layer.items():
                if name.startswith("self_attn.indexer."):
                    if name.endswith("wq_b.weight"):
                        v = v.view(cfg.index_n_heads, D, -1)[keep_h].reshape(-1, v.shape[-1])
                    elif name.endswith("weights_proj.weight"):
                        v = v[keep_h]
                    out[f"{dst}.{name}"] = v.clone()
        # MLP
        if old_i < L and cfg.mlp_layer_types[old_i] == "dense":
            keep = _topk_sorted(imp.neurons[f"{old_i}.mlp"], I_dense)
            neurons[f"{old_i}.mlp"] = keep.tolist()
            _slice_swiglu(layer, out, "mlp", f"{dst}.mlp", keep)
            continue
        keep = _topk_sorted(imp.neurons[f"{old_i}.shared"], shared_new)
        neurons[f"{old_i}.shared"] = keep.tolist()
        _slice_swiglu(layer, out, "mlp.shared_experts", f"{dst}.mlp.shared_experts", keep)
        expert_imp = imp.neurons[f"{old_i}.experts"]  # [E, I]
        if copies_all:  # one pruned copy split across the kept experts
            keep = _topk_sorted(expert_imp.sum(0), E2 * I_moe)
            parts = keep.view(E2, I_moe)
            neurons[f"{old_i}.experts"] = parts.tolist()
            for e in range(E2):
                _slice_swiglu(layer, out, "mlp.experts.0", f"{dst}.mlp.experts.{e}", parts[e])
            out[f"{dst}.mlp.gate.weight"] = layer["mlp.gate.weight"][:E2].clone()
            out[f"{dst}.mlp.gate.e_score_correction_bias"] = layer["mlp.gate.e_score_correction_bias"][:E2].clone()
            record["split_copies"].append(new_i)
            continue
        kept_e = _topk_sorted(imp.expert_mass.get(old_i, torch.ones(E)), E2) if E2 < E else torch.arange(E)
        record["experts"][new_i] = kept_e.tolist()
        neurons[f"{old_i}.experts"] = []
        for j, e in enumerate(kept_e.tolist()):
            keep = _topk_sorted(expert_imp[e], I_moe)
            neurons[f"{old_i}.experts"].append(keep.tolist())
            _slice_swiglu(layer, out, f"mlp.experts.{e}", f"{dst}.mlp.experts.{j}", keep)
        out[f"{dst}.mlp.gate.weight"] = layer["mlp.gate.weight"][kept_e].clone()
        out[f"{dst}.mlp.gate.e_score_correction_bias"] = layer["mlp.gate.e_score_correction_bias"][kept_e].clone()
    L2 = len(keep_layers)
    changes = dict(num_hidden_layers=L2, intermediate_size=I_dense, moe_intermediate_size=I_moe,
                   n_shared_experts=shared_new // I_moe, n_routed_experts=E2, num_experts_per_tok=top_k,
                   routed_scaling_factor=scaling, index_n_heads=n_idx, qk_nope_head_dim=nope,
                   qk_head_dim=nope + rope,
                   mlp_layer_types=[cfg.mlp_layer_types[i] for i in keep_layers],
                   indexer_types=[cfg.indexer_types[i] for i in keep_layers],
                   layer_types=[cfg.layer_types[i] for i in keep_layers])
    changes["first_k_dense_replace"] = next((j for j, t in enumerate(changes["mlp_layer_types"]) if t == "sparse"), L2)
    if changes["indexer_types"] and changes["indexer_types"][0] != "full":
        raise PruneError("prune: num_hidden_layers: the first kept layer shares an indexer it no longer has "
                         "(indexer_types); keep layer 0")
    try:
        new_cfg = cfg.replace(**changes)
    except ValueError as e:
        raise PruneError(f"prune: the pruned config is invalid: {e}") from None
    return new_cfg, out, record


def count_parameters(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        m = GLM5ForCausalLM(cfg)
    return sum(p.numel() for p in m.parameters())


def upcycled_copies(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> bool:
    """Every MoE layer's routed experts (MTP included) are exact copies behind a tied router."""
    L = cfg.num_hidden_layers
    moe = [i for i in range(L + cfg.num_nextn_predict_layers) if i >= L or cfg.mlp_layer_types[i] == "sparse"]
    return bool(moe) and all(_copies(tensors, f"model.layers.{i}.mlp", cfg.n_routed_experts) for i in moe)


def prune(checkpoint: str | Path, out_dir: str | Path, spec: PruneConfig, log=print) -> dict:
    """Measure, prune, write the student to `out_dir` (atomically); returns the `glm5_pruning` record."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    cfg = load_config(checkpoint)
    validate(spec, cfg)
    t0 = time.perf_counter()
    model = from_pretrained(checkpoint, dtype=torch.float32)
    tensors = state_dict_to_hf(model)
    split = split_plan(spec, cfg, tensors)
    check_reconstruct(spec, cfg, split)
    rows = calibration_rows(checkpoint, spec)
    imp = measure(model, rows, spec, log)
    new_cfg, new_tensors, kept = prune_tensors(cfg, tensors, imp, spec, split)
    del tensors
    before, after = count_parameters(cfg), count_parameters(new_cfg)
    def write_config(tmp: Path) -> None:
        d = new_cfg.to_dict()
        d["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(d, indent=2) + "\n")

    with atomic_dir(out_dir) as tmp:
        save_sharded({k: v.contiguous() for k, v in new_tensors.items()}, tmp, "5GB")
        write_config(tmp)  # the load below needs it; rewritten with the record once that is complete
        student = from_pretrained(tmp)  # strict load: every tensor present, every shape the config's
        if spec.reconstruct:
            kept["reconstruct"] = reconstruct(model.eval(), student.eval(), kept["layers_kept"],
                                              calibration_rows(checkpoint, spec, spec.reconstruct_tokens),
                                              spec.reconstruct_ridge, log)
            save_sharded({k: v.contiguous() for k, v in state_dict_to_hf(student).items()}, tmp, "5GB")
        del model, student
        record = {"source": str(checkpoint), "spec": asdict(spec), "parameters_before": before,
                  "parameters_after": after, "calibration_loss": round(imp.base_loss, 5),
                  "layer_scores": [round(float(s), 5) for s in imp.layers.tolist()], **kept,
                  "seconds": round(time.perf_counter() - t0, 1)}
        full = dict(record)
        record.pop("neurons_kept")  # config.json keeps the summary; pruning.json every kept index
        record.pop("nope_dims", None)
        new_cfg.extra["glm5_pruning"] = record
        write_config(tmp)
        for name in TOKENIZER_FILES:
            if (checkpoint / name).is_file():
                shutil.copy2(checkpoint / name, tmp / name)
        (tmp / "pruning.json").write_text(json.dumps(full) + "\n")
    if log:
        log(f"[prune] {before:,} -> {after:,} parameters ({before / after:.2f}x fewer) in {record['seconds']}s: "
            f"{out_dir}")
    return record
