"""Package data: configs, presets and bundled assets resolve inside the package, from any directory,
and every data file in the package is declared as package data (so the wheel carries it;
`.ci/wheel_smoke` checks a real wheel install)."""

import fnmatch
import tomllib
from pathlib import Path

import pytest

from glm5.core.config import ConfigError, load_toml
from glm5.core.resources import bundled, config_file, list_configs, package_dir, resolve_path
from glm5.model.config import ModelConfig, ModelConfigError

REPO = Path(__file__).resolve().parents[1]


def test_config_names_resolve_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    want = package_dir("configs", "train", "tiny.toml")
    for name in ("configs/train/tiny.toml", "train/tiny", "train/tiny.toml", "./configs/train/tiny.toml"):
        assert config_file(name) == want, name
    assert load_toml("configs/train/tiny.toml")["model"]["name"] == "tiny"
    mine = tmp_path / "configs" / "train" / "tiny.toml"  # a real file wins over the packaged one
    mine.parent.mkdir(parents=True)
    mine.write_text('[model]\nname = "small"\n')
    assert load_toml("configs/train/tiny.toml")["model"]["name"] == "small"


def test_unknown_config_names_the_choices(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"configs/train/nope.toml.*train/tiny"):
        load_toml("configs/train/nope.toml")
    with pytest.raises(ConfigError, match="not a file"):
        load_toml("../glm5/configs/train/tiny")  # no escaping the configs directory by name
    assert {"tiny", "small", "glm-5", "glm-5.2"} <= set(list_configs("model"))
    with pytest.raises(ModelConfigError, match=r"no such checkpoint directory '../train/tiny'.*preset.*tiny"):
        ModelConfig.from_preset("../train/tiny")
    with pytest.raises(ModelConfigError, match=r"unknown model preset 'tinny'.*preset.*tiny"):
        ModelConfig.from_preset("tinny")


def test_bundled_assets():
    assert (bundled("tokenizer-8k") / "tokenizer.json").is_file()
    assert resolve_path("bundled:corpus/train.jsonl.gz") == bundled("corpus/train.jsonl.gz")
    assert resolve_path("runs/x") == Path("runs/x")
    with pytest.raises(FileNotFoundError, match="tokenizer-8k"):
        resolve_path("bundled:nope")


def test_every_package_data_file_is_declared():
    """A data file under glm5/ that no `package-data` glob matches would be missing from the wheel."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["glm5"]
    pkg = REPO / "glm5"
    data = [p.relative_to(pkg).as_posix() for p in pkg.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data, "no package data found"
    # setuptools globs do not cross "/" with "*": compare path depth as well as the pattern
    undeclared = [f for f in data if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/")
                                             for g in globs)]
    assert not undeclared, f"not in [tool.setuptools.package-data]: {undeclared}"
