import json

import pytest

from glm5.model.config import ModelConfig, ModelConfigError, list_presets
from glm5.model.params import count_parameters


def test_presets_exist():
    assert {"tiny", "small", "glm-5", "glm-5.2"} <= set(list_presets())


def test_round_trip_keeps_unknown_and_legacy_keys(tmp_path):
    d = ModelConfig.from_preset("glm-5").to_dict()
    d.update({"ep_size": 1, "pretraining_tp": 1, "transformers_version": "5.0.2.dev0",
              "some_future_key": {"a": [1, 2]}})
    cfg = ModelConfig.from_dict(d)
    cfg.save(tmp_path)
    back = json.loads((tmp_path / "config.json").read_text())
    assert back == d
    assert ModelConfig.from_pretrained(tmp_path).to_dict() == d


def test_legacy_rope_theta_key():
    d = ModelConfig.from_preset("tiny").to_dict()
    d.pop("rope_parameters")
    d["rope_theta"] = 12345.0
    assert ModelConfig.from_dict(d).rope_theta == 12345.0


def test_derived_fields_match_transformers():
    transformers = pytest.importorskip("transformers")
    for kw in [dict(index_topk_freq=4, index_skip_topk_offset=3), dict(index_topk_pattern="FFSFSS" * 13),
               dict(), dict(first_k_dense_replace=5)]:
        ours = ModelConfig.from_preset("glm-5", **kw)
        theirs = transformers.GlmMoeDsaConfig(**{k: v for k, v in ours.to_dict().items()
                                                 if k not in ("indexer_types", "mlp_layer_types", "layer_types")})
        assert ours.indexer_types == theirs.indexer_types
        assert ours.mlp_layer_types == theirs.mlp_layer_types
        assert ours.qk_head_dim == theirs.qk_head_dim and ours.head_dim == theirs.head_dim


def test_glm52_indexshare():
    cfg = ModelConfig.from_preset("glm-5.2")
    full = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
    assert len(full) == 21 and full[:5] == [0, 1, 2, 6, 10] and full[-1] == 74
    assert cfg.rope_theta == 8e6


def test_glm5_parameter_counts():
    c = count_parameters(ModelConfig.from_preset("glm-5"))
    assert c["total"] == 743_911_218_432
    assert c["total_with_mtp"] - c["total"] == 9_952_920_576
    assert round(c["active_non_embedding"] / 1e9, 2) == 39.88
    assert c["breakdown"]["routed_experts"] == 75 * 256 * 3 * 6144 * 2048


@pytest.mark.parametrize("key,value,needle", [
    ("hidden_size", "big", "'hidden_size' must be an integer"),
    ("num_experts_per_tok", 300, "'num_experts_per_tok'"),
    ("n_group", 3, "'n_group'"),
    ("scoring_func", "relu", "'scoring_func'"),
    ("indexer_types", ["shared"] * 78, "'indexer_types'"),
    ("mlp_layer_types", ["dense"], "'mlp_layer_types'"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1.0}, "'rope_parameters'"),
    ("qk_rope_head_dim", 7, "'qk_rope_head_dim'"),
])
def test_bad_config_names_the_key(key, value, needle):
    d = ModelConfig.from_preset("glm-5").to_dict()
    d[key] = value
    with pytest.raises(ModelConfigError, match=needle):
        ModelConfig.from_dict(d)


def test_unknown_preset_lists_available():
    with pytest.raises(ModelConfigError, match="available"):
        ModelConfig.from_preset("nope")
