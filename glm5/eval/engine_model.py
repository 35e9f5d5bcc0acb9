"""`EngineModel`: a glm5 checkpoint (or preset) evaluated through the inference engine's public API.

Requests are submitted in batches and the engine's continuous batching runs them together. Scoring
shares work between requests with the same context: when every continuation of a context is one token
(multiple choice with letter answers, the common case), the context runs once and the engine returns
the log-probs and ranks of just those tokens (`logprob_token_ids`, no whole-vocabulary dict) to score
all of its choices; and the prefix that a batch of contexts shares (the subject line and few-shot
examples) is computed once and served from the engine's prefix cache. Longer continuations are scored
from prompt log-probs (`prompt_logprobs=0`: the log-prob and rank of each prompt token); the engine
computes those without its prefix cache, since it needs logits at every prompt position.
"""

from __future__ import annotations

from glm5.infer.llm import LLM
from glm5.infer.sampling import SamplingParams

from .lm import EvalModel, GenerationParams, Score, TokenPair, cut_at_stop


class EngineModel(EvalModel):
    def __init__(self, model: str, *, max_length: int = 2048, batch_size: int = 64, name: str | None = None,
                 share_prefix: bool = True, add_special_tokens: bool = True, llm: LLM | None = None,
                 **engine_options):
        """`model`: checkpoint directory or preset; `batch_size`: requests handed to the engine at once;
        `engine_options`: EngineConfig fields (device, dtype, max_num_seqs, ...)."""
        engine_options.setdefault("max_num_seqs", batch_size)
        self.llm = llm or LLM(model, max_model_len=max_length + 2, **engine_options)
        if self.llm.tokenizer is None:
            raise ValueError(f"{model}: no tokenizer found next to the checkpoint; the harness needs one")
        self.tokenizer = self.llm.tokenizer
        self.prefix_token_id = self.llm.engine.eos_token_ids[0]
        self.max_length, self.batch_size, self.share_prefix = max_length, batch_size, share_prefix
        self.add_special_tokens = add_special_tokens
        self.name = name or model

    # ---- scoring --------------------------------------------------------------------------------
    def score(self, pairs: list[TokenPair]) -> list[Score]:
        results: list[Score | None] = [None] * len(pairs)
        by_context: dict[tuple[int, ...], list[int]] = {}
        multi: list[int] = []
        for i, (ctx, cont) in enumerate(pairs):
            if self.share_prefix and len(cont) == 1:
                by_context.setdefault(tuple(ctx), []).append(i)
            else:
                multi.append(i)
        self._score_next_token(pairs, by_context, results)
        self._score_prompts(pairs, multi, results)
        return results  # type: ignore[return-value]

    def _score_next_token(self, pairs, by_context: dict[tuple[int, ...], list[int]], results) -> None:
        """One request per distinct context; its next-token distribution scores each 1-token choice.
        Contexts go in sorted order and each batch's common prefix (few-shot examples, the subject line)
        is run once first, so the engine's prefix cache serves it to the whole batch."""
        contexts = sorted(by_context)
        for start in range(0, len(contexts), self.batch_size):
            batch = contexts[start:start + self.batch_size]
            shared = common_prefix(batch)
            if len(batch) > 1 and len(shared) >= 2 * self.llm.engine.config.block_size:
                self.llm.generate([list(shared)], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            # ask only for the choices' log-probs (and ranks), not a whole-vocabulary dict per context
            params = [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                                     logprob_token_ids=sorted({pairs[i][1][0] for i in by_context[ctx]}))
                      for ctx in batch]
            for ctx, out in zip(batch, self.llm.generate([list(c) for c in batch], params)):
                dist = out.outputs[0].logprobs[0]  # {token id: Logprob}: the choices (+ the argmax)
                for i in by_context[ctx]:
                    entry = dist[pairs[i][1][0]]
                    results[i] = (entry.logprob, entry.rank == 1)

    def _score_prompts(self, pairs, indices: list[int], results) -> None:
        """context + continuation as one prompt; the continuation's prompt log-probs are the score."""
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
        for start in range(0, len(indices), self.batch_size):
            batch = indices[start:start + self.batch_size]
            outs = self.llm.generate([pairs[i][0] + pairs[i][1] for i in batch], params)
            for i, out in zip(batch, outs):
                ctx, cont = pairs[i]
                entries = out.prompt_logprobs[len(ctx):]  # entry p: log-prob of prompt token p
                lps = [e[t] for e, t in zip(entries, cont)]
                results[i] = (sum(e.logprob for e in lps), all(e.rank == 1 for e in lps))

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[str], params: GenerationParams) -> list[list[str]]:
        room = self.max_length + 2 - params.max_tokens  # prompt tokens that fit with the new ones
        if room < 1:
            raise ValueError(f"max_tokens={params.max_tokens} leaves no room for a prompt in "
                             f"max_length={self.max_length}")
        ids = [self.prompt_ids(p, params.chat)[-room:] for p in prompts]
        if params.beam_width > 1:  # the engine's beam search (LLM.beam_search); stop strings cut afterwards
            sp = SamplingParams(temperature=0, max_tokens=params.max_tokens, use_beam_search=True,
                                beam_width=params.beam_width)
            per = max(1, self.batch_size // params.beam_width)  # prompts searched together: batch_size beams
            return [[cut_at_stop(c.text, params.stop) for c in o.outputs[:params.n]]
                    for start in range(0, len(ids), per) for o in self.llm.beam_search(ids[start:start + per], sp)]
        sp = SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                            max_tokens=params.max_tokens, stop=list(params.stop), seed=params.seed,
                            temperature_schedule=params.temperature_schedule)
        texts = []
        for start in range(0, len(ids), self.batch_size):
            outs = self.llm.generate(ids[start:start + self.batch_size], sp)
            texts += [[c.text for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]
        return texts


def common_prefix(seqs: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Longest common prefix of token sequences (sorted input: the first and last bound it)."""
    first, last = min(seqs), max(seqs)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]
