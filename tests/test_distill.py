"""Distillation: the KL terms against torch's own KL (full and top-k + tail, forward and reverse), a
tokenizer or vocabulary mismatch fails before any teacher compute, and `glm5 distill` end to end with a
glm5 teacher: cached top-k targets are computed once and reused, the baseline never loads a teacher."""

import json

import pytest
import torch
import torch.nn.functional as F

from glm5.core.config import load_config
from glm5.distill import run as distill_run
from glm5.distill.kd import full_targets, kd_sums, topk_targets
from glm5.distill.run import DistillConfig, build
from glm5.distill.teacher import Teacher, check_tokenizers

from .eval_fixtures import TOKENIZER, make_checkpoint

pytest.importorskip("transformers")


def _logits(seed, shape=(2, 5, 11)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_forward_and_reverse_kl_match_torch():
    s, t, T = _logits(0), _logits(1), 2.0
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    fwd, rev = kd_sums(s, full_targets(t, T), mask, T)
    p, q = (torch.log_softmax(x[mask] / T, -1) for x in (t, s))
    ref_fwd = F.kl_div(q, p, log_target=True, reduction="sum") * T * T
    ref_rev = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=q),
                                                torch.distributions.Categorical(logits=p)).sum() * T * T
    assert fwd.item() == pytest.approx(ref_fwd.item(), rel=1e-5)
    assert rev.item() == pytest.approx(ref_rev.item(), rel=1e-5)
    full = kd_sums(s, topk_targets(t, T, 11), mask, T)  # k = V: the tail is empty, same numbers
    assert full[0].item() == pytest.approx(fwd.item(), rel=1e-4) and full[1].item() == pytest.approx(rev.item(), rel=1e-4)
    top3 = kd_sums(s, topk_targets(t, T, 3), mask, T)[0]  # buckets: never above the full KL (data processing)
    assert 0 <= top3.item() <= fwd.item() + 1e-5


def test_kl_gradient_flows_to_student_only():
    s = _logits(0).requires_grad_()
    fwd, _ = kd_sums(s, topk_targets(_logits(1), 1.0, 4), torch.ones(2, 5, dtype=torch.bool), 1.0)
    fwd.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    teacher = make_checkpoint(root / "teacher")
    texts = root / "texts.jsonl"
    lines = [f"Document {i}: the quick brown fox number {i} jumps over {i % 7} lazy dogs." for i in range(60)]
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return root, teacher, texts


def _cfg(root, teacher, texts, name, *extra):
    return load_config(DistillConfig, None, [
        "--model.name=tiny", "--model.overrides={num_hidden_layers = 1, hidden_size = 32, num_nextn_predict_layers = 0}",
        f"--distill.teacher={teacher}", "--distill.top_k=8", f"--distill.cache_dir={root / 'cache'}",
        f"--text.train={texts}", f"--text.validation={texts}", "--text.seq_len=16", "--text.batch_size=2",
        "--text.val_tokens=68", "--train.steps=4", "--train.mtp_weight=0", f"--log.run_dir={root / name}",
        "--log.progress=false", "--log.measure_peak=false", "--log.eval_batches=2", "--schedule.warmup_steps=1",
        *extra])


def test_distill_end_to_end_with_cache(setup, monkeypatch, one_thread):
    root, teacher, texts = setup
    calls = []
    orig = Teacher.logits
    monkeypatch.setattr(Teacher, "logits", lambda self, ids: calls.append(ids.shape[0]) or orig(self, ids))
    trainer = build(_cfg(root, teacher, texts, "kd"))
    first = sum(calls)  # the teacher ran over every training row before the first step, once each
    assert first == len(trainer.data.rows) > 0 and first == len(list((root / "cache").glob("*.safetensors")))
    summary = trainer.fit()
    assert summary["val_loss"] > 0 and (root / "kd" / "final" / "tokenizer.json").is_file()
    assert sum(calls) == first  # training itself read the cache only
    calls.clear()
    real_teacher = distill_run.Teacher
    monkeypatch.setattr(distill_run, "Teacher", lambda *a, **k: pytest.fail("every row is cached: no teacher load"))
    build(_cfg(root, teacher, texts, "kd-again")).fit()  # same rows: every target comes from the cache
    assert calls == []
    monkeypatch.setattr(distill_run, "Teacher", real_teacher)
    monkeypatch.setattr(distill_run, "Teacher", lambda *a, **k: pytest.fail("baseline must not load a teacher"))
    build(_cfg(root, teacher, texts, "baseline", "--distill.alpha=1.0")).fit()


def test_vocab_mismatch_fails_before_compute(setup, monkeypatch):
    root, teacher, texts = setup
    monkeypatch.setattr(distill_run, "Teacher", lambda *a, **k: pytest.fail("teacher loaded before the check"))
    with pytest.raises(ValueError, match="the student must use the teacher's vocabulary"):
        build(_cfg(root, teacher, texts, "bad", "--model.overrides={vocab_size = 1000}"))


def test_tokenizer_mismatch_fails_before_compute(setup, monkeypatch, tmp_path):
    """A student checkpoint whose tokenizer is not the teacher's is refused."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    root, teacher, texts = setup
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["the quick brown fox"] * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    student = make_checkpoint(tmp_path / "student")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<unk>").save_pretrained(student)
    monkeypatch.setattr(distill_run, "Teacher", lambda *a, **k: pytest.fail("teacher loaded before the check"))
    cfg = _cfg(root, teacher, texts, "bad2", f"--model.name={student}",
               "--model.overrides={num_nextn_predict_layers = 0}")
    with pytest.raises(ValueError, match="tokenizers differ"):
        build(cfg)
    same = AutoTokenizer.from_pretrained(TOKENIZER)
    check_tokenizers(same, AutoTokenizer.from_pretrained(TOKENIZER), 8192, 8192)  # identical: accepted


def test_bundled_teacher_names_resolve_through_package_data(tmp_path, monkeypatch):
    """`bundled:smollm2-glm5` is the embedded model's cached build (the library never builds it; the CLI
    does, before the run); other bundled names are the package's assets."""
    from glm5.distill.teacher import resolve_teacher
    monkeypatch.setenv("GLM5_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="glm5 quickstart"):
        resolve_teacher("bundled:smollm2-glm5")
    from glm5.core import resources
    built = resources.built_model_dir("smollm2-glm5")
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    assert resolve_teacher("bundled:smollm2-glm5") == (str(built), None)
    directory, gguf = resolve_teacher("bundled:tokenizer-8k")
    assert gguf is None and directory == str(resources.bundled("tokenizer-8k"))
