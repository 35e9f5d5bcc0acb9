"""Language-model scoring for OCR correction: log P(text) under a glm5 checkpoint.

Uses only the model's forward (`GLM5ForCausalLM(input_ids).logits`) and the checkpoint's tokenizer.
Every text is scored whole, after an end-of-text token (documents are separated by it in
pretraining), so candidates that share a left and right context differ only in what the context
makes likely: the left context conditions the candidate and the candidate conditions the right
context, which is what masking the span and scoring fillers (GLM blank infilling) measures too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from glm5.data.tokenizer import GLMTokenizer, load_tokenizer
from glm5.model.hf_adapter import from_pretrained
from glm5.model.model import GLM5ForCausalLM


class LMScorer:
    """`scorer.logprob(texts)` -> total log-probability (nats) of each text."""

    def __init__(self, model: GLM5ForCausalLM, tokenizer: GLMTokenizer, batch_size: int = 16,
                 max_tokens: int = 256):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.device = next(model.parameters()).device

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu") -> "LMScorer":
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: the correction model needs its tokenizer (tokenizer.json) beside it")
        return cls(from_pretrained(path, dtype=torch.float32, device=device), load_tokenizer(path))

    @torch.no_grad()
    def logprob(self, texts: list[str]) -> list[float]:
        start = self.tokenizer.eos_token_id
        ids = [[start, *self.tokenizer.encode(t)][-self.max_tokens:] for t in texts]
        out: list[float] = []
        for k in range(0, len(ids), self.batch_size):
            out += self._batch(ids[k:k + self.batch_size])
        return out

    def _batch(self, seqs: list[list[int]]) -> list[float]:
        T = max(len(s) for s in seqs)
        x = torch.full((len(seqs), T), self.tokenizer.pad_token_id, dtype=torch.long)  # [B, T]
        for b, s in enumerate(seqs):
            x[b, :len(s)] = torch.tensor(s)
        # right padding under a causal mask: pads never influence the real positions before them
        logits = self.model(x.to(self.device)).logits.float()  # [B, T, V]
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, T-1, V]
        tok = logp.gather(-1, x[:, 1:, None].to(self.device)).squeeze(-1)  # [B, T-1]
        lengths = torch.tensor([len(s) - 1 for s in seqs], device=self.device)
        mask = torch.arange(T - 1, device=self.device)[None, :] < lengths[:, None]  # [B, T-1]
        return (tok * mask).sum(dim=1).tolist()
