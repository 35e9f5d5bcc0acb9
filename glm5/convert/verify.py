"""How exact a conversion is: the converted model against the source run by transformers, same tokens.

`residual(model, source, texts)` reports the max |logit difference|, the mean KL(source || converted) per
token and whether greedy continuations agree; the reference is transformers' own model class for the
source (Llama from the GGUF file or the HF directory), in fp32 with eager attention.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Short English, code and chat-style probes for the residual (the prompts' own tokens, no generation).
PROBES = ["The capital of France is Paris, and the capital of Germany is",
          "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
          "Once upon a time, in a small village by the sea, there lived an old fisherman who",
          "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n"]


@dataclass
class Residual:
    max_abs_logit_diff: float
    mean_kl: float  # nats per token, KL(source || converted)
    tokens: int
    greedy_identical: int  # prompts whose greedy continuation is identical
    prompts: int
    greedy_tokens: int  # tokens generated per prompt
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return (f"max |logit diff| {self.max_abs_logit_diff:.2e}, mean KL {self.mean_kl:.2e} nats/token over "
                f"{self.tokens} tokens, greedy identical on {self.greedy_identical}/{self.prompts} prompts x "
                f"{self.greedy_tokens} tokens")


def load_reference(source: str | Path):
    """transformers' model for the source (a .gguf file, `bundled:smollm2` or an HF directory), fp32, eager."""
    from transformers import AutoModelForCausalLM

    if str(source) == "bundled:smollm2":
        from .bundled import smollm2_gguf

        source = smollm2_gguf()
    path = Path(source)
    if path.suffix == ".gguf":
        # Built from the config and filled from transformers' GGUF reader: `from_pretrained(gguf_file=)`
        # would also work but insists on `accelerate`, which nothing else here needs.
        from .llama import read_gguf_tensors

        cfg, tensors = read_gguf_tensors(path)
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
        model.tie_weights()
        tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"{path}: GGUF tensors do not fill {type(model).__name__}: missing "
                             f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
        return model.eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def residual(model, reference, token_lists: list[list[int]], greedy_tokens: int = 16) -> Residual:
    """Compare `model` (a GLM5ForCausalLM) with `reference` (a transformers causal LM) on each token list:
    logits over the prompt, then `greedy_tokens` greedy steps of both (full recompute, no cache tricks)."""
    t0 = time.time()
    max_diff, kl_sum, n_tok, same = 0.0, 0.0, 0, 0
    for ids in token_lists:
        x = torch.tensor([ids])
        a = reference(x).logits.float()
        b = model(x).logits.float()
        max_diff = max(max_diff, float((a - b).abs().max()))
        kl = F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
        kl_sum += float(kl.sum())
        n_tok += kl.numel()
        if greedy_tokens:
            ga = _greedy(lambda t: reference(t).logits, x, greedy_tokens)
            gb = _greedy(lambda t: model(t).logits, x, greedy_tokens)
            same += int(ga == gb)
    return Residual(max_diff, kl_sum / max(n_tok, 1), n_tok, same, len(token_lists), greedy_tokens,
                    time.time() - t0)


def _greedy(logits_fn, x: torch.Tensor, n: int) -> list[int]:
    out = []
    for _ in range(n):
        nxt = int(logits_fn(x)[0, -1].argmax())
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]])], 1)
    return out
