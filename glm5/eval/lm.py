"""What the harness asks of a model, whichever server or checkpoint answers.

`EvalModel` turns text requests into token requests the way lm-evaluation-harness does (so scores are
comparable with lm-eval's): a (context, continuation) pair moves the context's trailing whitespace into
the continuation, encodes context + continuation as one string and splits it at the context's token
count; an empty context becomes the prefix token (end of text); the input is left-truncated to
`max_length` tokens. Rolling log-likelihood (perplexity) scores a text in disjoint windows of
`max_length` tokens, each with as much preceding context as fits. Subclasses implement `score` (token
pairs -> (log p(continuation | context), greedy?)) and `generate`.
Backends: `glm5.eval.engine_model.EngineModel` (a checkpoint through the glm5 engine) and
`glm5.eval.openai_model.OpenAIModel` (any OpenAI-compatible server).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

TokenPair = tuple[list[int], list[int]]  # (context ids, continuation ids)
Score = tuple[float, bool]  # (sum of continuation log-probs, every continuation token was the argmax)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True, kw_only=True)
class GenerationParams:
    max_tokens: int = 256  # new tokens per sample
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    n: int = 1  # samples per prompt
    stop: tuple[str, ...] = ()  # stop strings (not included in the text)
    seed: int | None = None  # sampling seed (per prompt), for reproducible samples
    chat: bool = False  # send each prompt as one user turn through the model's chat template
    beam_width: int = 1  # > 1: beam search (HF semantics; temperature 0), the n best beams returned
    temperature_schedule: tuple[float, float] | None = None  # linear (start, end) temperature over max_tokens


def decoding_fingerprint(p: GenerationParams) -> dict:
    """Every generation option that changes the text (the tasks' resume fingerprints include it)."""
    return {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p, "n": p.n,
            "stop": list(p.stop), "seed": p.seed, "chat": p.chat, "beam_width": p.beam_width,
            "temperature_schedule": list(p.temperature_schedule) if p.temperature_schedule else None}


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """The text up to the first stop string (backends that do not stop on strings themselves)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


class EvalModel(ABC):
    """A model the harness can score and sample. `name` identifies it in results and resume files."""

    name: str
    tokenizer: Tokenizer
    prefix_token_id: int  # stands in for an empty context (lm-eval's end-of-text prefix)
    max_length: int  # tokens the model sees per scored request
    add_special_tokens: bool = True  # the tokenizer's own prefix (GLM: [gMASK]<sop>) on scored text, as lm-eval

    # ---- implemented by backends ----------------------------------------------------------------
    @abstractmethod
    def score(self, pairs: list[TokenPair]) -> list[Score]:
        """log p(continuation | context) and greediness per pair (pairs already fit `max_length`)."""

    @abstractmethod
    def generate(self, prompts: list[str], params: GenerationParams) -> list[list[str]]:
        """`params.n` completions (text after the prompt) per prompt, in prompt order."""

    def prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        """Token ids of a generation prompt: as scored text, or one user turn in the chat template."""
        if not chat:
            return self.encode(prompt)
        render = getattr(self.tokenizer, "apply_chat_template", None)
        if render is None:
            raise ValueError(f"{self.name}: this tokenizer has no chat template (needed for chat prompts)")
        text = render([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template has its own prefix

    # ---- shared: text -> tokens as lm-eval does ---------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Text as scored: with the tokenizer's special prefix unless the text already starts with the
        prefix token (lm-eval's HF rule)."""
        prefix = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
        specials = self.add_special_tokens and not (prefix and text.startswith(prefix))
        return self.tokenizer.encode(text, add_special_tokens=specials)

    def encode_pair(self, context: str, continuation: str) -> TokenPair:
        if not context:
            cont = self.tokenizer.encode(continuation, add_special_tokens=False)
            if cont and cont[0] == self.prefix_token_id:
                return cont[:1], cont[1:]
            return [self.prefix_token_id], cont
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        return ctx, whole[len(ctx):]  # lm-eval's rule: the context encoded alone, where a merge crosses the cut

    def fit(self, ctx: list[int], cont: list[int]) -> TokenPair:
        """Left-truncate so that context + continuation minus the last token is <= max_length tokens
        (the model never needs the last continuation token as input)."""
        if len(cont) > self.max_length:
            raise ValueError(f"a continuation of {len(cont)} tokens does not fit max_length={self.max_length}")
        keep = self.max_length + 1 - len(cont)
        return ctx[-keep:], cont

    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[Score]:
        return self.score([self.fit(*self.encode_pair(c, x)) for c, x in requests])

    def loglikelihood_rolling(self, texts: list[str]) -> list[tuple[float, int]]:
        """(sum of log-probs of every token of the text, number of tokens) per text."""
        pairs, owner = [], []
        counts = []
        for i, text in enumerate(texts):
            tokens = self.encode(text)
            windows = rolling_windows(tokens, self.prefix_token_id, self.max_length)
            pairs += windows
            owner += [i] * len(windows)
            counts.append(len(tokens))
        sums = [0.0] * len(texts)
        for i, (lp, _) in zip(owner, self.score(pairs)):
            sums[i] += lp
        return list(zip(sums, counts))


def rolling_windows(tokens: list[int], prefix_token_id: int, max_length: int) -> list[TokenPair]:
    """Disjoint windows that together predict every token once: the first predicts tokens[:max_length]
    from the prefix token; each later one predicts the next `max_length` tokens (fewer at the end) and
    is given the tokens before them as context, so the model input stays `max_length` long."""
    out: list[TokenPair] = []
    if not tokens:
        return out
    first = tokens[:max_length]
    out.append(([prefix_token_id], first))
    done = len(first)
    while done < len(tokens):
        cont = tokens[done:done + max_length]
        ctx = tokens[max(0, done + len(cont) - max_length - 1):done]
        out.append((ctx, cont))
        done += len(cont)
    return out
