"""MTP speculative decoding: draft k tokens with the model's MTP layer, verify them in one target pass.

The MTP layer at position p reads (embedding of token p+1, main hidden h_p) and predicts token p+2; it
has its own cache layer. After each step it runs over exactly the positions the main pass kept
(accepted tokens), with the now-known next tokens, so its cache is valid wherever the main cache is.
Its output at the last kept position gives draft 1; drafts 2..k chain the layer on its own normed
output as the hidden state (DeepSeek's recursive MTP), writing provisional cache rows that the next
step overwrites. Drafts are greedy (a one-hot draft distribution), so verification is exact for
greedy requests (accept while draft == target argmax) and distribution-preserving for sampled ones
(`spec_verify`: accept d with prob p(d), else resample from p without d).

Dims: N flat tokens, H hidden, V vocab, k drafts.
"""

from __future__ import annotations

import torch

from .paged_attention import SeqChunk
from .sampling import SamplingRow, apply_min_p, apply_min_tokens, apply_penalties, apply_top_k_top_p, spec_verify


class MTPProposer:
    def __init__(self, runner, num_drafts: int):
        self.runner, self.k = runner, num_drafts
        model = runner.model
        self.layer = model.model.mtp_layers[0]
        self.cache_layer = model.config.num_hidden_layers
        self.proposed = [0] * num_drafts  # drafts verified at each draft position
        self.accepted = [0] * num_drafts

    # ---- drafting ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def mtp_forward(self, chunks: list[SeqChunk], hidden: torch.Tensor) -> torch.Tensor:
        """MTP layer over chunks whose token ids are the *next* tokens; hidden [N, H] -> normed [N, H]."""
        r = self.runner
        meta = r.metadata(chunks)
        emb = r.model.model.embed_tokens(meta.input_ids)[None]  # [1, N, H]
        z = self.layer.eh_proj(torch.cat([self.layer.enorm(emb), self.layer.hnorm(hidden[None])], dim=-1))
        cos, sin = r.rope(meta)
        z = r.layer_forward(self.cache_layer, self.layer, z, cos, sin, meta, {})
        return self.layer.shared_head.norm(z)[0]

    def propose(self, out, meta, hidden: torch.Tensor, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Refresh the MTP cache over the kept positions, then draft k tokens for requests that sampled."""
        chunks, rows, drafting = [], [], []
        for i, s in enumerate(out.scheduled):
            req = s.request
            toks = sampled.get(req.request_id) if s.samples else None
            kept = s.num_tokens - (len(s.spec_token_ids) + 1 - len(toks)) if toks else s.num_tokens
            seq = req.all_token_ids + (toks or [])  # tokens after this step's update
            nxt = seq[s.start + 1:s.start + kept + 1]
            if len(nxt) < kept:
                kept = len(nxt)  # a chunk whose next token is still unknown (cannot happen: kept safe)
            if kept == 0:
                continue
            chunks.append(SeqChunk(req.request_id, s.start, nxt, req.block_ids))
            q0 = meta.query_start[i]
            rows.extend(range(q0, q0 + kept))
            if toks:
                drafting.append((len(chunks) - 1, req, s.start + kept - 1))
        if not chunks:
            return {}
        z = self.mtp_forward(chunks, hidden[torch.tensor(rows, device=hidden.device)])
        ends = torch.tensor([sum(c.num_tokens for c in chunks[: j + 1]) - 1 for j, _, _ in drafting], dtype=torch.long)
        return self._chain(z[ends.to(z.device)], drafting)

    def _chain(self, z: torch.Tensor, drafting) -> dict[str, list[int]]:
        """z [R, H]: MTP outputs at each drafting request's last kept position -> k greedy drafts each."""
        r = self.runner
        drafts = {req.request_id: [] for _, req, _ in drafting}
        pos = [p for _, _, p in drafting]
        live = list(range(len(drafting)))
        for j in range(self.k):
            tok = r.logits(z).argmax(-1).tolist()  # [R]
            for n, i in enumerate(live):
                drafts[drafting[i][1].request_id].append(tok[n])
            if j == self.k - 1:
                break
            # next MTP position p+1 reads (draft, z_p); only where a slot exists for it
            keep = [n for n, i in enumerate(live)
                    if (pos[i] + 1) // r.block_size < len(drafting[i][1].block_ids)]
            if not keep:
                break
            chunks = [SeqChunk(drafting[live[n]][1].request_id, pos[live[n]] + 1, [tok[n]],
                               drafting[live[n]][1].block_ids) for n in keep]
            z = self.mtp_forward(chunks, z[torch.tensor(keep, device=z.device)])
            live = [live[n] for n in keep]
            for i in live:
                pos[i] += 1
        return drafts

    # ---- verification -----------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, rows: list[SamplingRow], s) -> list[int]:
        """logits [k+1, V] at the draft positions and the bonus position -> accepted drafts + 1 token."""
        drafts = list(s.spec_token_ids)
        req = s.request
        x = apply_penalties(apply_min_tokens(logits.float().clone(), rows), rows)
        temps = [row.params.temperature_at(len(row.output_token_ids)) for row in rows]
        if all(t == 0 for t in temps):
            out = spec_verify(torch.softmax(x, dim=-1), None, drafts, greedy=True)
        else:
            probs = target_probs(x, temps, rows)
            gen = req.generator if req.generator is not None else self.runner.sampler.generator
            out = spec_verify(probs, None, drafts, generator=gen)
        n_acc = len(out) - 1
        for i in range(len(drafts)):
            self.proposed[i] += 1
            self.accepted[i] += int(i < n_acc)
        return out

    def stats(self) -> dict:
        rates = [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]
        total = sum(self.proposed)
        return {"spec_num_draft_tokens": total, "spec_num_accepted_tokens": sum(self.accepted),
                "spec_acceptance_rate": sum(self.accepted) / total if total else 0.0,
                "spec_acceptance_per_position": rates}


def target_probs(x: torch.Tensor, temps: list[float], rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution the Sampler draws from, per row: temperature, min-p, top-k, top-p, softmax
    (x already has min-tokens masking and penalties). Temperature-0 rows are one-hot at the argmax."""
    greedy = torch.tensor([t == 0 for t in temps], device=x.device)
    t = torch.tensor([t if t > 0 else 1.0 for t in temps], device=x.device)
    y = apply_min_p(x / t[:, None], torch.tensor([r.params.min_p for r in rows], device=x.device))
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else x.shape[1] for r in rows], device=x.device)
    top_p = torch.tensor([r.params.top_p for r in rows], device=x.device)
    probs = torch.softmax(apply_top_k_top_p(y, top_k, top_p), dim=-1)  # [k+1, V]
    onehot = torch.nn.functional.one_hot(x.argmax(-1), x.shape[1]).to(probs.dtype)
    return torch.where(greedy[:, None], onehot, probs)
