"""`LLM`: offline generation on top of `LLMEngine` (vLLM's `LLM` shape).

    llm = LLM("tiny")                      # a preset (random weights) or a checkpoint directory
    outs = llm.generate(["Hello", [5, 6, 7]], SamplingParams(max_tokens=32))
    for out in llm.generate_stream("Hello"): print(out.outputs[0].text)

`generate` submits every prompt at once and steps the engine until all finish (continuous batching);
`generate_stream` yields each `RequestOutput` as it changes; `beam_search` drives `BeamSearch` with one
single-token request per live beam (the prefix cache shares the beams' common blocks).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Literal

import torch

from glm5.data.infilling import InfillLayout

from .beam_search import BeamSearch
from .config import EngineConfig
from .engine import LLMEngine
from .infill import InfillFormat, build_infill, choose_format
from .outputs import RequestOutput
from .sampling import SamplingParams

Prompt = str | list[int]
ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


class LLM:
    def __init__(self, model: str = "tiny", *, tokenizer=None, model_obj=None, lora: dict[str, str] | None = None,
                 **engine_options):
        """`lora`: adapters to load, name -> PEFT LoRA directory (same as `lora_modules`); pick one per
        request with `generate(..., lora=name)`."""
        if lora:
            engine_options["lora_modules"] = {**engine_options.get("lora_modules", {}), **lora}
        unknown = set(engine_options) - ENGINE_FIELDS
        if unknown:
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; see glm5.infer.config.EngineConfig")
        engine_options.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options), model=model_obj, tokenizer=tokenizer)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- inputs ---------------------------------------------------------------------------------
    @staticmethod
    def _as_list(prompts) -> list[Prompt]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _submit(self, prompts, sampling_params, infill: InfillLayout | list[InfillLayout | None] | None = None,
                lora: str | list[str | None] | None = None) -> list[str]:
        prompts = self._as_list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        layouts = infill if isinstance(infill, list) else [infill] * len(prompts)
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if not len(params) == len(layouts) == len(loras) == len(prompts):
            raise ValueError(f"{len(params)} sampling params / {len(layouts)} layouts / {len(loras)} adapters for "
                             f"{len(prompts)} prompts")
        ids = []
        for p, sp, layout, name in zip(prompts, params, layouts, loras):
            rid = f"llm-{next(self._ids)}"
            sp = sp or self.engine.default_sampling_params()  # the model's generation_config.json defaults
            if isinstance(p, str):
                self.engine.add_request(rid, prompt=p, params=sp, lora_name=name)
            else:
                self.engine.add_request(rid, prompt_token_ids=list(p), params=sp, infill=layout, lora_name=name)
            ids.append(rid)
        return ids

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Outputs in prompt order (each finished). `lora`: a loaded adapter's name for every prompt, or one
        per prompt (None = the base model); different adapters run in the same batches."""
        return self._generate(prompts, sampling_params, lora=lora)

    def _generate(self, prompts, sampling_params, infill: InfillLayout | list[InfillLayout | None] | None = None,
                  lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        ids = self._submit(prompts, sampling_params, infill, lora)
        done: dict[str, RequestOutput] = {}
        for out in self._drain(set(ids)):
            if out.finished:
                done[out.request_id] = out
        return [done[i] for i in ids]

    def generate_stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield each request's output whenever it changes (cumulative text and token ids)."""
        ids = self._submit(prompts, sampling_params)
        try:
            yield from self._drain(set(ids))
        finally:  # the consumer stopped early: free the blocks
            for i in ids:
                self.engine.abort_request(i)

    def _drain(self, ids: set[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        while pending:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(pending)} vanished from the engine")
            for out in self.engine.step():
                if out.request_id in ids:
                    yield out
                    if out.finished:
                        pending.discard(out.request_id)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None, **template_kw
             ) -> RequestOutput:
        """One chat turn rendered with the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kw)
        return self.generate([list(ids)], sampling_params)[0]

    def infill(self, prefix: str | list[str], suffix: str | list[str], sampling_params: SamplingParams | None = None,
               *, extra: list[tuple[str, str]] = (), format: InfillFormat | Literal["auto"] = "auto",
               truncate: bool = True, path: str = "", language: str | None = None,
               mode: str | None = None) -> RequestOutput | list[RequestOutput]:
        """Fill the gap between `prefix` and `suffix` (code completion; see glm5/infer/infill.py for the
        GLM blank-infilling, GLM code-completion and sentinel-FIM formats). Lists of prefixes and suffixes
        run as one batch and give a list. `extra`: (filename, text) context files; `path`, `language`,
        `mode` (LINE | BLOCK): the code-completion prompt's headers. Beam search when `use_beam_search`."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: infilling needs one")
        single = isinstance(prefix, str)
        prefixes, suffixes = ([prefix], [suffix]) if single else (list(prefix), list(suffix))
        if len(prefixes) != len(suffixes):
            raise ValueError(f"{len(prefixes)} prefixes but {len(suffixes)} suffixes")
        params = sampling_params or self.engine.default_sampling_params()
        fmt = choose_format(self.tokenizer, self.engine.model_config.block_position_embedding, format)
        room = self.engine.config.max_model_len - (params.max_tokens or self.engine.config.max_model_len // 2)
        ips = [build_infill(self.tokenizer, fmt, p, s, room=room, extra=list(extra), truncate=truncate,
                            path=path, language=language, mode=mode) for p, s in zip(prefixes, suffixes)]
        if params.use_beam_search:
            outs = self._beams([None] * len(ips), [ip.token_ids for ip in ips], params, [ip.layout for ip in ips])
        else:
            outs = self._generate([ip.token_ids for ip in ips], params, [ip.layout for ip in ips])
        return outs[0] if single else outs

    # ---- beam search ----------------------------------------------------------------------------
    def beam_search(self, prompts, params: SamplingParams) -> list[RequestOutput]:
        """HF-semantics beam search (`params.beam_width`, `length_penalty`, `early_stopping`). Every prompt's
        search advances in the same engine steps: each step runs one one-token request per live beam of
        every unfinished prompt (partial prefix blocks make each compute its new token only)."""
        prompts = self._as_list(prompts)
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._beams(prompts, ids, params, [None] * len(prompts))

    def _beams(self, prompts: list, ids: list[list[int]], params: SamplingParams,
               layouts: list[InfillLayout | None]) -> list[RequestOutput]:
        searches = []
        for layout in layouts:
            eos = () if params.ignore_eos else self.engine.eos_token_ids
            if layout is not None:
                eos = (*eos, layout.end_token_id)
            searches.append(BeamSearch(params.beam_width, params.max_tokens or 16, eos, params.length_penalty,
                                       params.early_stopping))
        vocab = self.engine.model_config.vocab_size
        while live := [i for i, s in enumerate(searches) if not s.done]:
            rows = [(i, ids[i] + b.token_ids) for i in live for b in searches[i].beams]
            outs = self._generate([r for _, r in rows], [searches[i].step_params() for i, _ in rows],
                                  [layouts[i] for i, _ in rows])
            start = 0
            for i in live:
                n = len(searches[i].beams)
                searches[i].step_outputs(outs[start:start + n], vocab)
                start += n
        decode = (lambda t: self.tokenizer.decode(t, skip_special_tokens=True)) if self.tokenizer else None
        return [RequestOutput(f"beam-{next(self._ids)}", p if isinstance(p, str) else None, i,
                              outputs=s.completions(None, decode), finished=True,
                              model_version=self.engine.model_version)
                for p, i, s in zip(prompts, ids, searches)]
