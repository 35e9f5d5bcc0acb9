"""A live server on the REAL engine with a tiny random checkpoint (shared by the hardening tests)."""

import contextlib

import torch

from glm5.data.tokenizer import load_tokenizer
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.model.config import ModelConfig
from glm5.model.hf_adapter import save_pretrained
from glm5.model.model import GLM5ForCausalLM
from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.testing import serve_in_thread

TOK = load_tokenizer("bundled:tokenizer-8k")
PROMPT = "The capital of France is"


@contextlib.contextmanager
def live_server(path, max_model_len: int = 128, server: ServerConfig | None = None, on_idle=None, **engine_kw):
    """Yields {"url", "engine", "app", "expected" (greedy 6-token continuation of PROMPT), "vocab"}."""
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).init_weights(0).eval()
    save_pretrained(model, path)
    TOK.save(path)
    engine = LLMEngine(EngineConfig(**{"model": str(path), "device": "cpu", "dtype": "float32",
                                       "max_model_len": max_model_len, "num_blocks": 64, "block_size": 16,
                                       "max_num_seqs": 8, "batch_timeout_ms": 0, **engine_kw}))
    prompt_ids = TOK.encode(PROMPT, add_special_tokens=True)
    expected = TOK.decode(model.generate_greedy(torch.tensor([prompt_ids]), 6)[0, len(prompt_ids):].tolist(),
                          skip_special_tokens=True)
    app = create_app(engine, config=server or ServerConfig(), model_name="tiny", on_idle=on_idle)
    with serve_in_thread(app) as url:
        yield {"url": url, "engine": engine, "expected": expected, "vocab": cfg.vocab_size, "app": app}
