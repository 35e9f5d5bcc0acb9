"""Serving prefix-tuned models: an MLA latent prefix (glm5/finetune/prefix.py) lives in the KV cache.

A prefix adapter is P latent cache entries per layer (latent, rope key, indexer key). Loading one writes
them into P cache slots held by a pinned placeholder sequence and registers those blocks in the prefix
cache under a key unique to the adapter (its name and load counter in the first block's salt). A request
for the adapter gets P placeholder tokens in front of its prompt with that same salt, so the scheduler
finds the P tokens already computed (an ordinary prefix-cache hit) and the real tokens start at position
P, exactly as in training; nothing in the scheduler, runner or model knows about prefixes. Hence P must
be a multiple of the block size, prefix caching must be on, and requests for a prefix adapter cannot ask
for prompt logprobs (those bypass the cache) or bring their own cache salt.

Dims: P virtual tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from glm5.model.config import ModelConfig
from glm5.model.kv_cache import LatentKVCache
from glm5.model.peft_adapter import read_prefix

from .block_manager import BlockManager
from .config import EngineConfig
from .request import Request
from .sampling import SamplingParams

PLACEHOLDER_ID = 0  # token id of the virtual tokens: only hashed, never embedded (their KV is the prefix)


@dataclass
class PrefixAdapter:
    num_tokens: int
    salt: str
    holder: Request  # pins the P cache slots for as long as the adapter is loaded
    path: str


class PrefixAdapters:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, cache: LatentKVCache,
                 model_config: ModelConfig):
        self.config, self.block_manager, self.cache, self.model_config = config, block_manager, cache, model_config
        self.loaded: dict[str, PrefixAdapter] = {}
        self._loads = 0

    def load(self, name: str, path: str | Path) -> None:
        """Write the prefix's entries into pinned cache blocks; errors name the cause, nothing changes then."""
        c = self.config
        if not c.enable_prefix_caching:
            raise ValueError("prefix adapters are served from the prefix cache: enable_prefix_caching must be on")
        if c.speculative_num_tokens > 0:
            raise ValueError("prefix adapters carry no MTP-layer cache entries: turn speculative decoding off")
        if self.model_config.attention_kind == "gqa":
            raise ValueError(f"{path}: a latent prefix is MLA cache rows; this model_type "
                             f"{self.model_config.model_type!r} caches GQA keys and values (use LoRA)")
        P, tensors = read_prefix(self.model_config, path)
        if P % c.block_size:
            raise ValueError(f"{path}: num_virtual_tokens = {P} is not a multiple of the engine's block_size "
                             f"{c.block_size} (only whole cache blocks are shared)")
        self._loads += 1
        salt = f"\x00prefix:{name}#{self._loads}"
        holder = Request(f"prefix-adapter:{name}", [PLACEHOLDER_ID] * P, SamplingParams(max_tokens=1), cache_salt=salt)
        if self.block_manager.allocate_slots(holder, P) is None:
            raise ValueError(f"not enough free KV blocks to hold the {P}-entry prefix {name!r}")
        pos = torch.arange(P)
        table = torch.as_tensor(holder.block_ids, dtype=torch.long)
        slots = (table[pos // c.block_size] * c.block_size + pos % c.block_size).to(self.cache.latent[0].device)
        for i in range(self.model_config.num_hidden_layers):
            index_k = tensors.get(f"prefix.layers.{i}.index_key")
            self.cache.write(i, slots, tensors[f"prefix.layers.{i}.latent"], tensors[f"prefix.layers.{i}.rope_key"],
                             None if index_k is None else index_k)
        holder.num_computed_tokens = P
        self.block_manager.cache_blocks(holder)
        self.loaded[name] = PrefixAdapter(P, salt, holder, str(path))

    def register(self) -> None:
        """Re-register every prefix's blocks (after the prefix cache was reset, e.g. by an expert swap)."""
        for p in self.loaded.values():
            self.block_manager.cache_blocks(p.holder)

    def unload(self, name: str) -> None:
        self.block_manager.free(self.loaded.pop(name).holder)

    def prepare(self, name: str, prompt_token_ids: list[int], params: SamplingParams,
                cache_salt: str | None) -> tuple[list[int], str]:
        """-> (placeholders + prompt, the salt that makes the placeholders a cache hit)."""
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not available with a prefix adapter (the prefix has no tokens)")
        if cache_salt:
            raise ValueError("cache_salt: not available with a prefix adapter (its blocks are shared)")
        p = self.loaded[name]
        return [PLACEHOLDER_ID] * p.num_tokens + list(prompt_token_ids), p.salt
