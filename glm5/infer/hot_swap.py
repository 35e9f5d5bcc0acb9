"""Expert hot swap without draining: versions, the experts module that keeps older requests on their
version, and the cache salt. The model knows none of this (it sees a `TaggedExperts` and per-token tags).

`LLMEngine.swap_experts(updates)` writes new weights into each layer's experts module between two steps
and makes a new version current. Requests already running stay on the version they started on: for each
layer the swap touched, `ExpertVersions` swaps a `VersionedExperts` in for the layer's experts module (the
mechanism INT8 and offload use) holding the previous weights of the swapped experts. The engine hands the
held version to `ModelRunner.run(out, tag_version)`, which tags each token of a step with its request's
version (`AttnMetadata.row_tags`, built with the step's metadata) and
the MoE hands the tags to the module as a forward argument, so the module reads which rows run on the
held weights from its arguments, never from state written into it before each step; the tags are built
only in steps that hold a request of the held version. The module is swapped out again once no request
runs on that version.

Only the latest previous version is held: a request overtaken by a second swap (or a rollback) finishes
on the current weights and is told ("0->2"). Soft MoE mixes every expert into every token and is not
held either (its running requests are told). KV blocks are shared only within one version (`cache_salt`);
the engine drops the prefix cache at each switch.
"""

from __future__ import annotations

import torch
from torch import nn

from glm5.model.config import ModelConfig
from glm5.model.moe import MoE

from .experts import VersionedExperts, apply_expert_updates, experts_module, parse_expert_updates, read_expert


class ExpertVersions:
    """The engine's expert versions: the current one, the swaps a rollback undoes, and the version whose
    weights `VersionedExperts` modules hold (`held`, None when none are swapped in)."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, dtype: torch.dtype):
        self.model, self.cfg, self.dtype = model, cfg, dtype
        self.current = 0
        self.held: int | None = None
        self._last = 0  # versions are never reused, also after a rollback
        self._swaps: list[tuple[int, dict]] = []  # (version before each swap, the replaced experts' weights)

    def cache_salt(self, salt: str | None) -> str | None:
        """After a first swap, KV blocks are shared only within one expert version."""
        return f"{salt or ''}|experts-v{self.current}" if self._last else salt

    def version_of(self, started: int) -> int | str:
        """The version a request started on `started` runs on: that one while it is current or held, else
        "started->current" (a second swap or a rollback overtook it: it is told)."""
        return started if started in (self.current, self.held) else f"{started}->{self.current}"

    def swap(self, updates: dict, running: set[int]) -> int:
        """Validate and write `updates` (see `LLMEngine.swap_experts`); `running`: the versions unfinished
        requests started on. Returns the new version."""
        parsed = parse_expert_updates(updates, self.cfg, self.dtype)
        before = {key: read_expert(experts_module(self.model, key[0]), key[1]) for key in parsed}
        apply_expert_updates(self.model, parsed)
        self._swaps.append((self.current, before))
        self._last += 1
        return self._switch(self._last, before, running)

    def rollback(self, running: set[int]) -> int:
        """Undo the latest swap; requests started on the undone version keep it (held). -> the version."""
        if not self._swaps:
            raise ValueError("no expert swap to roll back")
        version, before = self._swaps.pop()
        undone = {key: read_expert(experts_module(self.model, key[0]), key[1]) for key in before}
        apply_expert_updates(self.model, before)
        return self._switch(version, undone, running)

    def release_unused(self, running: set[int]) -> None:
        """Swap the `VersionedExperts` out once no unfinished request runs on the held version."""
        if self.held is not None and self.held not in running:
            self._unhold()

    def _switch(self, version: int, old_weights: dict, running: set[int]) -> int:
        old_version, self.current = self.current, version
        self._unhold()
        if old_version in running and self.cfg.moe_type == "topk":
            per_layer: dict[int, dict] = {}
            for (layer, e), w in old_weights.items():
                per_layer.setdefault(layer, {})[e] = (torch.cat([w["gate"], w["up"]]), w["down"])  # [2I, H], [H, I]
            for layer, old in per_layer.items():
                mlp = self.model.model.layers[layer].mlp
                mlp.experts = VersionedExperts(mlp.experts, old_version, old)
            self.held = old_version
        return version

    def _unhold(self) -> None:
        for layer in self.model.model.layers:
            mlp = layer.mlp
            if isinstance(mlp, MoE) and isinstance(mlp.experts, VersionedExperts):
                mlp.experts = mlp.experts.inner
        self.held = None
