"""Expert hot swap lives in the engine: the model package knows no versions, shadows or pinned rows, and the
swapped-in `VersionedExperts` runs the rows tagged with its version on the old weights (vs the per-expert
reference loop on those weights) and every other row on the current ones."""

import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import torch

import glm5.model
from glm5.infer.experts import VersionedExperts, experts_module
from glm5.model.moe import MoE
from glm5.model.paged import AttnMetadata, PagedContext

from ._tiny import reference_experts, tiny_config

HOT_SWAP = re.compile(r"shadow|pinned|version|hot_?swap|use_reference", re.I)


def test_model_package_has_no_hot_swap_names():
    """No module, class, attribute or metadata field of glm5.model is about hot swap or a test switch."""
    names = set()
    for info in pkgutil.iter_modules(glm5.model.__path__):
        mod = importlib.import_module(f"glm5.model.{info.name}")
        names |= set(vars(mod))
        for obj in vars(mod).values():
            if isinstance(obj, type) and obj.__module__ == mod.__name__:
                names |= set(vars(obj))
                if dataclasses.is_dataclass(obj):
                    names |= {f.name for f in dataclasses.fields(obj)}
    assert not sorted(n for n in names if HOT_SWAP.search(n))
    names = {name for name, _ in MoE(tiny_config()).named_modules()} | set(vars(MoE(tiny_config())))
    assert not sorted(n for n in names if HOT_SWAP.search(n))
    src = "".join(p.read_text() for p in Path(glm5.model.__file__).parent.glob("*.py"))
    for word in ("ExpertShadow", "expert_shadow", "pinned_rows", "model_version", "experts-v", "use_reference"):
        assert word not in src, word


def _moe(seed):
    torch.manual_seed(seed)
    m = MoE(tiny_config(n_routed_experts=8, num_experts_per_tok=2))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m.eval()


def test_versioned_experts_run_tagged_rows_on_the_old_weights():
    m = _moe(3)
    old_gu, old_dn = m.experts.gate_up_proj.detach().clone(), m.experts.down_proj.detach().clone()
    swapped = (1, 3, 6)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the swap writes new weights into the experts in place
        for e in swapped:
            m.experts.gate_up_proj[e] = torch.randn(old_gu.shape[1:], generator=g) * 0.2
            m.experts.down_proj[e] = torch.randn(old_dn.shape[1:], generator=g) * 0.2
    new_gu, new_dn = m.experts.gate_up_proj.detach().clone(), m.experts.down_proj.detach().clone()
    m.experts = VersionedExperts(m.experts, 4, {e: (old_gu[e], old_dn[e]) for e in swapped})
    N = 24
    x = torch.randn(1, N, 64, generator=g)
    tags = torch.tensor([4, 5] * (N // 2))  # even rows started on version 4 (held), odd ones on the current 5
    meta = AttnMetadata(torch.arange(N), torch.arange(N), [0, N], row_tags=tags)
    with torch.no_grad():
        out, stats = m(x, PagedContext(meta, None))
        _, _, w, idx = m.gate(x[0])
        assert torch.isin(idx[0::2], torch.tensor(swapped)).any()  # some held rows do route to swapped experts
        shared = m.shared_experts(x[0])
        old = reference_experts(old_gu, old_dn, x[0], idx, w) + shared
        new = reference_experts(new_gu, new_dn, x[0], idx, w) + shared
        assert torch.allclose(out[0, 0::2], old[0::2], atol=1e-5)
        assert torch.allclose(out[0, 1::2], new[1::2], atol=1e-5)
        assert not torch.allclose(old[0::2], new[0::2], atol=1e-3)  # the versions do differ on those rows
        untagged, _ = m(x, PagedContext(dataclasses.replace(meta, row_tags=None), None))
        assert torch.allclose(untagged[0], new, atol=1e-5)  # no tags (no held request in the step): current
        assert torch.allclose(m(x)[0][0], new, atol=1e-5)  # dense forward (no paged context): current


def test_engine_swaps_the_versioned_module_in_and_out():
    """While a request started before a swap runs, the touched layer's experts are a VersionedExperts over the
    (updated) experts module; once it finishes, the plain module is back, holding the new weights."""
    from glm5.infer.config import EngineConfig
    from glm5.infer.engine import LLMEngine
    from glm5.infer.sampling import SamplingParams

    from ._tiny import tiny_model
    engine = LLMEngine(EngineConfig(device="cpu", num_blocks=32, block_size=4, max_model_len=32), model=tiny_model(seed=2))
    layer = engine.model_config.moe_layers[0]
    plain = engine.model.model.layers[layer].mlp.experts
    engine.add_request("a", prompt_token_ids=[5, 6, 7], params=SamplingParams(temperature=0, max_tokens=4))
    engine.step()
    down = torch.full((64, 32), 0.01)
    assert engine.swap_experts({f"model.layers.{layer}.mlp.experts.2.down_proj.weight": down}) == 1
    held = engine.model.model.layers[layer].mlp.experts
    assert isinstance(held, VersionedExperts) and held.inner is plain and held.version == 0
    assert experts_module(engine.model, layer) is plain and torch.equal(plain.down_proj[2], down)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.model.model.layers[layer].mlp.experts is plain and engine.versions.held is None
