"""`glm5 serve`: the OpenAI-compatible server.

    glm5 serve --model PATH_OR_PRESET [--host 127.0.0.1] [--port 8000] [--api-key KEY ...] [--admin-key KEY]
               [--lora NAME=DIR ...] [--max-loras N] [--tool-call-parser auto|glm45|glm47]
               [--config serve.toml] [--engine.max_num_seqs=64 |
               --max_num_seqs=64] [--server.key=value]
               [--ocr [--ocr-model CKPT] [--ocr-rounds N]    # POST /v1/ocr and image_url chat parts
                      [--ocr-max-work-mpx MPX] [--ocr-timeout-s S]]  # per-page limits (docs/ocr.md)

`--config` is a TOML file with `[engine]` (EngineConfig) and `[server]` (ServerConfig) tables. Engine and
server fields can be overridden as `--engine.key=value` / `--server.key=value`, or flat as `--key=value`
(`--key value`) when the name is unambiguous. Keys may also come from the environment (`GLM5_API_KEY`,
`GLM5_ADMIN_KEY`) so they stay out of the process list. Binds 127.0.0.1 unless `--host` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from glm5.core.config import ConfigError, apply_overrides, from_dict, load_toml
from glm5.infer.config import EngineConfig
from glm5.serve.config import ServerConfig

ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerConfig)}


def parse_args(argv: list[str]) -> tuple[EngineConfig, ServerConfig]:
    p = argparse.ArgumentParser(prog="glm5 serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="checkpoint directory or preset name; default: the embedded model bundled:smollm2-glm5 "
                        "(SmolLM2-135M-Instruct in GLM-5 architecture, built on first use)")
    p.add_argument("--config", help="TOML with [engine] and [server] tables")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 8000)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require this key on /v1/* as Bearer or x-api-key (or set GLM5_API_KEY); repeat it for "
                        "one key per tenant (each its own tenant under --max-running-per-key)")
    p.add_argument("--admin-key", help="enable /admin/* with this Bearer key (or set GLM5_ADMIN_KEY)")
    p.add_argument("--served-model-name", help="model id clients send (default: the model's name)")
    p.add_argument("--tool-call-parser", choices=["auto", "glm45", "glm47", ""],
                   help="tool-call layout: glm45 (GLM-4.5/4.6, one <arg_key>/<arg_value> per line), glm47 "
                        "(GLM-4.7/5, compact); default auto: from the checkpoint's chat template / model_type")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="serve a PEFT LoRA adapter as model NAME (repeatable; see docs/finetune.md)")
    args, rest = p.parse_known_args(argv)
    d = load_toml(args.config) if args.config else {}
    unknown = set(d) - {"engine", "server"}
    if unknown:
        raise ConfigError(f"unknown config table(s) {sorted(unknown)}; expected [engine] and [server]")
    engine_d, server_d = dict(d.get("engine", {})), dict(d.get("server", {}))
    apply_overrides(d := {"engine": engine_d, "server": server_d}, _qualify(_pairs(rest)))
    from glm5.cli.models import EMBEDDED_ENGINE_DEFAULTS, embedded_name, is_embedded, resolve_model
    if is_embedded(args.model):
        if engine_d.get("speculative_num_tokens", 1) == 0:  # speculation off: no prompt lookup either
            engine_d.setdefault("prompt_lookup_max", 0)
        for key, value in EMBEDDED_ENGINE_DEFAULTS.items():
            engine_d.setdefault(key, value)
        server_d.setdefault("served_model_name", embedded_name())
    engine_d["model"] = resolve_model(args.model)
    if args.lora:
        engine_d["lora_modules"] = {**engine_d.get("lora_modules", {}), **_lora_pairs(args.lora)}
    for key, value in (("host", args.host), ("port", args.port), ("served_model_name", args.served_model_name),
                       ("tool_parser", args.tool_call_parser),
                       ("api_key", _keys(args.api_key) or os.environ.get("GLM5_API_KEY") or None),
                       ("admin_key", args.admin_key or os.environ.get("GLM5_ADMIN_KEY") or None)):
        if value is not None:
            server_d[key] = value
    return from_dict(EngineConfig, d["engine"], "engine"), from_dict(ServerConfig, d["server"], "server")


def _keys(keys: list[str] | None) -> str | list[str] | None:
    """`--api-key` values: one key as itself, several as the list (a tenant each)."""
    if not keys:
        return None
    return keys[0] if len(keys) == 1 else keys


def _lora_pairs(items: list[str]) -> dict[str, str]:
    """`--lora NAME=DIR` values -> {NAME: DIR}."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {item!r}: expected NAME=DIR")
        out[name] = path
    return out


def _pairs(rest: list[str]) -> list[str]:
    """`--k=v` and `--k v` -> ["k=v", ...]."""
    out, i = [], 0
    while i < len(rest):
        item = rest[i]
        if not item.startswith("--"):
            raise ConfigError(f"unexpected argument {item!r}")
        if "=" not in item:
            if i + 1 >= len(rest):
                raise ConfigError(f"{item} needs a value")
            item, i = f"{item}={rest[i + 1]}", i + 1
        out.append(item[2:].replace("-", "_", item.find("=")) if "." not in item.split("=")[0] else item[2:])
        i += 1
    return out


def _qualify(pairs: list[str]) -> list[str]:
    """Give flat `key=value` its table: engine fields first, then server fields."""
    out = []
    for item in pairs:
        key = item.split("=", 1)[0]
        if "." in key:
            if key.split(".")[0] not in ("engine", "server"):
                raise ConfigError(f"unknown option --{key}; use --engine.KEY or --server.KEY")
            out.append(item)
        elif key in ENGINE_FIELDS:
            out.append(f"engine.{item}")
        elif key in SERVER_FIELDS:
            out.append(f"server.{item}")
        else:
            raise ConfigError(f"unknown option --{key} (not an EngineConfig or ServerConfig field)")
    return out


def parse_ocr_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """`--ocr [--ocr-model CKPT] [--ocr-rounds N] [--ocr-max-work-mpx MPX] [--ocr-timeout-s S]`: answer
    image_url parts and POST /v1/ocr with the OCR agent; a page over the work budget is a 413, one not
    read within the timeout a 504. Both must be > 0 (`inf` turns a limit off), as in `glm5 ocr`."""
    from glm5.apps.ocr.limits import MAX_WORK_MPX  # noqa: PLC0415 - numpy only, no OCR extra needed

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--ocr", action="store_true")
    p.add_argument("--ocr-model", default=None)
    p.add_argument("--ocr-rounds", type=int, default=2)
    p.add_argument("--ocr-max-work-mpx", type=float, default=MAX_WORK_MPX)
    p.add_argument("--ocr-timeout-s", type=float, default=OCR_TIMEOUT_S)
    return p.parse_known_args(argv)


OCR_TIMEOUT_S = 120.0
"""Default deadline of one page on the server (before the limits, the issue-30 probe's 6000 x 6000 page got
no answer within 121 s)."""


def _limit(value: float) -> float | None:
    """A > 0 limit flag: `inf` is no limit (None)."""
    return None if math.isinf(value) else value


def main(argv: list[str]) -> int:
    try:
        ocr_args, argv = parse_ocr_args(argv)
        engine_cfg, server_cfg = parse_args(argv)
        for flag, value in (("--ocr-max-work-mpx", ocr_args.ocr_max_work_mpx), ("--ocr-timeout-s", ocr_args.ocr_timeout_s)):
            if not value > 0:  # NaN too
                raise ConfigError(f"{flag}: must be > 0 (inf for no limit), got {value:g}")
    except ConfigError as e:
        print(f"glm5 serve: {e}")
        return 2
    from glm5.infer.engine import LLMEngine
    from glm5.infer.malloc import trim_malloc, tune_malloc
    from glm5.serve.app import create_app
    from glm5.serve.server import GracefulServer

    tune_malloc()  # a serving process: reuse freed pages instead of faulting in fresh ones each step
    try:
        engine = LLMEngine(engine_cfg)
    except (ValueError, OSError) as e:  # a bad setting or checkpoint: say which, without a traceback
        print(f"glm5 serve: cannot start the engine: {e}")
        return 2
    server: GracefulServer | None = None
    agent, reader = None, None
    if ocr_args.ocr:
        from glm5.apps.ocr import server as ocr_server
        from glm5.apps.ocr.agent import OcrAgent, OcrConfig
        try:
            agent = OcrAgent(OcrConfig(rounds=ocr_args.ocr_rounds, model=ocr_args.ocr_model,
                                       max_work_mpx=_limit(ocr_args.ocr_max_work_mpx),
                                       timeout_s=_limit(ocr_args.ocr_timeout_s)))
        except ValueError as e:
            print(f"glm5 serve: --ocr: {e}")
            return 2
        reader = lambda url: ocr_server.image_part_text(agent, url)  # noqa: E731
    app = create_app(engine, config=server_cfg, on_engine_failure=lambda e: server.engine_failed(e),
                     image_reader=reader, on_idle=trim_malloc)  # quiet again: give the peak's pages back
    if agent is not None:
        ocr_server.install(app, agent)
    server = GracefulServer(app, server_cfg.host, server_cfg.port, server_cfg.shutdown_timeout_s)
    print(f"glm5 serve: {app.state.serve.model_name} on http://{server_cfg.host}:{server_cfg.port} "
          f"(auth {'on' if server_cfg.api_key else 'off'}, admin {'on' if server_cfg.admin_key else 'off'})")
    server.run()
    if server.engine_failure is not None:
        e = server.engine_failure
        print(f"glm5 serve: the engine failed ({type(e).__name__}: {e}); exiting with status 3 so that a "
              "supervisor restarts the server")
        return 3
    return 0
