"""MTP speculative decoding: draft k tokens with the model's MTP layer, verify them in one target pass.
The MTP layer runs through the model's own `forward_mtp` (paged, on its own cache layer); verification
uses the engine Sampler's distribution (`Sampler.probs`), so drafting and verifying add no second copy
of the layer or of the sampling rules.

The MTP layer at position p reads (embedding of token p+1, main hidden h_p) and predicts token p+2; it
has its own cache layer. After each step it runs over exactly the positions the main pass kept
(accepted tokens), with the now-known next tokens, so its cache is valid wherever the main cache is.
Its output at the last kept position gives draft 1; drafts 2..k chain the layer on its own normed
output as the hidden state (DeepSeek's recursive MTP), writing provisional cache rows that the next
step overwrites. Drafts are greedy (a one-hot draft distribution), so verification is exact for
greedy requests (accept while draft == target argmax) and distribution-preserving for sampled ones
(`spec_verify`: accept d with prob p(d), else resample from p without d).

With prompt lookup on (`prompt_lookup_max` > 0), a draft is replaced by the token that followed the
latest earlier occurrence of the request's last n tokens (drafts so far included; longest n first, down
to `prompt_lookup_min`) when there is one: answers copy names and phrases from their prompt, which one
MTP layer rarely predicts (vLLM's `ngram` method, here as a correction of the MTP drafts). The chained MTP
step then reads the chosen token. Verification is the same, so the output is too.

Dims: N flat tokens, H hidden, V vocab, k drafts.
"""

from __future__ import annotations

import torch

from .input_batch import SeqChunk
from .sampling import SamplingRow, spec_verify


def prompt_lookup(tokens: list[int], n_min: int, n_max: int) -> int | None:
    """The token after the latest earlier occurrence of `tokens`' last n tokens, for the longest n in
    [n_min, n_max] that occurs; None when none does."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:]
        last = suffix[-1]
        for end in range(size - 2, n - 2, -1):  # candidate occurrence tokens[end - n + 1 : end + 1]
            if tokens[end] == last and tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1]
    return None


class MTPProposer:
    def __init__(self, runner, num_drafts: int, prompt_lookup_range: tuple[int, int] = (2, 0)):
        self.runner, self.k = runner, num_drafts
        self.lookup_min, self.lookup_max = prompt_lookup_range  # lookup_max 0 = off
        self.lookup_drafts = 0  # drafts prompt lookup changed (found a token other than the MTP layer's)
        self.proposed = [0] * num_drafts  # drafts verified at each draft position
        self.accepted = [0] * num_drafts
        self.num_drafts = 0  # verifications of a non-empty draft (vLLM's spec_decode_num_drafts)

    # ---- drafting ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def mtp_forward(self, chunks: list[SeqChunk], hidden: torch.Tensor, rows: torch.Tensor) -> tuple:
        """MTP layer over chunks whose token ids are the *next* tokens; hidden [N, H] -> (logits at
        `rows` [R, V], normed output [N, H])."""
        ids, meta = self.runner.metadata(chunks)
        meta.logits_indices = rows
        out = self.runner.model.forward_mtp(ids[None], hidden[None], meta, self.runner.cache)
        return out.logits[0], out.hidden_states[0]

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
                drafting.append((len(chunks) - 1, req, s.start + kept - 1, seq[:s.start + kept + 1]))
        if not chunks:
            return {}
        ends = [sum(c.num_tokens for c in chunks[: j + 1]) - 1 for j, _, _, _ in drafting]
        logits, z = self.mtp_forward(chunks, hidden[torch.tensor(rows, device=hidden.device)],
                                     torch.tensor(ends, dtype=torch.long, device=hidden.device))
        return self._chain(logits, z[ends], drafting)

    def _chain(self, logits: torch.Tensor, z: torch.Tensor, drafting) -> dict[str, list[int]]:
        """logits [R, V] / z [R, H]: MTP output at each drafting request's last kept position -> k greedy
        drafts each; drafts 2..k run the layer on its own output (DeepSeek's recursive MTP)."""
        r = self.runner
        drafts = {req.request_id: [] for _, req, _, _ in drafting}
        pos = [p for _, _, p, _ in drafting]
        live = list(range(len(drafting)))
        for j in range(self.k):
            tok = logits.argmax(-1).tolist()  # [R]
            for n, i in enumerate(live):
                mine = drafts[drafting[i][1].request_id]
                if self.lookup_max:
                    found = prompt_lookup(drafting[i][3] + mine, self.lookup_min, self.lookup_max)
                    if found is not None:
                        self.lookup_drafts += int(found != tok[n])
                        tok[n] = found
                mine.append(tok[n])
            if j == self.k - 1:
                break
            # next MTP position p+1 reads (draft, z_p); only where a slot exists for it
            keep = [n for n, i in enumerate(live)
                    if (pos[i] + 1) // r.block_size < len(drafting[i][1].block_ids)]
            if not keep:
                break
            chunks = [SeqChunk(drafting[live[n]][1].request_id, pos[live[n]] + 1, [tok[n]],
                               drafting[live[n]][1].block_ids) for n in keep]
            every = torch.arange(len(keep), device=z.device)
            logits, z = self.mtp_forward(chunks, z[torch.tensor(keep, device=z.device)], every)
            live = [live[n] for n in keep]
            for i in live:
                pos[i] += 1
        return drafts

    # ---- verification -----------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, rows: list[SamplingRow], s) -> list[int]:
        """logits [k+1, V] at the draft positions and the bonus position -> accepted drafts + 1 token."""
        drafts = list(s.spec_token_ids)
        req = s.request
        sampler = self.runner.sampler
        probs = sampler.probs(logits, rows)  # [k+1, V]: one-hot at the argmax for greedy rows
        if all(row.params.temperature_at(len(row.output_token_ids)) == 0 for row in rows):
            out = spec_verify(probs, None, drafts, greedy=True)
        else:
            gen = req.generator if req.generator is not None else sampler.generator
            out = spec_verify(probs, None, drafts, generator=gen)
        n_acc = len(out) - 1
        self.num_drafts += int(bool(drafts))
        for i in range(len(drafts)):
            self.proposed[i] += 1
            self.accepted[i] += int(i < n_acc)
        return out

    def stats(self) -> dict:
        rates = [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]
        total = sum(self.proposed)
        return {"spec_num_draft_tokens": total, "spec_num_accepted_tokens": sum(self.accepted),
                "spec_acceptance_rate": sum(self.accepted) / total if total else 0.0,
                "spec_acceptance_per_position": rates, "spec_num_lookup_draft_tokens": self.lookup_drafts,
                "spec_num_drafts": self.num_drafts, "spec_num_accepted_tokens_per_pos": list(self.accepted)}
