"""glm5: an open, readable, fast PyTorch implementation of the GLM-5 system.

Top-level names are imported lazily so that `import glm5` stays cheap.
"""

__version__ = "0.1.0"

_LAZY = {
    "ModelConfig": "glm5.model.config",
    "GLM5ForCausalLM": "glm5.model.model",
    "from_pretrained": "glm5.finetune.adapters",  # HF checkpoint (+ adapter=DIR)
    "save_pretrained": "glm5.model.hf_adapter",  # save_pretrained(model, dir, max_shard_size="5GB")
    "GenerationConfig": "glm5.model.generation_config",
    "LLM": "glm5.infer.llm",
    "SamplingParams": "glm5.infer.sampling",
    "embedded_model": "glm5.apps.embedded",  # the embedded default model's directory, built on first use
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'glm5' has no attribute {name!r}")


__all__ = list(_LAZY)
