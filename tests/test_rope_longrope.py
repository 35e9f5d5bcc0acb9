"""`longrope` per-pair RoPE frequencies (how a converted Llama's shared rope key gets its frequencies), the
built-model names of `bundled:`, and tied embeddings through save/load."""

import pytest
import torch

from glm5.core import resources
from glm5.model.config import ModelConfig, ModelConfigError
from glm5.model.hf_adapter import from_pretrained
from glm5.model.model import GLM5ForCausalLM


def _longrope(factors, **extra):
    return {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": factors, "long_factor": list(factors),
            "factor": 1.0, "attention_factor": 1.0, "original_max_position_embeddings": 256, **extra}


def _cfg(rope, **kw):
    return ModelConfig.from_preset("tiny", rope_parameters=rope, max_position_embeddings=256, **kw)


def test_longrope_inverse_frequencies_match_transformers():
    from transformers import GlmMoeDsaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    half = ModelConfig.from_preset("tiny").qk_rope_head_dim // 2
    factors = [0.5 + 0.37 * i for i in range(half)]
    cfg = _cfg(_longrope(factors))
    hf = GlmMoeDsaConfig(**{k: v for k, v in cfg.to_dict().items() if k not in ("architectures", "model_type")})
    want, scale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    assert scale == 1.0
    torch.testing.assert_close(cfg.rope_inv_freq(), want, rtol=0, atol=0)
    # and it is not the default schedule: the factors changed every pair but the first
    default = _cfg({"rope_type": "default", "rope_theta": 1e4}).rope_inv_freq()
    assert not torch.allclose(cfg.rope_inv_freq()[1:], default[1:])
    model = GLM5ForCausalLM(cfg)
    torch.testing.assert_close(model.model.inv_freq, want, rtol=0, atol=0)


HALF = ModelConfig.from_preset("tiny").qk_rope_head_dim // 2


@pytest.mark.parametrize("change, words", [
    ({"short_factor": [1.0, 2.0]}, "short_factor"),
    ({"long_factor": [2.0] * HALF}, "changes the frequencies with the sequence length"),
    ({"attention_factor": 1.2}, "attention_factor"),
    ({"original_max_position_embeddings": None}, "original_max_position_embeddings"),
    ({"short_factor": [0.0] * HALF}, "positive"),
])
def test_longrope_refuses_what_it_cannot_compute(change, words):
    rope = {**_longrope([1.0] * HALF), **change}
    with pytest.raises(ModelConfigError, match="rope_parameters") as e:
        ModelConfig.from_preset("tiny", rope_parameters=rope, max_position_embeddings=512)
    assert words in str(e.value)


def test_unknown_rope_type_named():
    with pytest.raises(ModelConfigError, match="rope_parameters"):
        _cfg({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})


def test_tied_embeddings_stay_tied_through_save_and_load(tmp_path):
    cfg = ModelConfig.from_preset("tiny", tie_word_embeddings=True)
    model = GLM5ForCausalLM(cfg).init_weights(seed=3)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    x = torch.tensor([[3, 9, 27, 81 % cfg.vocab_size]])
    torch.testing.assert_close(loaded(x).logits, model.eval()(x).logits, rtol=0, atol=0)


def test_built_model_names_resolve_only_once_built(tmp_path, monkeypatch):
    monkeypatch.setenv("GLM5_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="glm5 quickstart"):
        resources.resolve_path("bundled:smollm2-glm5")
    built = resources.built_model_dir("smollm2-glm5")
    assert built.parent == tmp_path / "models"
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    assert resources.resolve_path("bundled:smollm2-glm5") == built
    assert resources.resolve_path("bundled:tokenizer-8k").is_dir()  # shipped assets unchanged
