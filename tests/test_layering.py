"""The import-direction rule: a module imports only from its own or lower layers.

core < model | data < convert < train | infer < finetune | serve | eval | distill < apps < cli. `convert`
(other architectures rewritten as GLM-5) reads model files and tokenizers, so it sits on model and data.
`apps` (the OCR agent, the embedded default model) builds on every library layer and adds routes to the
server, so it sits above `serve`. `model` and `data` never import
each other; `model/` is pure math (no I/O modules besides core). Parsed with `ast`, so it also sees
imports inside functions.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "glm5"
LEVEL = {"core": 0, "native": 0.5, "model": 1, "data": 1, "convert": 1.5, "train": 2, "infer": 2, "finetune": 3, "serve": 3,
         "eval": 3, "distill": 3, "apps": 4, "cli": 5}
FORBIDDEN_SAME_LEVEL = {("model", "data"), ("data", "model"), ("train", "infer"), ("infer", "train")}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the file's package
                base = path.relative_to(PKG.parent).with_suffix("").parts[: -node.level]
                yield ".".join(base + ((node.module,) if node.module else ()))
            elif node.module:
                yield node.module


def test_import_direction():
    bad = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).parts
        if len(rel) < 2:
            continue  # glm5/__init__.py re-exports lazily
        src = rel[0]
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] != "glm5" or len(parts) < 2 or parts[1] not in LEVEL:
                continue
            dst = parts[1]
            if dst == src:
                continue
            if LEVEL[dst] > LEVEL[src] or (LEVEL[dst] == LEVEL[src]) or (src, dst) in FORBIDDEN_SAME_LEVEL:
                bad.append(f"{path.relative_to(PKG.parent)} imports {mod}")
    assert not bad, "imports against the layering rule:\n" + "\n".join(bad)


def test_model_has_no_io_or_dist():
    """model/ is pure math: no process groups, no CLI/logging/file formats (hf_adapter excepted)."""
    bad = []
    for path in (PKG / "model").rglob("*.py"):
        if path.name in ("hf_adapter.py", "peft_adapter.py"):  # checkpoint / adapter file interchange
            continue
        for mod in _imports(path):
            if mod.startswith(("torch.distributed", "argparse", "safetensors", "glm5.core.io")):
                bad.append(f"{path.name} imports {mod}")
    assert not bad, bad


def test_every_cli_command_has_a_module_with_main():
    import importlib

    from glm5.cli.main import COMMANDS
    for name, (module, _) in COMMANDS.items():
        assert callable(importlib.import_module(f"glm5.cli.{module}").main), name
