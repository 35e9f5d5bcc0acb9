"""A planner for a parallel training run: per-GPU memory, communication per step and a roofline step time,
for the layout that glm5/train/parallel*.py actually builds (`glm5 plan`).

Arithmetic only: the model is built on the meta device to count parameters by where they live.
- Parameters. Per rank the FSDP shard of: tensor-parallel weights (q_b/kv_b/o_proj, dense and shared
  MLPs, embedding, LM head) / (tp x D); replicated ones (norms, low-rank MLA projections, indexer,
  router) / D; routed experts / (ep x dp x tp) (EP slice, then FSDP over the ranks that hold it). D =
  dp x ep data ranks. Masters, gradients (fp32) and AdamW moments are kept in that shard:
  4 + 4 + 8 bytes per element. While a unit computes, FSDP holds its unsharded compute copy (2 units,
  the one running and the one prefetched); under pipeline parallel torch keeps the stage's unsharded
  gradients until the last micro-batch.
- Activations: an estimate of what autograd saves per layer and token (see `_layer_activation_elems`),
  times the micro-batches a pipeline rank holds in flight; with activation checkpointing only each
  layer's input plus one layer's working set.
- Communication: elements each rank feeds into each collective per optimizer step, by the rules of the
  implementation (FSDP gathers every unit in forward and again in backward, the root once; reduces per
  micro-batch, or once per step under pipeline parallel; TP all-reduces listed in parallel_tp.py; EP
  all-to-all of token rows; pipeline sends of [b, s, H] activations and their gradients).
- Time: FLOPs (6 x active parameters per token + causal attention) / the accelerator's dense bf16 peak,
  collectives at NVLink bandwidth inside a node and network bandwidth across nodes, the pipeline
  bubble (pp - 1) / (stages_per_rank x micro-batches), with and without overlap of communication.

Datasheet numbers (dense bf16 TFLOP/s, HBM GB, NVLink GB/s per direction, network GB/s per GPU).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from glm5.model.config import ModelConfig
from glm5.model.model import GLM5ForCausalLM

from .parallel import check_model, mesh_shape
from .parallel_pp import split_layers


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_tflops: float  # dense
    hbm_gb: float
    nvlink_gbps: float  # GB/s per direction per GPU
    net_gbps: float  # GB/s per GPU across nodes (InfiniBand / RoCE)


ACCELERATORS = {
    "H100": Accelerator("H100 SXM", 989.0, 80.0, 450.0, 50.0),
    "H200": Accelerator("H200 SXM", 989.0, 141.0, 450.0, 50.0),
    "B200": Accelerator("B200", 2250.0, 180.0, 900.0, 100.0),
    "A100": Accelerator("A100 SXM 80GB", 312.0, 80.0, 300.0, 25.0),
}

TP_SHARDED = re.compile(r"(q_b_proj|kv_b_proj|o_proj|mlp\.(gate|up|down)_proj|shared_experts|embed_tokens|lm_head)")


@dataclass
class Layout:
    """The run to plan."""

    gpus: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 0  # 0 = what the others leave
    micro_batch: int = 1  # sequences per micro-batch per data rank
    seq_len: int = 4096
    grad_accum: int = 8  # micro-batches per step
    stages_per_rank: int = 1
    schedule: str = "1f1b"
    pipeline_split: tuple[int, ...] = ()
    gpus_per_node: int = 8
    mtp: bool = True
    train_indexer: bool = False  # the DSA indexer gets gradients only with dsa.indexer_loss_coef > 0
    compute_bytes: int = 2  # bf16 compute copies and activations


@dataclass
class Plan:
    """All numbers per GPU (the busiest pipeline rank unless a field says otherwise)."""

    layout: Layout
    shape: dict[str, int]
    params_total: int
    params_per_rank: list[int]  # stored (sharded) elements, per pipeline rank
    memory_gb: dict[str, float] = field(default_factory=dict)
    comm_elems: dict[str, float] = field(default_factory=dict)  # per step, busiest pipeline rank
    comm_gb: dict[str, float] = field(default_factory=dict)
    time_s: dict[str, float] = field(default_factory=dict)
    tokens_per_step: int = 0


def _unit_of(name: str) -> tuple[str, int | None]:
    """(kind, layer) of a parameter: kind in {tp, rep, expert}; layer None for embedding/head/final norm."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    layer = int(m.group(1)) if m else None
    if ".mlp.experts." in name:
        return "expert", layer
    return ("tp" if TP_SHARDED.search(name) else "rep"), layer


def _param_table(cfg: ModelConfig) -> list[tuple[str, str, int | None, int]]:
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg)
    return [(n, *_unit_of(n), p.numel()) for n, p in model.named_parameters()]


def _stored(kind: str, n: int, shape: dict[str, int]) -> float:
    D = shape["dp"] * shape["ep"]
    if kind == "tp":
        return n / (shape["tp"] * D)
    if kind == "expert":
        return n / (shape["ep"] * shape["dp"] * shape["tp"])
    return n / D


def _unsharded(kind: str, n: int, shape: dict[str, int]) -> float:
    """What one rank holds of a parameter while its FSDP unit computes."""
    return n / shape["tp"] if kind == "tp" else n / shape["ep"] if kind == "expert" else n


def _rank_layers(cfg: ModelConfig, lay: Layout, shape: dict[str, int]) -> tuple[list[set], int]:
    """Per pipeline rank the set of layer indices it runs (plus "embed" / "head" markers)."""
    S = shape["pp"] * lay.stages_per_rank
    stages = split_layers(cfg, S, lay.pipeline_split) if S > 1 else \
        [list(range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers))]
    ranks = []
    for r in range(shape["pp"]):
        mine = [s for s in range(S) if s % shape["pp"] == r]
        held: set = {i for s in mine for i in stages[s]}
        if 0 in mine or (S - 1 in mine and cfg.num_nextn_predict_layers and lay.mtp):
            held.add("embed")
        if S - 1 in mine:
            held.add("head")
        ranks.append(held)
    return ranks, S


def _layer_activation_elems(cfg: ModelConfig, lay: Layout, shape: dict[str, int], moe: bool) -> float:
    """Elements autograd keeps for one decoder layer and one micro-batch on one rank (estimate).

    Attention (heads / tp): the normed input, q_a and kv_a outputs and their norms, q_b / kv_b outputs,
    the key and query concatenations, the attention output (flash: no [s, s] scores); GQA: the normed
    input, q / k / v, their QK-norm outputs, the rotated q / k and the attention output. Dense MLP / shared
    expert (width / tp): input, gate, up, activation. MoE (each TP rank routes s/tp tokens): router
    scores, the dispatched rows and the expert hidden states of top_k assignments per token."""
    T = lay.micro_batch * lay.seq_len
    tp, h = shape["tp"], cfg.hidden_size
    nh = cfg.num_attention_heads / tp
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.attention_kind == "gqa":
        heads = (nh + 2 * cfg.num_key_value_heads / tp) * cfg.head_dim  # q, k, v widths
        attn = T * (h + heads * (2 + cfg.use_qk_norm) + nh * cfg.head_dim)
    else:
        attn = T * (2 * h + 2 * cfg.q_lora_rank + 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                    + nh * (qk + (cfg.qk_nope_head_dim + v) + 2 * qk + 2 * v))
    if not moe:
        return attn + T * (h + 3 * cfg.intermediate_size / tp)
    shared = T * (h + 3 * cfg.moe_intermediate_size * cfg.n_shared_experts / tp)
    k = cfg.num_experts_per_tok
    routed = T * cfg.n_routed_experts * 2 + (T / tp) * k * (3 * h + 3 * cfg.moe_intermediate_size)
    return attn + shared + routed


def plan(cfg: ModelConfig, lay: Layout, acc: Accelerator) -> Plan:
    shape = mesh_shape(lay.gpus, lay.dp, lay.ep, lay.tp, lay.pp)
    check_model(cfg, shape, shape["pp"] * lay.stages_per_rank)
    D, tp, ep, pp = shape["dp"] * shape["ep"], shape["tp"], shape["ep"], shape["pp"]
    table = _param_table(cfg)
    ranks, S = _rank_layers(cfg, lay, shape)
    n_main = cfg.num_hidden_layers
    out = Plan(lay, shape, sum(n for *_, n in table), [])
    m, T, h = lay.grad_accum, lay.micro_batch * lay.seq_len, cfg.hidden_size
    out.tokens_per_step = m * T * D
    GB = 1e9
    worst = None
    for r, held in enumerate(ranks):
        def mine(layer, name):
            if layer is None:
                return ("embed" in held and ("embed_tokens" in name or "block_position" in name)) or \
                       ("head" in held and not ("embed_tokens" in name or "block_position" in name))
            return layer in held and (layer < n_main or lay.mtp)
        rows = [(kind, layer, n, lay.train_indexer or ".indexer." not in name)
                for name, kind, layer, n in table if mine(layer, name)]
        stored = sum(_stored(k, n, shape) for k, _, n, _ in rows)
        trained = sum(_stored(k, n, shape) for k, _, n, g in rows if g)  # the rest gets no gradient
        units: dict = {}
        grad_units: dict = {}
        for kind, layer, n, g in rows:
            key = (layer, kind == "expert" and (ep > 1 or tp > 1))
            units[key] = units.get(key, 0.0) + _unsharded(kind, n, shape)
            grad_units[key] = grad_units.get(key, 0.0) + (_unsharded(kind, n, shape) if g else 0.0)
        unsharded = sum(grad_units.values())
        biggest = sorted(units.values())[-2:]
        n_layers = sum(1 for x in held if isinstance(x, int) and (x < n_main or lay.mtp))
        moe_layers = sum(1 for x in held if isinstance(x, int) and (x >= n_main or cfg.mlp_layer_types[x] == "sparse")
                         and (x < n_main or lay.mtp))
        act_layer = [_layer_activation_elems(cfg, lay, shape, moe) for moe in (False, True)]
        act_all = (n_layers - moe_layers) * act_layer[0] + moe_layers * act_layer[1]
        in_flight = 1 if pp == 1 else (m if lay.schedule == "gpipe" else
                                       min(m, pp - r) * (1 + (pp - 1) / (pp * lay.stages_per_rank)))
        logits = (2 if lay.mtp and "head" in held else 1) * T * cfg.vocab_size / tp * 4 * 2 if "head" in held else 0
        cb = lay.compute_bytes
        mem = {"weights (fp32 master shard)": 4 * stored / GB,
               "weights (unsharded compute copies, 2 units)": cb * sum(biggest) / GB,
               "gradients (fp32 shard)": 4 * trained / GB,
               "gradients (unsharded during pipeline accumulation)": (4 * unsharded / GB) if pp > 1 else 0.0,
               "optimizer states (AdamW m, v)": 8 * trained / GB,
               "activations (no checkpointing)": (cb * act_all * in_flight + logits) / GB,
               "activations (checkpointing)": (cb * (n_layers * T * h * in_flight + max(act_layer)) + logits) / GB}
        out.params_per_rank.append(round(stored))
        colls = _comm(cfg, lay, shape, units, grad_units, held, n_layers, moe_layers)
        if worst is None or sum(mem.values()) > sum(worst[0].values()):
            worst = (mem, colls)
    mem, colls = worst
    out.memory_gb = {k: round(v, 3) for k, v in mem.items()}
    for c in colls:
        out.comm_elems[c.kind] = out.comm_elems.get(c.kind, 0.0) + c.elems
        out.comm_gb[c.kind] = out.comm_gb.get(c.kind, 0.0) + c.elems * c.bytes_per_elem / GB
    out.comm_gb = {k: round(v, 4) for k, v in out.comm_gb.items()}
    out.time_s = _time(cfg, lay, shape, acc, out, colls)
    return out


# mesh dimensions from slowest to fastest varying (parallel.DIMS)
_ORDER = ("pp", "dp", "ep", "tp")


def _span(dims: tuple[str, ...], shape: dict[str, int]) -> int:
    """Consecutive ranks a group along `dims` stretches over (tp is innermost): it fits in a node when
    this is at most the GPUs per node."""
    real = [_ORDER.index(d) for d in dims if shape[d] > 1]
    return math.prod(shape[d] for d in _ORDER[min(real):]) if real else 1


@dataclass
class _Coll:
    kind: str
    elems: float  # fed in by this rank per step
    group: int  # ranks in the collective
    span: int  # see _span
    bytes_per_elem: int


def _comm(cfg, lay, shape, units, grad_units, held, n_layers, moe_layers) -> list[_Coll]:
    """This rank's collectives per step (see the module docstring). `units` / `grad_units`: unsharded
    elements per FSDP unit, all / those that get gradients (the DSA indexer only in its warm-up)."""
    D, tp, ep, pp = shape["dp"] * shape["ep"], shape["tp"], shape["ep"], shape["pp"]
    m, T, h, b = lay.grad_accum, lay.micro_batch * lay.seq_len, cfg.hidden_size, lay.compute_bytes
    out: list[_Coll] = []
    for (layer, own_expert), un in units.items():
        dims = ("dp", "tp") if own_expert else ("dp", "ep")
        mesh = math.prod(shape[d] for d in dims)
        if mesh == 1:
            continue
        gathers = 1 if layer is None else 2  # the root gathers once, a layer unit in forward and backward
        span = _span(dims, shape)
        out.append(_Coll("all_gather", m * gathers * un / mesh, mesh, span, b))
        grads = grad_units[(layer, own_expert)]
        out.append(_Coll("reduce_scatter", (1 if pp > 1 else m) * grads, mesh, span, 4))  # fp32 reduction
    k = cfg.num_experts_per_tok
    if tp > 1:
        per_layer = T * (3 * h + cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        head = ("head" in held) * (T * h + 3 * T) * (2 if lay.mtp else 1)
        embed = ("embed" in held) * T * h * (2 if lay.mtp and "head" in held else 1)
        span = _span(("tp",), shape)
        out.append(_Coll("all_reduce", m * (n_layers * per_layer + head + embed), tp, span, b))
        out.append(_Coll("all_gather", m * moe_layers * (T / tp) * (2 * h + k), tp, span, b))  # token-parallel
    if ep > 1:
        rows_ = m * moe_layers * 4 * (T / tp) * k * h  # dispatch + combine, forward and backward
        out.append(_Coll("all_to_all", rows_ + m * moe_layers * cfg.n_routed_experts, ep, _span(("ep",), shape), b))
    if pp > 1:
        span = _span(("pp",), shape)
        out.append(_Coll("send", m * lay.stages_per_rank * 2 * T * h, 2, span, b))
        if lay.mtp and cfg.num_nextn_predict_layers and "embed" in held:
            out.append(_Coll("all_reduce", cfg.vocab_size * h / (tp * D), 2, span, 4))  # tied embedding copy
    return out


def _seconds(c: _Coll, lay: Layout, acc: Accelerator) -> float:
    """Ring algorithms: all-reduce moves 2 (n-1)/n of the data, gather / scatter / all-to-all (n-1)/n
    of the full tensor, a send all of it; at NVLink speed inside a node, network speed across."""
    bw = (acc.nvlink_gbps if c.span <= lay.gpus_per_node else acc.net_gbps) * 1e9
    full = c.elems * c.group if c.kind == "all_gather" else c.elems
    factor = {"all_reduce": 2 * (c.group - 1) / c.group, "send": 1.0}.get(c.kind, (c.group - 1) / c.group)
    return full * c.bytes_per_elem * factor / bw


def _time(cfg: ModelConfig, lay: Layout, shape: dict[str, int], acc: Accelerator, p: Plan,
          colls: list[_Coll]) -> dict[str, float]:
    from glm5.model.params import count_parameters
    counts = count_parameters(cfg)
    active = counts["active_with_lm_head"] + (counts["mtp"] * cfg.num_experts_per_tok / max(1, cfg.n_routed_experts)
                                              if lay.mtp else 0)
    s = lay.seq_len
    keys = min(s / 2, cfg.index_topk) if cfg.index_topk else s / 2  # causal average, DSA top-k cap
    attn_per_token = 2 * 2 * cfg.num_attention_heads * keys * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                                + cfg.v_head_dim) * cfg.num_hidden_layers
    flops = p.tokens_per_step * (6 * active + 3 * attn_per_token) / lay.gpus
    compute = flops / (acc.bf16_tflops * 1e12)
    comm: dict[str, float] = {}
    for c in colls:
        comm[c.kind] = comm.get(c.kind, 0.0) + _seconds(c, lay, acc)
    bubble = (shape["pp"] - 1) / (lay.stages_per_rank * lay.grad_accum) if shape["pp"] > 1 else 0.0
    total_comm = sum(comm.values())
    return {"compute (at peak)": compute, **{f"comm {k}": v for k, v in comm.items()},
            "pipeline bubble": compute * bubble,
            "step, no overlap": compute * (1 + bubble) + total_comm,
            "step, full overlap": max(compute * (1 + bubble), total_comm),
            "mfu at no overlap": compute / (compute * (1 + bubble) + total_comm)}


def report(p: Plan, acc: Accelerator, name: str) -> str:
    lay, sh = p.layout, p.shape
    lines = [f"plan: {name} on {lay.gpus} x {acc.name} ({lay.gpus_per_node} per node): "
             f"pp {sh['pp']} x dp {sh['dp']} x ep {sh['ep']} x tp {sh['tp']}, schedule {lay.schedule}"
             + (f" x{lay.stages_per_rank}" if lay.stages_per_rank > 1 else ""),
             f"  batch: {lay.micro_batch} x {lay.seq_len} tokens per micro-batch per data rank, {lay.grad_accum} "
             f"micro-batches -> {p.tokens_per_step:,} tokens per step",
             f"  parameters: {p.params_total:,} total; stored per GPU (FSDP shard) by pipeline rank: "
             + ", ".join(f"{n / 1e9:.2f}B" for n in p.params_per_rank),
             "  memory per GPU (busiest pipeline rank), GB:"]
    lines += [f"    {k:<52} {v:10.2f}" for k, v in p.memory_gb.items()]
    base = sum(v for k, v in p.memory_gb.items() if not k.startswith("activations"))
    for k in ("activations (no checkpointing)", "activations (checkpointing)"):
        lines.append(f"    {'total with ' + k:<52} {base + p.memory_gb[k]:10.2f}  (HBM {acc.hbm_gb:.0f})")
    lines.append("  communication per GPU per step (elements fed in; GB as sent: bf16, reductions fp32):")
    lines += [f"    {k:<16} {v:16,.0f}  {p.comm_gb[k]:10.2f} GB" for k, v in p.comm_elems.items()]
    lines.append("  time per step (roofline), s:")
    lines += [f"    {k:<24} {v:10.3f}" if not k.startswith("mfu") else f"    {k:<24} {v:10.1%}"
              for k, v in p.time_s.items()]
    return "\n".join(lines)
