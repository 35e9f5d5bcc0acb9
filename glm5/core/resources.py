"""Package data: the configs, model presets and bundled assets that ship inside the `glm5` package.

Everything a user runs by name (`--config configs/train/tiny.toml`, `--preset glm-5`, the bundled
tokenizer and corpus, the default chat template) is found through `importlib.resources`, never through
the repository root, so a wheel or `pip install .` works from any directory. Layout inside the package:

    glm5/configs/<kind>/<name>.toml      kind = model (presets) | data | train
    glm5/data/assets/<name>              tokenizer-8k/ (tokenizer + chat template), corpus/

A config argument is a path when that file exists, else the name of a packaged config: `train/tiny`,
`train/tiny.toml` and the README's `configs/train/tiny.toml` all name the same packaged file. A path
value written `bundled:<name>` (in configs and on the command line) names a bundled asset; a few names are
models built on first use from an installed package and cached (`bundled:smollm2-glm5`, see
glm5/apps/embedded.py), found here once built. stdlib only.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

BUNDLED_PREFIX = "bundled:"
# Models built on first use (not shipped as files): name -> cache version (bumped when the recipe changes).
BUILT_MODELS = {"smollm2-glm5": 2}  # bump when the build recipe changes: old caches are not reused


def package_dir(*parts: str) -> Path:
    """A directory or file inside the installed `glm5` package, as a filesystem path."""
    root = files("glm5")
    if not isinstance(root, Path):  # zip imports hand out Traversables we cannot give to other libraries
        raise RuntimeError("glm5 must be installed as files on disk (not imported from a zip archive)")
    return root.joinpath(*parts)


def configs_dir() -> Path:
    return package_dir("configs")


def list_configs(kind: str) -> list[str]:
    """Names of the packaged configs of one kind (`model`, `data`, `train`), e.g. ['small', 'tiny']."""
    return sorted(p.stem for p in (configs_dir() / kind).glob("*.toml"))


def packaged_config(name: str) -> Path | None:
    """The packaged config that `name` refers to (`train/tiny`, `configs/train/tiny.toml`), or None."""
    rel = name.replace("\\", "/").removeprefix("./").removeprefix("configs/")
    if not rel.endswith(".toml"):
        rel += ".toml"
    path = configs_dir() / rel
    return path if "/" in rel and ".." not in rel.split("/") and path.is_file() else None


def config_file(name_or_path: str | Path) -> Path:
    """An existing TOML file, else the packaged config of that name; FileNotFoundError lists the choices."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    packaged = packaged_config(str(name_or_path))
    if packaged is not None:
        return packaged
    kinds = sorted(p.name for p in configs_dir().iterdir() if p.is_dir())
    names = [f"{k}/{n}" for k in kinds for n in list_configs(k)]
    raise FileNotFoundError(f"config file not found: {name_or_path} (not a file, nor a packaged config; "
                            f"packaged: {names})")


def bundled(name: str) -> Path:
    """A bundled asset by name (`tokenizer-8k`, `corpus/train.jsonl.gz`)."""
    path = package_dir("data", "assets", *name.strip("/").split("/"))
    if not path.exists():
        available = sorted(p.name for p in package_dir("data", "assets").iterdir())
        raise FileNotFoundError(f"no bundled asset {name!r}; bundled: {available}")
    return path


def resolve_path(value: str | Path) -> Path:
    """A path from a config or the command line: `bundled:<name>` -> the bundled asset (or the cached
    build of a built model), else as given."""
    text = str(value)
    if text.startswith(BUNDLED_PREFIX):
        name = text[len(BUNDLED_PREFIX):]
        if name in BUILT_MODELS:
            path = built_model_dir(name)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(
                    f"{text} is built on first use and is not built yet: run `glm5 quickstart` (or any glm5 "
                    f"command without --model), or call glm5.embedded_model() in Python")
            return path
        return bundled(name)
    return Path(value)


def cache_dir() -> Path:
    """Where built models and compiled kernels are cached: $GLM5_CACHE, else ~/.cache/glm5."""
    env = os.environ.get("GLM5_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "glm5"


def built_model_dir(name: str) -> Path:
    """The cache directory of a built model (it may not exist yet)."""
    return cache_dir() / "models" / f"{name}-v{BUILT_MODELS[name]}"
