"""Prefix tuning: a prefix initialised from a prompt's cache entries must reproduce the plain model run
on that prompt (dense and DSA-sparse layers, shared indexer layers), train only the prefix, and round-trip
through its files."""

import json

import pytest
import torch

from glm5.finetune import prefix
from glm5.model.peft_adapter import AdapterError

from ._tiny import tiny_model


@pytest.mark.parametrize("kw", [dict(index_topk=64), dict(index_topk=5, num_hidden_layers=4, index_topk_freq=2,
                                                              index_skip_topk_offset=1)],
                         ids=["dense", "sparse_shared_indexer"])
def test_prefix_from_tokens_equals_the_prompt(kw):
    model = tiny_model(seed=4, bias_std=0.1, **kw)
    g = torch.Generator().manual_seed(0)
    prompt, x = torch.randint(2, 512, (6,), generator=g), torch.randint(2, 512, (2, 11), generator=g)
    with torch.no_grad():
        ref = model(torch.cat([prompt[None].expand(2, -1), x], dim=1)).logits[:, 6:]
        prefix.apply_prefix(model, 6)
        prefix.init_from_tokens(model, prompt)
        got = model(x, position_ids=torch.arange(6, 17)[None].expand(2, -1)).logits
    assert (got - ref).abs().max() < 1e-4


def test_only_the_prefix_trains_and_files_round_trip(tmp_path):
    model = tiny_model(seed=5)
    prefix.apply_prefix(model, 3)
    x = torch.randint(2, 512, (2, 9))
    pos = torch.arange(3, 12)[None].expand(2, -1)
    model(x, position_ids=pos).logits.square().mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".prefix." in n for n in grads)  # indexer keys: top-k has no gradient
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == grads | {n for n in trainable if n.endswith("indexer.prefix_key")}
    prefix.save_prefix(model, tmp_path / "p", "base-dir")
    cfg = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "GLM5_MLA_PREFIX" and cfg["num_virtual_tokens"] == 3
    other = tiny_model(seed=5)
    assert prefix.load_prefix(other, tmp_path / "p") == 3
    with torch.no_grad():
        assert torch.equal(other(x, position_ids=pos).logits, model(x, position_ids=pos).logits)
    prefix.remove_prefix(other)
    with torch.no_grad():
        assert torch.equal(other(x).logits, tiny_model(seed=5)(x).logits)
    with pytest.raises(AdapterError, match="kv_lora_rank = 16 but the model has 8"):
        prefix.load_prefix(tiny_model(seed=5, kv_lora_rank=8), tmp_path / "p")
