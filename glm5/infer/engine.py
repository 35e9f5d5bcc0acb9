"""`LLMEngine`: the synchronous engine core. `step()` = scheduler.schedule() -> runner.run() ->
scheduler.update(); everything else (the server's asyncio pump, `LLM.generate`, sessions) drives it.

Owns: building the model (checkpoint directory or random-init preset; INT8 and expert offload applied
at load), sizing the KV cache from a memory budget, the tokenizer and per-request detokenizers, fan-out
of `n > 1` into child requests and the aggregation of their outputs, engine statistics, and expert hot
swap between steps. Knows no HTTP and no asyncio.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import uuid
from pathlib import Path

import torch

from glm5.core.resources import resolve_path
from glm5.data.infilling import InfillLayout
from glm5.model.config import ModelConfig
from glm5.model.generation_config import GenerationConfig
from glm5.model.hf_adapter import cast_model, from_pretrained
from glm5.model.kv_cache import bytes_per_token
from glm5.model.peft_adapter import adapter_kind
from glm5.model.model import GLM5ForCausalLM
from glm5.native import NativeKernels
from glm5.native import load as load_native

from .block_manager import BlockManager, cdiv
from .config import EngineConfig
from .experts import expert_stats
from .faults import FaultTracker, NonFiniteOutput, is_fatal, run_each
from .hot_swap import ExpertVersions
from .hugepages import rehome
from . import onednn
from .kernels import packable_bytes, use_native_kernels, use_onednn
from .kv_cache import available_memory_bytes, num_blocks_for_budget
from .layout import transpose_weights
from .lora import LoRAManager
from .prefix_adapters import PrefixAdapters
from .outputs import CompletionOutput, RequestOutput
from .request import Request, fan_out
from .runner import ModelRunner, RunnerOutput
from .sampling import SamplingParams, check_token_ids
from .scheduler import Batching, ScheduleOutput, Scheduler
from .structured import GrammarBackend

log = logging.getLogger(__name__)
BUNDLED_TOKENIZER = "bundled:tokenizer-8k"


def resolve_device(config: EngineConfig) -> EngineConfig:
    """Fall back to CPU without CUDA; compute in fp32 on CPU (bf16 matmuls are very slow there)."""
    device = config.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"
    dtype = "float32" if device == "cpu" else config.dtype
    return dataclasses.replace(config, device=device, dtype=dtype)


def load_model(config: EngineConfig) -> GLM5ForCausalLM:
    """A checkpoint directory, or a preset name (random init seeded by config.seed)."""
    dtype = getattr(torch, config.dtype)
    path = model_path(config.model)
    offload = config.max_resident_experts is not None or config.expert_cache_bytes is not None
    if offload and not path.is_dir():
        raise ValueError(f"expert offload memory-maps experts from a checkpoint directory; {config.model!r} "
                         "is not one")
    if offload:
        from .offload import load_offloaded  # noqa: PLC0415
        return load_offloaded(path, dtype, config.device, config.max_resident_experts, config.expert_cache_bytes)
    if path.is_dir():
        return from_pretrained(path, dtype=dtype, device=config.device)
    cfg = ModelConfig.load(config.model)
    torch.manual_seed(config.seed)
    model = GLM5ForCausalLM(cfg).init_weights(config.seed)
    return cast_model(model, dtype).to(config.device).eval()


def model_path(model: str) -> Path:
    """`EngineConfig.model` as a path: `bundled:NAME` resolved (the embedded model's cache), else as given."""
    return resolve_path(model) if str(model).startswith("bundled:") else Path(model)


def load_tokenizer_for(model: str, vocab_size: int):
    """The checkpoint's tokenizer; for presets, the bundled 8k tokenizer if it fits the vocabulary.
    None (token ids only) when there is none."""
    from glm5.data.tokenizer import load_tokenizer  # noqa: PLC0415 (data layer, optional at runtime)
    path = model_path(model)
    candidates = [path] if path.is_dir() else [resolve_path(BUNDLED_TOKENIZER)]
    for c in candidates:
        try:
            tok = load_tokenizer(c)
        except (FileNotFoundError, ValueError, OSError) as e:
            log.info("no tokenizer at %s (%s): token ids only", c, e)
            continue
        if tok.vocab_size <= vocab_size:
            return tok
    return None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model: GLM5ForCausalLM | None = None,
                 tokenizer=None, **overrides):
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.config = resolve_device(config)
        if model is None:
            model = load_model(self.config)
            tokenizer = tokenizer or load_tokenizer_for(self.config.model, model.config.vocab_size)
        self.kernels: NativeKernels | None = self._native_kernels()
        self.model = self._convert(model.eval())
        self.model_config: ModelConfig = self.model.config
        self.generation_config: GenerationConfig = self.model.generation_config
        self.tokenizer = tokenizer
        self.versions = ExpertVersions(self.model, self.model_config, getattr(torch, self.config.dtype))
        num_blocks, max_model_len = self._size_kv()
        self.config = dataclasses.replace(self.config, max_model_len=max_model_len)
        # partial prefix blocks: not under speculative decoding (its draft rows make the last block's rows
        # depend on which drafts were accepted)
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching,
                                          cache_partial_blocks=not self.config.speculative_num_tokens)
        self.scheduler = Scheduler(self.config, self.block_manager)
        cache_dtype = next(self.model.model.embed_tokens.parameters()).dtype
        native = self.kernels is not None and cache_dtype == torch.float32
        self.runner = ModelRunner(self.model, self.config, num_blocks, device=self.config.device, cache_dtype=cache_dtype,
                                  sort_by_length=not native)
        # tokens routed to each expert of each MoE layer since start (device tensor, one add per layer/step)
        self._expert_tokens = torch.zeros(self.model_config.num_hidden_layers, self.model_config.n_routed_experts,
                                          dtype=torch.long, device=self.config.device)
        self._groups: dict[str, list[Request]] = {}  # request id -> its (child) requests
        self._prompts: dict[str, str | None] = {}
        self._flushed: set[str] = set()  # finished requests whose detokenizer was flushed
        self._errors: dict[str, str] = {}  # request id -> why the engine aborted it (faults.py)
        self._faults = FaultTracker()
        self.loras = self._lora_manager()
        self.prefixes = PrefixAdapters(self.config, self.block_manager, self.runner.cache, self.model_config)
        self._adapter_of: dict[str, str] = {}  # request id -> the adapter it runs with
        for name, path in self.config.lora_modules.items():
            self.load_lora(name, path)

    # ---- construction helpers -----------------------------------------------------------------------
    def _convert(self, model: GLM5ForCausalLM) -> GLM5ForCausalLM:
        c = self.config
        if c.quantization == "int8":
            from .quant import quantize_model  # noqa: PLC0415
            k = c.int8_kernel
            quantize_model(model, None if k == "auto" else {"small": k, "large": k}, c.int8_expert_group_size)
        if c.weight_layout == "transposed" or (c.weight_layout == "auto" and torch.device(c.device).type == "cpu"):
            transpose_weights(model)
        if self.kernels is not None:
            use_native_kernels(model, self.kernels, c.native_layer_kernel)  # module swaps: the backend is chosen here, once
        if c.huge_pages and torch.device(c.device).type == "cpu":
            rehome(model)  # after the layout change: the tensors served are the ones moved
        if self._onednn(model):
            use_onednn(model)  # after rehome: the packs read the weights where they are served
        return model

    def _onednn(self, model: GLM5ForCausalLM) -> bool:
        """`gemm`: whether prefill-sized GEMMs run on oneDNN (glm5/infer/onednn.py); only under the native
        kernels, whose modules carry the packed weights."""
        c = self.config
        if c.gemm == "onednn":
            if self.kernels is None or not onednn.available():
                raise ValueError("gemm='onednn' needs the native CPU kernels (kernels='auto' or 'native' on CPU) and "
                                 "a PyTorch build with oneDNN - use gemm='auto' or 'torch'")
            return True
        if c.gemm == "torch" or self.kernels is None:
            return False
        packed = packable_bytes(model)
        if packed > available_memory_bytes() // 2:  # the packs are a second copy of those weights
            log.info("gemm='auto': no oneDNN packs (%.1f GB of weights, more than half the free memory)", packed / 1e9)
            return False
        return onednn.onednn_pays(model.config.hidden_size)

    def _native_kernels(self) -> NativeKernels | None:
        """`kernels`: the native CPU kernels (glm5/native, typed ops `torch.ops.glm5_native.*`), swapped into
        the model once here (glm5/infer/kernels.py: norms, few-row linear layers, SwiGLU, router, experts,
        attention, whole decode layers); each module checks its case per call and falls back to its own forward."""
        c = self.config
        if c.kernels == "torch":
            return None
        if c.kernels == "auto" and c.compile_decode != "none" and not c.enforce_eager and not c.speculative_num_tokens:
            # the captured step traces either (the native kernels are typed ops); with inductor the PyTorch
            # modules were as fast or faster (`small`, 1 thread: 177 vs 157 tok/CPU-s at batch 1, 428 vs 441 at
            # 8; docs/bench-engine.md), and they need no compiler of ours
            log.info("compile_decode=%r: kernels='auto' runs the PyTorch kernels", c.compile_decode)
            return None
        if torch.device(c.device).type != "cpu":
            if c.kernels == "native":
                raise ValueError(f"kernels='native' runs on CPU only, not on device {c.device!r}; use 'auto' or 'torch'")
            return None
        kernels = load_native()
        if kernels is None and c.kernels == "native":
            raise ValueError("kernels='native': the native CPU kernels could not be built here (see the warning "
                             "above; set CC to a C compiler) - use kernels='auto' or 'torch'")
        return kernels

    def _lora_manager(self) -> LoRAManager | None:
        c = self.config
        slots = c.max_loras or len(c.lora_modules)
        if not slots:
            return None
        if c.quantization is not None:
            raise ValueError("multi-LoRA serving needs the unquantised model (adapters add to nn.Linear outputs); "
                             "serve a merged checkpoint (glm5 merge) with INT8 instead")
        return LoRAManager(self.model, slots, c.max_lora_rank)

    def _size_kv(self) -> tuple[int, int]:
        """(KV blocks, max_model_len). An unset max_model_len is the model's max_position_embeddings,
        capped by what the KV budget holds; a set one must fit the model (the scheduler checks the KV)."""
        c = self.config
        limit = self.model.config.max_position_embeddings
        if c.max_model_len is not None and c.max_model_len > limit:
            raise ValueError(f"max_model_len={c.max_model_len} is more than the model's max_position_embeddings="
                             f"{limit}; leave max_model_len unset to use {limit}")
        length = c.max_model_len or limit
        num_blocks = self._num_blocks(length, stretch=c.max_model_len is not None)
        if c.max_model_len is not None:
            return num_blocks, c.max_model_len
        fits = num_blocks * c.block_size - c.speculative_num_tokens
        if fits < 1:
            raise ValueError(f"the KV cache ({num_blocks} blocks of {c.block_size} tokens) holds no request; "
                             "raise num_blocks or kv_cache_memory")
        return num_blocks, min(length, fits)

    def _num_blocks(self, max_model_len: int, stretch: bool) -> int:
        """Blocks from num_blocks, kv_cache_memory, or (default) every sequence at full length capped at a
        quarter of free memory; `stretch` keeps at least one full-length request in that default."""
        c, cfg = self.config, self.model.config
        if c.num_blocks is not None:
            return c.num_blocks
        dtype = getattr(torch, c.dtype)
        with_mtp = c.speculative_num_tokens > 0
        if c.kv_cache_memory is not None:
            blocks = num_blocks_for_budget(cfg, c.block_size, c.kv_cache_memory, dtype, with_mtp)
            if blocks < 1:  # say which setting and how much, not BlockManager's "got 0, 16"
                per_block = c.block_size * bytes_per_token(cfg, dtype, with_mtp)
                need = per_block * cdiv(max_model_len + c.speculative_num_tokens, c.block_size)
                raise ValueError(f"kv_cache_memory={c.kv_cache_memory} bytes holds no KV block (one block of "
                                 f"{c.block_size} tokens takes {per_block} bytes); one request of {max_model_len} "
                                 f"tokens needs kv_cache_memory >= {need}: raise it, or lower max_model_len")
            return blocks
        want = c.max_num_seqs * (max_model_len + c.speculative_num_tokens) * bytes_per_token(cfg, dtype, with_mtp)
        blocks = num_blocks_for_budget(cfg, c.block_size, min(want, available_memory_bytes() // 4), dtype, with_mtp)
        return max(blocks, cdiv(max_model_len + c.speculative_num_tokens, c.block_size)) if stretch else blocks

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens per request (resolved: never None)."""
        return self.config.max_model_len

    def default_sampling_params(self) -> SamplingParams:
        """`SamplingParams()` with the model's generation_config.json defaults (temperature, top_p, ...)."""
        return SamplingParams(**self.generation_config.sampling_defaults())

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, request_id: str | None = None, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                    cache_salt: str | None = None, infill: InfillLayout | None = None,
                    lora_name: str | None = None) -> str:
        """Queue a request. `infill` (GLM blank infilling, see `glm5.data.infilling.infill_prompt`) gives the
        prompt's Part A / Part B layout: Part A attends bidirectionally, Part B is generated until <eop>.
        `lora_name`: run it with that loaded adapter (`load_lora`); its KV is cached apart from the base's."""
        params = params or SamplingParams()
        slot, num_virtual = -1, 0
        if lora_name is not None and lora_name in self.prefixes.loaded:  # prefix tuning: a cached prefix
            if prompt_token_ids is None and prompt is not None and self.tokenizer is not None:
                prompt_token_ids = self.tokenizer.encode(prompt)
            if prompt_token_ids is not None:
                check_token_ids("prompt_token_ids", prompt_token_ids, self.model_config.vocab_size)
                prompt_token_ids, cache_salt = self.prefixes.prepare(lora_name, prompt_token_ids, params, cache_salt)
                num_virtual = self.prefixes.loaded[lora_name].num_tokens
        elif lora_name is not None:  # KV computed with an adapter must never serve another adapter's prefix
            slot = self._lora_slot(lora_name)
            cache_salt = f"{cache_salt or ''}\x00lora:{lora_name}#{self.loras.versions[lora_name]}"
        request_id = request_id or uuid.uuid4().hex
        if params.use_beam_search:
            raise ValueError("use_beam_search: run beam search through LLM.beam_search (it drives the engine)")
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        check_token_ids("prompt_token_ids", prompt_token_ids, self.model_config.vocab_size)
        params.check_vocab(self.model_config.vocab_size)  # e.g. a stop id past the logits fails the step
        if infill is not None and not self.model_config.block_position_embedding:
            raise ValueError("GLM blank infilling needs a model trained for it (block_position_embedding = true "
                             "in its config); this model is a plain causal LM")
        cache_salt = self.versions.cache_salt(cache_salt)  # after a hot swap: KV shared within one version only
        reqs = fan_out(request_id, list(map(int, prompt_token_ids)), params, eos_token_ids=self.eos_token_ids,
                       prompt=prompt, cache_salt=cache_salt, device=self.config.device, infill=infill)
        for r in reqs:
            r.detokenizer = self._detokenizer(r.params)
            r.model_version = self.model_version
            if params.structured_outputs is not None:
                r.grammar = self.grammars.state(params.structured_outputs)
            r.adapter_id, r.num_virtual_tokens = slot, num_virtual
        for i, r in enumerate(reqs):
            try:
                self.scheduler.add_request(r)
            except ValueError:
                for done in reqs[:i]:
                    self.scheduler.abort(done.request_id)
                raise
        self._groups[request_id] = reqs
        self._prompts[request_id] = prompt
        if lora_name is not None:
            self._adapter_of[request_id] = lora_name
        return request_id

    @functools.cached_property
    def grammars(self) -> GrammarBackend:
        """The structured-output compiler (built on first use: xgrammar is slow to import)."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs: this model has no tokenizer to build a grammar vocabulary from")
        return GrammarBackend(self.tokenizer, self.model_config.vocab_size, list(self.eos_token_ids))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """generation_config.json's EOS ids, then tokenizer_config.json's, then config.json's."""
        gen = self.generation_config
        if gen.eos_token_ids and not gen.extra.get("_from_model_config"):
            return gen.eos_token_ids
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return gen.eos_token_ids

    def _detokenizer(self, params: SamplingParams):
        if self.tokenizer is None:
            return None
        from glm5.data.tokenizer import IncrementalDetokenizer  # noqa: PLC0415
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)

    # ---- adapters: multi-LoRA (lora.py) and prefix tuning (prefix_adapters.py) ---------------------------
    def _lora_slot(self, name: str) -> int:
        if self.loras is None or name not in self.loras.slots:
            raise ValueError(f"lora_name: no adapter named {name!r} is loaded (loaded: {sorted(self.list_loras())})")
        return self.loras.slots[name]

    def load_lora(self, name: str, path: str | Path) -> None:
        """Load an adapter as `name` between steps: a PEFT LoRA (multi-LoRA slots) or a glm5 latent prefix.
        A name in use, a full engine, or an adapter that does not fit the model raises ValueError naming
        why; nothing changes then."""
        if name in self.list_loras():
            raise ValueError(f"an adapter named {name!r} is already loaded (unload it first)")
        if adapter_kind(path) == "prefix":
            self.prefixes.load(name, path)
            return
        if self.loras is None:
            raise ValueError("this engine has no LoRA slots: start it with max_loras > 0 (glm5 serve --max-loras N)")
        self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Drop adapter `name`; refused (ValueError) while unfinished requests use it."""
        if name not in self.list_loras():
            raise ValueError(f"lora_name: no adapter named {name!r} is loaded")
        users = [gid for gid, a in self._adapter_of.items() if a == name and gid in self._groups]
        if users:
            raise ValueError(f"adapter {name!r} is in use by {len(users)} running request(s); retry when they finish")
        if name in self.prefixes.loaded:
            self.prefixes.unload(name)
        else:
            self.loras.unload(name)

    def list_loras(self) -> dict[str, str]:
        """Loaded adapters (LoRA and prefix): name -> directory."""
        loras = dict(self.loras.paths) if self.loras else {}
        return {**loras, **{n: p.path for n, p in self.prefixes.loaded.items()}}

    def abort_request(self, request_id: str) -> None:
        for r in self._groups.pop(request_id, []):
            self.scheduler.abort(r.request_id)
        self._prompts.pop(request_id, None)
        self._adapter_of.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def num_waiting_requests(self) -> int:
        """Sequences queued and not running yet (an n > 1 request counts n)."""
        return len(self.scheduler.waiting)

    def batch_wait(self, batching: Batching) -> float | None:
        """Seconds an idle engine should keep gathering requests before its first step (None: step now)."""
        return self.scheduler.batch_wait(batching)

    # ---- one step -----------------------------------------------------------------------------------
    def step(self, batching: Batching | None = None) -> list[RequestOutput]:
        """Schedule, run the model, update the requests; outputs of the requests that changed. `batching`:
        the server's dynamic batching over the waiting queue (scheduler.py; None: FIFO up to max_num_seqs).

        A failure attributable to one request (faults.py) aborts that request: its output comes back
        finished with `error` set, and every other request carries on. Other failures raise."""
        out = self.scheduler.schedule(batching)
        if out.is_empty():
            return []
        if out.block_copies:  # reused partial prefix blocks: their rows into the admitted requests' own blocks
            self.runner.cache.copy_block_rows(out.block_copies)
            self.block_manager.release_copies(out.block_copies)
        result, failed = self._run(out)
        for rid in result.nonfinite:
            failed[rid] = NonFiniteOutput("the model's logits for this request are not finite (NaN or inf)")
        if result.router_stats:  # per-layer expert load (seed M2: observable while serving), one add per step
            layers = torch.tensor([st["layer"] for st in result.router_stats], device=self._expert_tokens.device)
            self._expert_tokens.index_add_(0, layers, torch.stack([st["tokens_per_expert"] for st in result.router_stats]))
        for s in out.scheduled:
            entries = result.prompt_logprobs.get(s.request_id)
            if entries is not None:
                req = s.request
                req.prompt_logprobs = entries if s.start == 0 else (req.prompt_logprobs or []) + entries
        for s in out.scheduled:  # one request at a time: a failing stop check or detokenizer is its own
            if s.request_id in failed:
                continue
            try:
                self.scheduler.update(ScheduleOutput([s]), result.sampled, result.logprobs,
                                      result.draft_token_ids or None)
            except Exception as e:  # noqa: BLE001
                if is_fatal(e):
                    raise
                failed[s.request_id] = e
        for s in out.scheduled:
            if s.request_id in failed:
                self._fail(s.request, failed[s.request_id])
        # EngineFault on a streak; an adapter whose outputs overflow is that adapter's fault, not the engine's
        blamed = [failed[s.request_id] for s in out.scheduled if s.request_id in failed
                  and not (isinstance(failed[s.request_id], NonFiniteOutput) and s.request.adapter_id >= 0)]
        self._faults.record(len(out.scheduled) - len(failed), blamed)
        changed = {s.request.parent_id or s.request_id for s in out.scheduled
                   if s.request_id in result.sampled or s.request.is_finished}
        outputs = [self._output(gid) for gid in changed if gid in self._groups]
        for o in outputs:
            if o.finished:
                for r in self._groups.pop(o.request_id, []):
                    self._flushed.discard(r.request_id)
                self._prompts.pop(o.request_id, None)
                self._adapter_of.pop(o.request_id, None)
                self._errors.pop(o.request_id, None)
        if self.versions.held is not None:  # after the outputs: they report the version their requests ran on
            self.versions.release_unused(self._running_versions())
        return outputs

    def _run(self, out: ScheduleOutput) -> tuple[RunnerOutput, dict[str, Exception]]:
        """The runner's step; if it fails, each request again alone to find the one(s) to blame."""
        run = functools.partial(self.runner.run, tag_version=self.versions.held)
        try:
            return run(out), {}
        except Exception as e:  # noqa: BLE001
            if is_fatal(e):
                raise
            log.warning("engine step failed (%s: %s); re-running its %d requests one by one",
                        type(e).__name__, e, len(out.scheduled))
            return run_each(run, out)

    def _fail(self, req: Request, error: Exception) -> None:
        """Abort the request group `req` belongs to (all n samples), keeping the error for its output."""
        gid = req.parent_id or req.request_id
        log.error("request %s failed in the engine and was aborted; the others continue", gid,
                  exc_info=error)
        self._errors[gid] = f"{type(error).__name__}: {error}"
        for r in self._groups.get(gid, []):
            self.scheduler.abort(r.request_id)

    def _output(self, group_id: str) -> RequestOutput:
        reqs = self._groups[group_id]
        outs = []
        for r in reqs:
            if r.is_finished and r.detokenizer is not None and r.request_id not in self._flushed:
                r.output_text += r.detokenizer.finish()  # a dangling partial UTF-8 character, if any
                self._flushed.add(r.request_id)
            outs.append(CompletionOutput(
                r.index, r.text_for_output(), list(r.output_token_ids),
                r.cumulative_logprob if r.logprobs is not None else None,
                list(r.logprobs) if r.logprobs is not None else None, r.status.finish_reason, r.stop_reason))
        first = reqs[0]
        return RequestOutput(group_id, self._prompts.get(group_id), list(first.prompt_token_ids[first.num_virtual_tokens:]),
                             first.prompt_logprobs, outs, all(r.is_finished for r in reqs), first.metrics,
                             self._version_of(first), self._errors.get(group_id))

    def _version_of(self, req: Request) -> int | str:
        """The expert version a request ran on (see `ExpertVersions.version_of`)."""
        return self.versions.version_of(req.model_version)

    # ---- stats and weights --------------------------------------------------------------------------
    def get_stats(self) -> dict:
        stats = self.scheduler.get_stats()
        cache = self.runner.cache
        stats.update(num_kv_blocks=self.block_manager.num_blocks, num_free_kv_blocks=self.block_manager.num_free_blocks,
                     kv_bytes_per_token=cache.bytes_per_token(),
                     kv_expanded_bytes_per_token=cache.expanded_bytes_per_token(), model_version=self.model_version)
        if self.runner.proposer is not None:
            stats.update(self.runner.proposer.stats())
        if self.runner.graphs is not None:  # captured decode: build seconds, buckets, steps served, why off
            stats.update(self.runner.graphs.stats())
        stats.update(expert_stats(self.model))
        stats["expert_load"] = self.expert_load()
        return stats

    def expert_load(self) -> dict[int, dict]:
        """Per MoE layer: tokens routed to each expert since start, and the imbalance max/mean (1 = even)."""
        counts = self._expert_tokens.cpu()
        out = {}
        for layer in self.model_config.moe_layers:
            c = counts[layer]
            mean = float(c.float().mean())
            out[layer] = {"tokens_per_expert": c.tolist(), "imbalance": float(c.max()) / mean if mean else 0.0}
        return out

    @property
    def model_version(self) -> int:
        """The current expert version (0 at start; every swap makes a new one, a rollback returns to one)."""
        return self.versions.current

    def swap_experts(self, updates: dict) -> int:
        """Replace routed-expert weights between steps, without draining. `updates`: HF names
        (`model.layers.L.mlp.experts.E.gate_proj.weight` -> tensor) or {(L, E): {"gate_proj"|"up_proj"|
        "down_proj" (or full names): tensor}}. Everything is validated before anything changes. Requests
        already running finish on the weights they started with (the swapped layers' experts modules hold
        the old weights for them while any of them is left: glm5/infer/hot_swap.py); the prefix cache is
        dropped (its KV came from the old weights). Returns the new model version."""
        return self._switched(self.versions.swap(updates, self._running_versions()))

    def rollback_experts(self) -> int:
        """Undo the latest swap: the experts get their previous weights back and the model version returns
        to the one before it; requests started on the undone version finish on it."""
        return self._switched(self.versions.rollback(self._running_versions()))

    def _running_versions(self) -> set[int]:
        return {r.model_version for r in self.scheduler.requests.values()}

    def _switched(self, version: int) -> int:
        """After a version change: the prefix cache holds KV computed with other weights."""
        self.block_manager.reset_prefix_cache()
        self.prefixes.register()  # prefix adapters' entries are not model outputs: they stay valid
        return version
