"""Checkpoint and config faults (issue 16): truncated, bit-flipped, NaN, missing/extra/mis-shaped
tensors, pickle-only checkpoints and garbled config.json are refused before the model is used, by
`glm5.from_pretrained`, `glm5 serve` and `glm5 train --resume`, with one message naming the file and
the tensor; `--resume auto` falls back past a corrupt checkpoint and says so; `.tmp-*` leftovers of a
killed write are removed at start; the CPU thread count is recorded in the checkpoint and reused."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm5.cli.serve import main as serve_main
from glm5.core.io import CHECKSUMS_KEY, CheckpointError
from glm5.data.tokenizer import load_tokenizer
from glm5.model.hf_adapter import from_pretrained, save_pretrained
from glm5.train.checkpoint import step_dirs

from ._tiny import tiny_model
from .test_train_loop import make

EMBED = "model.embed_tokens.weight"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    save_pretrained(tiny_model(), path)
    return path


def data_region(file: Path, name: str) -> tuple[int, int]:
    """Byte range of tensor `name` inside a safetensors file (8-byte header length, JSON, data)."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def flip_bit(file: Path, name: str) -> None:
    """Flip the lowest mantissa bit of the first element of `name`: a finite, slightly different value."""
    raw = bytearray(file.read_bytes())
    raw[data_region(file, name)[0]] ^= 0x01
    file.write_bytes(bytes(raw))


def rewrite(file: Path, change) -> None:
    """Rewrite a safetensors file with `change(tensors)` applied, the way another tool would (no checksums)."""
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def corrupt(kind: str, path: Path) -> tuple[type, list[str]]:
    """Damage checkpoint `path`; returns the expected exception and message fragments."""
    st = path / "model.safetensors"
    if kind == "truncated":
        st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
        return CheckpointError, [str(st), "truncated"]
    if kind == "bit flip":
        flip_bit(st, EMBED)
        return CheckpointError, [str(st), EMBED, "checksum"]
    if kind == "nan":
        rewrite(st, lambda t: t[EMBED].view(-1).__setitem__(7, float("nan")))
        return CheckpointError, [str(st), EMBED, "NaN"]
    if kind == "missing tensor":
        rewrite(st, lambda t: t.pop("model.norm.weight"))
        return CheckpointError, [str(path), "model.norm.weight", "missing"]
    if kind == "extra tensor":
        rewrite(st, lambda t: t.update({"model.layers.0.surprise.weight": torch.zeros(2)}))
        return CheckpointError, [str(st), "model.layers.0.surprise.weight"]
    if kind == "wrong shape":
        rewrite(st, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
        return CheckpointError, [str(st), "model.norm.weight", "shape [3]"]
    if kind == "pickle only":
        st.unlink()
        torch.save({"x": torch.zeros(1)}, path / "pytorch_model.bin")
        return FileNotFoundError, [str(path), "pytorch_model.bin", "pickle"]
    if kind == "garbled config":
        (path / "config.json").write_text('{"hidden_size": 64,,')
        return CheckpointError, [str(path / "config.json"), "JSON"]
    if kind == "config wrong type":
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": "three"}))
        return CheckpointError, [str(path / "config.json")]
    raise AssertionError(kind)


KINDS = ["truncated", "bit flip", "nan", "missing tensor", "extra tensor", "wrong shape", "pickle only",
         "garbled config", "config wrong type"]


@pytest.mark.parametrize("kind", KINDS)
def test_from_pretrained_names_the_file_and_tensor(ckpt, kind):
    error, fragments = corrupt(kind, ckpt)
    with pytest.raises(error) as info:
        from_pretrained(ckpt)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_checksums_are_crc32s_in_the_metadata(ckpt):
    """One CRC32 (zlib's, as `binascii.crc32` computes it independently) per tensor. transformers loads
    these files unchanged: tests/test_model_parity.py and test_train_loop.py load our saves with it."""
    import binascii
    st = ckpt / "model.safetensors"
    with safe_open(str(st), "pt") as f:
        sums = json.loads(f.metadata()[CHECKSUMS_KEY])
    raw = st.read_bytes()
    assert set(sums) == set(load_file(st))
    for name, crc in sums.items():
        start, end = data_region(st, name)
        assert crc == f"{binascii.crc32(raw[start:end]):08x}", name


@pytest.mark.parametrize("kind", ["truncated", "bit flip", "nan", "pickle only", "garbled config"])
def test_glm5_serve_refuses_it_in_one_line(ckpt, kind, capsys):
    _, fragments = corrupt(kind, ckpt)
    assert serve_main(["--model", str(ckpt), "--device=cpu", "--num_blocks=8"]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert all(f in text for f in fragments[:2]), text


def train_run(tmp_path, resume: str = "auto"):
    return make(tmp_path, steps=4, checkpoint={"every": 1, "keep_last": 3, "resume": resume})


def test_resume_auto_falls_back_past_corrupt_checkpoints(tmp_path, capsys):
    train_run(tmp_path).fit()
    dirs = step_dirs(tmp_path / "checkpoints")
    assert [d.name for d in dirs] == ["step_00000002", "step_00000003", "step_00000004"]
    flip_bit(dirs[-1] / "model" / "model.safetensors", EMBED)
    resumed = train_run(tmp_path)
    assert resumed.step == 3
    assert "step_00000004 is unusable" in capsys.readouterr().out
    rewrite(dirs[1] / "optimizer.safetensors", lambda t: t["t0"].view(-1).__setitem__(0, float("inf")))
    assert train_run(tmp_path).step == 2
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):  # a named checkpoint never falls back
        train_run(tmp_path, resume=str(dirs[1]))
    (dirs[0] / "state.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no usable checkpoint.*step_00000002.*state.safetensors"):
        train_run(tmp_path)


def test_stale_tmp_dirs_are_removed_at_start(tmp_path, capsys):
    stale = [tmp_path / "checkpoints" / ".tmp-step_00000009-abc", tmp_path / "checkpoints" / ".old-step_00000002-7",
             tmp_path / ".tmp-final-xyz"]
    for p in stale:
        (p / "model").mkdir(parents=True)
        (p / "model" / "model.safetensors").write_bytes(b"half")
    keep = tmp_path / "checkpoints" / "notes.txt"
    keep.write_text("mine")
    train_run(tmp_path)
    assert not any(p.exists() for p in stale) and keep.read_text() == "mine"
    assert capsys.readouterr().out.count("interrupted checkpoint write") == 3


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_thread_count_is_recorded_and_reused_on_resume(tmp_path, monkeypatch, restore_threads, capsys):
    first = make(tmp_path, steps=2, train={"num_threads": 2})
    first.train_step()
    first.save()
    state = json.loads((step_dirs(tmp_path / "checkpoints")[-1] / "state.json").read_text())
    assert state["num_threads"] == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))  # a busy machine: auto would pick 1
    resumed = make(tmp_path, steps=3, train={"num_threads": 0}, checkpoint={"resume": "auto"})
    assert resumed.num_threads == torch.get_num_threads() == 2
    assert "2 CPU threads, as recorded in the checkpoint" in capsys.readouterr().out
    pinned = make(tmp_path, steps=3, train={"num_threads": 1}, checkpoint={"resume": "auto"})
    assert pinned.num_threads == torch.get_num_threads() == 1  # an explicit setting wins, with a note
    assert "this run uses 1" in capsys.readouterr().out
