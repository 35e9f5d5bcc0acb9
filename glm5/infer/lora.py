"""Multi-LoRA serving (S-LoRA / Punica style): many PEFT adapters and the base model in one batch.

`LoRAManager` owns `max_loras` adapter slots. Loading an adapter (checked against the served model by
`glm5.model.peft_adapter.read_adapter`) writes its A/B matrices into per-target stacks, zero-padded to
`max_lora_rank` with the scale folded into B, swapping the targeted modules on first use:
  * called nn.Linear modules -> `MultiLoRALinear`: y = W x + B_s (A_s x) with s the row's slot. Few rows
    (decode): every row goes through all slots' A in one matmul, the other slots' columns are zeroed and
    one matmul with all B's adds the row's own term (cheaper on CPU than gathering per-row A/B, Punica's
    BGMV: 0.69-0.71x vs 0.61-0.63x of base-only throughput in bench/finetune.py serve); many rows
    (prefill): one gather / matmul pair / index_add per adapter present (S-LoRA's segments). The base
    rows point at an extra all-zero slot;
  * `kv_b_proj`, read as a matrix by absorbed MLA, -> the attention gets `MultiLoRAAttention`, whose
    `absorb_q` / `latent_to_output` add the per-row low-rank terms (q . (W_uk + B A) = q . W_uk + (q B) A),
    the same way (all slots masked for few rows, a loop over slots for many);
  * routed experts -> `MultiLoRAExperts`: the base model's grouped matmuls with each row's adapter term
    gathered per (slot, expert) for decode-sized batches; the expert loop with per-row terms above that.
Which rows use which slot comes from the model's own attention metadata (`AttnMetadata.adapter_ids`,
-1 = base; the runner fills it from each request's adapter): a forward pre-hook copies it into the
`AdapterBatch` the swapped modules read, and clears it after the forward. Without metadata (training,
`generate_greedy`) every row is the base model. The MTP layer and lm_head are never adapted, and
`indexer.weights_proj` (read as a matrix inside the indexer) cannot take per-row adapters: such adapters
are refused by name; serve them merged (`glm5 merge`).

Dims: N flat tokens, S slots, R max_lora_rank, E experts, H heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from glm5.core.io import all_finite
from glm5.model.attention import MLAttention
from glm5.model.lora import WrappedLinear
from glm5.model.moe import Experts, grouped_experts, sort_by_expert
from glm5.model.peft_adapter import AdapterError, AdapterWeights, read_adapter

from .experts import VersionedExperts

UNSERVABLE = ("indexer.weights_proj", "lm_head")  # read as matrices, or shared with MTP: merge instead


GATHER_ROWS = 64  # up to this many rows, every slot at once with the others masked; above, a loop over slots
GROUPED_ROWS = 1024  # routed experts: up to this many token-expert rows, grouped matmuls + a per-row gather


@dataclass
class AdapterBatch:
    """The slot of every flat token of the running forward (None = no adapters in this forward)."""

    ids: torch.Tensor | None = None  # [N] slot per token, -1 = base
    gather_ids: torch.Tensor | None = None  # [N] the same with -1 -> the all-zero slot (index num_slots)
    active: list[int] = field(default_factory=list)  # slots present in `ids`

    def rows(self, slot: int) -> torch.Tensor:
        return (self.ids == slot).nonzero()[:, 0]


def lowrank_masked(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The same as `lowrank_rows` for few slots, without gathering per-row matrices: every row goes
    through every slot's A in one matmul ([n, S*R]), the other slots' columns are zeroed, and one matmul
    with all the B's sums the row's own term. S*R extra columns per row instead of n [R, in] copies."""
    S, R = A.shape[0], A.shape[1]
    t = x @ A.reshape(S * R, -1).T  # [n, S*R]
    own = slots[:, None] == torch.arange(S, device=x.device).repeat_interleave(R)[None]  # [n, S*R]
    # `where`, not a product with the mask: another slot's overflowing term (inf) times 0 would be NaN
    return torch.einsum("nsr,sor->no", torch.where(own, t, 0).view(-1, S, R), B)  # [n, out]


def lowrank_rows(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Per-row B[s] (A[s] x) for rows x [n, in] with slots [n] into stacks A [S+1, R, in], B [S+1, out, R]."""
    t = torch.bmm(A[slots], x[:, :, None])  # [n, R, 1]
    return torch.bmm(B[slots], t)[:, :, 0]  # [n, out]


class MultiLoRALinear(WrappedLinear):
    """base_layer(x) + per-row B_s A_s x for the slot s of each row (`lora_A` [S, R, in], `lora_B`
    [S, out, R], scale folded into B; an unused slot is zeros)."""

    def __init__(self, base: nn.Linear, batch: AdapterBatch, num_slots: int, rank: int):
        super().__init__()
        self.base_layer, self.batch = base, batch
        w = base.weight
        # num_slots + 1: the last slot stays zero and stands for the base model in gathers
        self.register_buffer("lora_A", torch.zeros(num_slots + 1, rank, w.shape[1], dtype=w.dtype, device=w.device))
        self.register_buffer("lora_B", torch.zeros(num_slots + 1, w.shape[0], rank, dtype=w.dtype, device=w.device))

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight  # matrix readers see the base (kv_b_proj: MultiLoRAAttention adds rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        ids = self.batch.ids
        if ids is None:
            return y
        xf, yf = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])  # [N, in], [N, out] (views)
        if xf.shape[0] != ids.shape[0]:
            raise RuntimeError(f"multi-LoRA: {xf.shape[0]} rows but {ids.shape[0]} adapter ids")
        if xf.shape[0] <= GATHER_ROWS:
            yf += lowrank_masked(xf, self.lora_A, self.lora_B, self.batch.gather_ids)
            return y
        for s in self.batch.active:
            rows = self.batch.rows(s)
            yf.index_add_(0, rows, (xf[rows] @ self.lora_A[s].T) @ self.lora_B[s].T)
        return y


class MultiLoRAAttention(MLAttention):
    """Absorbed MLA with per-row `kv_b_proj` adapters (class swap; see the module docstring). The
    adapter stacks live on the `kv_b_proj` MultiLoRALinear."""

    def _kvb_lora(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> A [R, kv_rank], B_uk [H, E, R], B_uv [H, V, R] of one slot."""
        kvb = self.kv_b_proj
        B = kvb.lora_B[slot].view(self.n_heads, self.nope + self.v_dim, -1)  # [H, E+V, R]
        return kvb.lora_A[slot], B[:, : self.nope], B[:, self.nope:]

    def _all_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every slot at once (the few-slot decode path): A [S, R, kv_rank], B_uk [S, H, E, R],
        B_uv [S, H, V, R] and own [N, S] (row n's slot)."""
        kvb = self.kv_b_proj
        S = kvb.lora_A.shape[0]
        B = kvb.lora_B.view(S, self.n_heads, self.nope + self.v_dim, -1)  # [S, H, E+V, R]
        own = kvb.batch.gather_ids[:, None] == torch.arange(S, device=B.device)[None]  # [N, S]
        return kvb.lora_A, B[:, :, : self.nope], B[:, :, self.nope:], own

    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        out = super().absorb_q(q_nope)  # [.., H, kv_rank]
        batch = self.kv_b_proj.batch
        if batch.ids is None:
            return out
        q, o = q_nope.reshape(-1, *q_nope.shape[-2:]), out.reshape(-1, *out.shape[-2:])  # [N, H, E], [N, H, K]
        if q.shape[0] <= GATHER_ROWS:  # few rows: all slots in two einsums, other slots' terms set to 0
            # (by `where`: a product with the mask would turn another slot's overflow, inf * 0, into NaN)
            A, B_uk, _, own = self._all_slots()
            t = torch.where(own[:, None, :, None], torch.einsum("nhe,sher->nhsr", q, B_uk), 0)  # [N, H, S, R]
            o += torch.einsum("nhsr,srk->nhk", t, A)
            return out
        for s in batch.active:
            rows = batch.rows(s)
            A, B_uk, _ = self._kvb_lora(s)
            t = torch.einsum("nhe,her->nhr", q[rows], B_uk)  # (q B_uk)
            o.index_add_(0, rows, t @ A)  # [n, H, kv_rank]
        return out

    def latent_to_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        _, w_uv = self._kv_b()
        o = torch.einsum("...hr,hvr->...hv", o_lat, w_uv)  # [.., H, V] (as the base class)
        batch = self.kv_b_proj.batch
        if batch.ids is not None:
            lat, of = o_lat.reshape(-1, *o_lat.shape[-2:]), o.reshape(-1, *o.shape[-2:])  # [N, H, K], [N, H, V]
            if lat.shape[0] <= GATHER_ROWS:  # few rows: all slots in two einsums, other slots masked
                A, _, B_uv, own = self._all_slots()
                u = torch.where(own[:, None, :, None], torch.einsum("nhk,srk->nhsr", lat, A), 0)  # [N, H, S, R]
                of += torch.einsum("nhsr,shvr->nhv", u, B_uv)
            else:
                for s in batch.active:
                    rows = batch.rows(s)
                    A, _, B_uv = self._kvb_lora(s)
                    of.index_add_(0, rows, torch.einsum("nhr,hvr->nhv", lat[rows] @ A.T, B_uv))
        return self.o_proj(o.flatten(-2))


class MultiLoRAExperts(Experts):
    """Routed experts with per-row adapters (class swap). Stacks per fused weight: `lora_A_<p>`
    [S, E, R, in], `lora_B_<p>` [S, E, out, R] for p in gate_up_proj, down_proj."""

    batch: AdapterBatch

    def forward(self, x, idx, weights, keep=None):
        ids = self.batch.ids
        if ids is None:
            return super().forward(x, idx, weights, keep)
        if not torch.is_grad_enabled() and not x.is_cuda and idx.numel() <= GROUPED_ROWS:
            # decode-sized batches: the base model's grouped matmuls + each row's adapter term, gathered
            # per (slot, expert) of the row ([M, R, in] stacks: ~1 MB per layer at 128 rows, rank 16)
            flat, E = idx.reshape(-1), self.n_experts
            gu, dn = self.gate_up_proj, self.down_proj

            def delta(param: str, rows_in: torch.Tensor, order: torch.Tensor) -> torch.Tensor | None:
                A, B = getattr(self, f"lora_A_{param}", None), getattr(self, f"lora_B_{param}", None)
                if A is None:
                    return None
                slot = self.batch.gather_ids.index_select(0, order // idx.shape[1])  # [M]
                pick = slot * E + flat.index_select(0, order)  # [M] into the flattened (slot, expert) stacks
                return lowrank_rows(rows_in, A.flatten(0, 1), B.flatten(0, 1), pick)

            return grouped_experts(x, idx, weights, keep, gu, dn, delta)
        order, token, counts = sort_by_expert(idx, self.n_experts, keep)
        xs, slots = x[token], self.batch.gather_ids[token]  # [M, H], [M] (base rows: the zero slot)
        gu, dn = self.gate_up_proj, self.down_proj
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                xe, se = xs[start:start + n], slots[start:start + n]
                h = self._lora(F.linear(xe, gu[e]), xe, se, e, "gate_up_proj")
                gate, up = h.chunk(2, dim=-1)
                a = F.silu(gate) * up
                outs.append(self._lora(F.linear(a, dn[e]), a, se, e, "down_proj"))
                start += n
        ys = torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)

    def _lora(self, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, e: int, param: str) -> torch.Tensor:
        """y [n, out] + each row's adapter term for expert e (rows x [n, in], slots [n])."""
        A, B = getattr(self, f"lora_A_{param}", None), getattr(self, f"lora_B_{param}", None)
        if A is None:
            return y
        if x.shape[0] <= GATHER_ROWS:
            return y + lowrank_rows(x, A[:, e], B[:, e], slots)
        for s in self.batch.active:
            rows = (slots == s).nonzero()[:, 0]
            if rows.numel():
                y = y.index_add(0, rows, (x[rows] @ A[s, e].T) @ B[s, e].T)
        return y


class LoRAManager:
    """The engine's adapter slots (see the module docstring). Not thread-safe: call between steps."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int):
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        self.model, self.num_slots, self.rank = model, max_loras, max_lora_rank
        self.batch = AdapterBatch()
        self.slots: dict[str, int] = {}  # name -> slot
        self.paths: dict[str, str] = {}
        self.versions: dict[str, int] = {}  # name -> load counter (prefix-cache salt)
        self._loads = 0
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after)

    # ---- forward hooks: the adapter of every flat token comes from the attention metadata ----------
    def _before(self, module, args, kwargs) -> None:
        meta = kwargs.get("attn_metadata")
        ids = None if meta is None else meta.adapter_ids
        self.batch.ids = ids
        self.batch.gather_ids = None if ids is None else torch.where(ids < 0, self.num_slots, ids)
        self.batch.active = [] if ids is None else [int(s) for s in torch.unique(ids).tolist() if s >= 0]

    def _after(self, module, args, output) -> None:
        self.batch.ids, self.batch.gather_ids, self.batch.active = None, None, []

    # ---- loading ------------------------------------------------------------------------------------
    def load(self, name: str, path: str | Path) -> int:
        """Load the PEFT adapter in `path` as `name`; -> its slot. Errors (AdapterError / ValueError) name
        the problem; nothing changes on error."""
        if name in self.slots:
            raise ValueError(f"an adapter named {name!r} is already loaded (unload it first)")
        free = sorted(set(range(self.num_slots)) - set(self.slots.values()))
        if not free:
            raise ValueError(f"all {self.num_slots} adapter slots are in use (engine max_loras); unload one first")
        _, weights = read_adapter(self.model, path)
        self._check(weights, path)
        slot = free[0]
        for w in weights:
            self._write(slot, w)
        self._loads += 1
        self.slots[name], self.paths[name], self.versions[name] = slot, str(path), self._loads
        return slot

    def unload(self, name: str) -> None:
        slot = self.slots.pop(name)
        self.paths.pop(name)
        self.versions.pop(name)
        for mod in self.model.modules():
            for buf_name, buf in mod.named_buffers(recurse=False):
                if buf_name.startswith("lora_"):
                    buf[slot].zero_()

    def _check(self, weights: list[AdapterWeights], path) -> None:
        dtype = next(self.model.parameters()).dtype
        for w in weights:
            t = w.target
            if not all_finite((w.B * w.scaling).to(dtype)):  # the stacks hold B with the scale folded in
                raise AdapterError(f"{path}: target {t.key!r}: lora_B times the scale {w.scaling:g} overflows "
                                   f"{dtype} (the file's tensors are finite, the served ones would not be)")
            if t.name.endswith(UNSERVABLE):
                raise AdapterError(f"{path}: target {t.key!r} cannot take per-request adapters in the engine "
                                   "(read as a matrix or shared with MTP); serve the merged model (glm5 merge)")
            if t.r > self.rank:
                raise AdapterError(f"{path}: target {t.key!r} has rank {t.r} > the engine's max_lora_rank "
                                   f"{self.rank}")
            mod = self._target(t.name)
            if t.param is not None and not isinstance(mod, Experts):
                raise AdapterError(f"{path}: target {t.key!r} needs the routed experts resident in full precision "
                                   f"(they are {type(mod).__name__}: INT8 or offloaded)")

    @torch.no_grad()
    def _write(self, slot: int, w: AdapterWeights) -> None:
        t, r = w.target, w.target.r
        if t.param is None:
            mod = self._linear(t.name)
            mod.lora_A[slot].zero_()
            mod.lora_B[slot].zero_()
            mod.lora_A[slot, :r] = w.A.to(mod.lora_A.dtype)
            mod.lora_B[slot, :, :r] = (w.B * w.scaling).to(mod.lora_B.dtype)
        else:
            mod = self._experts(t.name)
            A, B = self._expert_stacks(mod, t.param)
            A[slot].zero_()
            B[slot].zero_()
            A[slot, :, :r] = w.A.to(A.dtype)
            B[slot, :, :, :r] = (w.B * w.scaling).to(B.dtype)

    def _linear(self, name: str) -> MultiLoRALinear:
        """The module at `name` as a MultiLoRALinear (swapped in on first use)."""
        mod = self.model.get_submodule(name)
        if isinstance(mod, MultiLoRALinear):
            return mod
        parent_name, _, child = name.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        new = MultiLoRALinear(mod, self.batch, self.num_slots, self.rank)
        setattr(parent, child, new)
        if child == "kv_b_proj" and isinstance(parent, MLAttention):
            parent.__class__ = MultiLoRAAttention  # absorbed MLA reads kv_b_proj as a matrix
        return new

    def _target(self, name: str) -> nn.Module:
        """The module at `name`; for routed experts behind an expert hot swap's `VersionedExperts`, the
        module holding the current weights (adapters apply to those; the held old weights run without)."""
        mod = self.model.get_submodule(name)
        return mod.inner if isinstance(mod, VersionedExperts) else mod

    def _experts(self, name: str) -> MultiLoRAExperts:
        mod = self._target(name)
        if not isinstance(mod, MultiLoRAExperts):
            mod.__class__ = MultiLoRAExperts
            mod.batch = self.batch
        return mod

    def _expert_stacks(self, mod: MultiLoRAExperts, param: str) -> tuple[torch.Tensor, torch.Tensor]:
        if not hasattr(mod, f"lora_A_{param}"):
            E, out_f, in_f = getattr(mod, param).shape
            w = getattr(mod, param)
            mod.register_buffer(f"lora_A_{param}", w.new_zeros(self.num_slots + 1, E, self.rank, in_f))
            mod.register_buffer(f"lora_B_{param}", w.new_zeros(self.num_slots + 1, E, out_f, self.rank))
        return getattr(mod, f"lora_A_{param}"), getattr(mod, f"lora_B_{param}")
