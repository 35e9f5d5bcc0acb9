"""`ServerConfig`: HTTP, security, admission and dynamic-batching settings of `glm5 serve`.

The engine has its own `EngineConfig` (glm5/infer/config.py); the dynamic-batching knobs live there
(`max_batch_size`, `preferred_batch_size`, `batch_timeout_ms`, `batch_by_length`): the engine scheduler's
waiting queue is the one admission queue and applies them (`Batching`); `max_waiting_requests` bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"  # bind address; loopback unless told otherwise
    port: int = 8000  # TCP port
    # Bearer (x-api-key too) key on /v1/*, /tokenize, /detokenize, /infill; /health, /metrics open. Several
    # keys (one per tenant) are all accepted, and each is a tenant of its own for the per-key limits below
    api_key: str | tuple[str, ...] | None = None
    admin_key: str | None = None  # Bearer key required on /admin/*; admin routes are off without it
    served_model_name: str | None = None  # model id clients must send; default: the model path's name
    max_waiting_requests: int = 256  # past this many requests waiting (not running yet) answer 503 + Retry-After
    retry_after_s: int = 1  # value of the Retry-After header on 503 and 429
    # Per tenant (API key; the client address on a server without keys): at most this many requests served
    # at once (None = no per-tenant limit), `max_waiting_per_key` more wait their turn, past that a 429
    max_running_per_key: int | None = None
    max_waiting_per_key: int = 16
    max_body_bytes: int = 4 * 2**20  # request body bound for API routes (413 beyond)
    max_admin_body_bytes: int = 2 * 2**30  # bound for expert uploads
    default_max_tokens: int = 256  # when a request gives no max_tokens (capped by the context left)
    tokenizer_workers: int = 2  # threads that render chat templates and tokenise prompts (off the event loop)
    shutdown_timeout_s: float = 10.0  # on SIGTERM: running requests get this long, then end with an error
    # GLM XML tool calls: "glm45" (GLM-4.5/4.6: name, then one <arg_key>/<arg_value> per line), "glm47"
    # (GLM-4.7/5: compact), "auto" = the layout the checkpoint's chat template writes (else glm45 for a
    # glm4_moe checkpoint, glm47 otherwise), "" = off
    tool_parser: Literal["auto", "glm47", "glm45", ""] = "auto"
    reasoning_parser: Literal["glm45", ""] = "glm45"  # `<think>` -> reasoning_content ("" = off)
    # /infill and `suffix`: "auto" = GLM blank infilling on a model trained for it, else GLM's code-completion
    # prompt ("codegeex") when the vocabulary has <|code_*|>, else sentinel FIM (suffix first, "spm");
    # "psm" = sentinel FIM in prefix-suffix-middle order (glm5/infer/infill.py)
    infill_format: Literal["auto", "glm", "codegeex", "spm", "psm"] = "auto"
    max_stored_responses: int = 256  # /v1/responses kept for `previous_response_id` (oldest evicted first)
    infill_truncate: bool = True  # too long prefix/suffix: cut the far ends (reported) instead of a 400

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s: must be >= 0 seconds, got {self.shutdown_timeout_s}")
        if isinstance(self.api_key, tuple) and (not self.api_key or not all(self.api_key)):
            raise ValueError("api_key: a list of keys must hold at least one key, none of them empty")
        if self.api_key == "":
            raise ValueError("api_key: must not be empty (leave it unset to serve without a key)")
        if self.max_running_per_key is not None and self.max_running_per_key < 1:
            raise ValueError("max_running_per_key: must be >= 1 (or unset for no per-key limit)")
        if self.max_waiting_per_key < 0:
            raise ValueError("max_waiting_per_key: must be >= 0")
        for name in ("max_waiting_requests", "max_body_bytes", "max_admin_body_bytes", "tokenizer_workers",
                     "max_stored_responses"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key (empty: the API is open)."""
        if self.api_key is None:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else self.api_key
