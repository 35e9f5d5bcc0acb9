"""`EngineConfig`: every inference-engine option in one typed dataclass (TOML `[engine]` + CLI overrides).

The scheduler reads the budgets (`max_num_seqs`, `max_num_batched_tokens`, `max_model_len`), the block
manager the KV layout (`block_size`, `num_blocks` or `kv_cache_memory`), the runner the model/device
options, the scheduler the server's dynamic-batching knobs (as a `Batching` policy). Load with
`glm5.core.config.load_config(EngineConfig, "configs/serve/x.toml", ["--max_num_seqs=64"])`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class EngineConfig:
    model: str = "tiny"  # checkpoint directory or model preset name
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # weights and activations
    device: str = "cuda"  # "cuda", "cuda:1", "cpu"
    seed: int = 0  # seeds the sampler generator used by requests without their own seed

    # KV cache
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks; None = derive from kv_cache_memory
    kv_cache_memory: int | None = None  # KV budget in bytes; None with num_blocks None = measure free memory
    enable_prefix_caching: bool = True  # reuse full blocks of identical prefixes (chained block hashes)

    # scheduling
    max_num_seqs: int = 256  # running requests at most
    max_num_batched_tokens: int = 8192  # tokens per step (decodes + prefill chunks + draft tokens)
    max_model_len: int | None = None  # prompt + output tokens per request; None = the model's
    # max_position_embeddings, capped by what the KV cache holds (the engine resolves it at start)
    enable_chunked_prefill: bool = True  # split long prompts across steps under the token budget

    # model execution
    quantization: Literal["int8"] | None = None  # weight-only INT8 (experts in groups)
    int8_kernel: Literal["auto", "int8pack", "int_mm", "dequant"] = "auto"  # auto: quant.DEFAULT_KERNELS (weight-only)
    int8_expert_group_size: int | None = None  # routed experts: one scale per group of this many inputs (None: per channel)
    # weight storage order (glm5/infer/layout.py): "transposed" = [in, out] row-major, faster CPU GEMM for
    # decode-sized batches; auto = transposed on CPU, native elsewhere
    weight_layout: Literal["auto", "native", "transposed"] = "auto"
    # compiled CPU kernels (glm5/native, glm5/infer/kernels.py): "auto" = on CPU when a C compiler builds
    # them (else PyTorch, one warning); "native" = required (an error if they cannot be built); "torch" = off
    kernels: Literal["auto", "native", "torch"] = "auto"
    # ... and on top of the per-function native kernels, the whole-layer decode kernel (NativeDecoderLayer:
    # one C call per decoder layer for decode-sized MLA steps); False = the per-function kernels only
    # (about half the batch-1 decode speed on `small`: docs/bench-engine.md, "Per-function vs whole-layer")
    native_layer_kernel: bool = True
    # GEMMs of prefill-sized steps (ONEDNN_MIN_ROWS rows or more) in the native kernels' linear layers and
    # routed experts (experts only where the native GEMM has no AVX-512 tiles: with them its fused kernel is
    # faster at every size), fp32 on CPU: "onednn" = oneDNN over weights prepacked at build (a second copy of those
    # weights in memory; 2.0-2.4x MKL's `mm` on an AVX-512 AMD CPU, glm5/infer/onednn.py); "torch" = `mm`;
    # "auto" = onednn where the native kernels run and a build-time check measures it faster on this CPU
    gemm: Literal["auto", "onednn", "torch"] = "auto"
    huge_pages: bool = True  # CPU: weights on transparent huge pages where Linux offers them (glm5/infer/hugepages.py)
    speculative_num_tokens: int = 0  # MTP draft tokens per step (0 = off)
    # prompt lookup on top of the MTP drafts (glm5/infer/mtp.py): where the request's last n tokens
    # (n = prompt_lookup_max down to prompt_lookup_min) occurred before, draft the token that followed
    # their latest occurrence instead of the MTP layer's; 0 = MTP drafts only (vLLM's ngram method's names)
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 2
    max_resident_experts: int | None = None  # expert offload: experts kept on device per layer
    expert_cache_bytes: int | None = None  # expert offload: device bytes for resident experts
    # captured decode (glm5/infer/graphs.py): steps of single-token decodes padded to a batch-size bucket
    # (1, 2, 4, ... max_num_seqs) run the model's forward compiled by torch.compile(fullgraph=True)
    # ("inductor", any device) or replayed from a CUDA graph of it ("cuda_graphs", CUDA only); "none" =
    # eager. Prefill, mixed and LoRA steps run eagerly, and every step under MTP speculation (a warning);
    # a failed build falls back to eager
    # with one warning. Needs plain routed experts (no INT8 or offload; the native expert module traces
    # whole): with it, kernels="auto" means the PyTorch kernels
    compile_decode: Literal["none", "inductor", "cuda_graphs"] = "none"
    compile_backend: str = "inductor"  # torch.compile backend of compile_decode="inductor" ("aot_eager": debugging)
    enforce_eager: bool = False  # vLLM's switch: True runs every step eagerly whatever compile_decode says

    # multi-LoRA serving (glm5/infer/lora.py)
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> PEFT LoRA directory, loaded at start
    max_loras: int = 0  # adapter slots (0 = as many as lora_modules; requests pick one by name)
    max_lora_rank: int = 16  # adapters up to this rank can be loaded

    # long conversations
    max_session_len: int | None = None  # tokens a session may keep before its history is cut
    session_policy: Literal["drop", "summarize"] = "drop"  # what to do past max_session_len

    # dynamic batching over the scheduler's waiting queue, applied when the server drives the engine
    # (`scheduler.Batching.from_config`; offline drivers pass no policy)
    max_batch_size: int = 32  # requests running at most
    preferred_batch_size: int = 16  # dispatch as soon as this many are queued
    batch_timeout_ms: int = 500  # or when the oldest queued request waited this long
    batch_by_length: bool = True  # fill a batch with the queued prompts closest in length to the oldest one

    def __post_init__(self):
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_batch_size", "preferred_batch_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_blocks", "kv_cache_memory", "max_resident_experts", "expert_cache_bytes",
                     "max_session_len", "max_model_len", "int8_expert_group_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or unset, got {value}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if self.speculative_num_tokens < 0:
            raise ValueError(f"speculative_num_tokens must be >= 0, got {self.speculative_num_tokens}")
        if self.prompt_lookup_max < 0 or (self.prompt_lookup_max and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError(f"prompt_lookup_max must be 0 (off) or >= prompt_lookup_min >= 1, got "
                             f"prompt_lookup_max={self.prompt_lookup_max}, prompt_lookup_min={self.prompt_lookup_min}")
        if self.prompt_lookup_max and not self.speculative_num_tokens:
            raise ValueError("prompt_lookup_max refines MTP drafts: it needs speculative_num_tokens >= 1")
        if self.batch_timeout_ms < 0:
            raise ValueError(f"batch_timeout_ms must be >= 0, got {self.batch_timeout_ms}")
        if self.preferred_batch_size > self.max_batch_size:
            raise ValueError(f"preferred_batch_size ({self.preferred_batch_size}) must be <= "
                             f"max_batch_size ({self.max_batch_size})")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({self.max_model_len}) so every prompt fits a step")
