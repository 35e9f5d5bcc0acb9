"""`BeamSearch`: the beam bookkeeping for one prompt, driven step by step by the engine.

The engine runs the model on every live beam (prompt + `beam.token_ids`; the prefix cache shares the
common blocks), passes the next-token logprobs to `step`, and repeats until `done`. Semantics follow
HF transformers (v5 `_beam_search`): keep the top 2 * width candidates per step (more with several
EOS ids); a candidate ending in EOS or reaching max_tokens finishes with score
sum_logprob / generated_len ** length_penalty (EOS counted in the length) if it ranks in the top
`width`; the best `width` unfinished candidates continue. `early_stopping`: True stops once `width`
hypotheses are finished; False stops when the best running beam, scored at its current length, cannot
beat the worst kept hypothesis; "never" scores it at max length when length_penalty > 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from .outputs import CompletionOutput, RequestOutput
from .sampling import SamplingParams


@dataclass
class Beam:
    token_ids: list[int] = field(default_factory=list)  # generated tokens (EOS included when finished)
    sum_logprob: float = 0.0
    score: float = 0.0  # length-penalised, for finished beams


class BeamSearch:
    def __init__(self, beam_width: int, max_tokens: int, eos_token_ids=(), length_penalty: float = 1.0,
                 early_stopping: bool | Literal["never"] = False):
        if beam_width < 1 or max_tokens < 1:
            raise ValueError(f"beam_width and max_tokens must be >= 1, got {beam_width}, {max_tokens}")
        self.width, self.max_tokens = beam_width, max_tokens
        self.eos_token_ids = set(eos_token_ids)
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.beams = [Beam()]  # live beams; the engine computes one logprob row per beam, in this order
        self.finished: list[Beam] = []  # best first, at most `width`
        self.done = False
        self._improvable = True  # HF's early-stop heuristic, updated after each step

    def step(self, logprobs: torch.Tensor) -> list[int]:
        """logprobs [len(beams), V] for the next token of each live beam. Returns, for each new live beam,
        the index of the beam it extends (so the engine can reuse that beam's cache)."""
        assert not self.done and logprobs.shape[0] == len(self.beams)
        vocab = logprobs.shape[1]
        num_gen = len(self.beams[0].token_ids) + 1  # generated length after this step
        totals = torch.tensor([b.sum_logprob for b in self.beams])[:, None] + logprobs.float().cpu()
        k = min(max(2, 1 + len(self.eos_token_ids)) * self.width, totals.numel())
        top, flat = totals.flatten().topk(k)  # [K] best continuations over all beams
        # like HF, whether finished hypotheses may still be added is decided once per step
        accepting = self._improvable and not (len(self.finished) == self.width and self.early_stopping is True)
        running, parents, hits, new_finished = [], [], [], []
        for rank, (total, idx) in enumerate(zip(top.tolist(), flat.tolist())):
            parent, token = divmod(idx, vocab)
            beam = Beam(self.beams[parent].token_ids + [token], total)
            hit = token in self.eos_token_ids or num_gen >= self.max_tokens
            hits.append(hit)
            if hit and rank < self.width and accepting:
                beam.score = total / num_gen ** self.length_penalty
                new_finished.append(beam)
            elif not hit and len(running) < self.width:
                running.append(beam)
                parents.append(parent)
        self.finished = sorted(self.finished + new_finished, key=lambda b: -b.score)[: self.width]
        self.beams = running
        self._update_done(all(hits), num_gen)
        return parents

    def _update_done(self, all_hit: bool, num_gen: int) -> None:
        full = len(self.finished) == self.width
        if full and self.beams:
            length = self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else num_gen
            best_running = max(b.sum_logprob for b in self.beams) / length ** self.length_penalty
            self._improvable = self._improvable and best_running > self.finished[-1].score
        self.done = (not self._improvable or (full and self.early_stopping is True) or all_hit
                     or not self.beams)

    def results(self, num: int | None = None) -> list[Beam]:
        """The best finished hypotheses, best first."""
        return self.finished[: num or self.width]

    # ---- driving it: the same two calls for `LLM.beam_search` and the server ---------------------------
    def step_params(self) -> SamplingParams:
        """Params of the one-token request run for each live beam: greedy, top logprobs enough to rank."""
        k = max(2, 1 + len(self.eos_token_ids)) * self.width
        return SamplingParams(temperature=0, max_tokens=1, logprobs=k, ignore_eos=True)

    def step_outputs(self, outs: list[RequestOutput], vocab_size: int) -> None:
        """`step` from the finished one-token requests of the live beams (in `beams` order)."""
        rows = torch.full((len(outs), vocab_size), float("-inf"))
        for r, o in enumerate(outs):
            for tok, lp in o.outputs[0].logprobs[0].items():
                rows[r, tok] = lp.logprob
        self.step(rows)

    def completions(self, num: int | None, decode: Callable[[list[int]], str] | None) -> list[CompletionOutput]:
        """The best `num` hypotheses as completion outputs ("stop" when they end in EOS, else "length")."""
        outs = []
        for i, b in enumerate(self.results(num)):
            text = decode(b.token_ids) if decode else ""
            reason = "stop" if b.token_ids and b.token_ids[-1] in self.eos_token_ids else "length"
            outs.append(CompletionOutput(i, text, b.token_ids, b.sum_logprob, None, reason))
        return outs
