"""`HFModel`: any transformers causal LM (a directory or a GGUF file) as an evaluation backend, so a
teacher from another family (SmolLM2, Llama, ...) is measured by the same tasks and tokenisation rules
as glm5 checkpoints. Scoring is a padded batched forward (lm-eval's `hf` model's arithmetic); generation
is `model.generate` with the stop strings applied to the decoded text. Needs `transformers` (the
distill extra); slower than the engine, meant for small reference models.
"""

from __future__ import annotations

import torch

from .lm import EvalModel, GenerationParams, Score, TokenPair, cut_at_stop


class HFTokenizer:
    """The `Tokenizer` protocol over a transformers tokenizer."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False):
        return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize)


class HFModel(EvalModel):
    def __init__(self, path: str, *, gguf_file: str | None = None, max_length: int = 2048, batch_size: int = 16,
                 add_special_tokens: bool = True, name: str | None = None, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415
        self.hf_tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
        self.model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32).to(device)
        self.model.eval()
        self.tokenizer = HFTokenizer(self.hf_tokenizer)
        bos, eos = self.hf_tokenizer.bos_token_id, self.hf_tokenizer.eos_token_id
        self.prefix_token_id = bos if bos is not None else eos  # lm-eval's `hf` rule
        self.max_length, self.batch_size, self.add_special_tokens = max_length, batch_size, add_special_tokens
        self.device, self.name = device, name or path
        self.pad_id = self.hf_tokenizer.pad_token_id if self.hf_tokenizer.pad_token_id is not None else eos

    @torch.no_grad()
    def score(self, pairs: list[TokenPair]) -> list[Score]:
        """One forward per distinct input: a one-token continuation is read at its context's last
        position, so the choices of a multiple-choice question share one forward."""
        inputs: dict[tuple[int, ...], int] = {}
        plan = []  # per pair: (input index, first scored position)
        for ctx, cont in pairs:
            x = tuple(ctx + cont[:-1])
            plan.append((inputs.setdefault(x, len(inputs)), len(ctx) - 1))
        logps = self._forward(list(inputs))
        out = []
        for (j, p0), (_, cont) in zip(plan, pairs):
            rows = logps[j][p0:p0 + len(cont)]  # [C, V]
            target = torch.tensor(cont)
            out.append((float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())))
        return out

    def _forward(self, inputs: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """log-softmax [len, V] (CPU, fp32) of each input, in padded batches of similar length."""
        out: list[torch.Tensor | None] = [None] * len(inputs)
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            lens = [len(inputs[i]) for i in idx]
            ids = torch.full((len(idx), max(lens)), self.pad_id, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, :lens[r]] = torch.tensor(inputs[i])
            mask = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]).long()
            logits = self.model(ids.to(self.device), attention_mask=mask.to(self.device)).logits.float().cpu()
            for r, i in enumerate(idx):
                out[i] = torch.log_softmax(logits[r, :lens[r]], -1)
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def generate(self, prompts: list[str], params: GenerationParams) -> list[list[str]]:
        if params.temperature_schedule is not None:
            raise ValueError("temperature_schedule is a glm5 engine option: transformers' generate has none "
                             "(use the glm5 backend or a glm5 server)")
        texts = []
        for p in prompts:  # one prompt at a time: no padding semantics to get wrong, fine for small models
            ids = torch.tensor([self.prompt_ids(p, params.chat)[-(self.max_length - params.max_tokens):]],
                               device=self.device)
            kw = {"do_sample": params.temperature > 0, "num_return_sequences": params.n,
                  "max_new_tokens": params.max_tokens, "pad_token_id": self.pad_id}
            if params.temperature > 0:
                kw.update(temperature=params.temperature, top_p=params.top_p)
            if params.beam_width > 1:
                kw.update(num_beams=params.beam_width, early_stopping=True)
            gen = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            outs = [self.hf_tokenizer.decode(g[ids.shape[1]:], skip_special_tokens=True) for g in gen]
            texts.append([cut_at_stop(o, params.stop) for o in outs])
        return texts
