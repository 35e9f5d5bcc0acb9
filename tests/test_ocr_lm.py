"""The language-model round: the scorer's batched, padded log-probabilities equal one-at-a-time ones
from the model's forward, and `lm_correct` picks, records and settles corrections."""

import math

import pytest
import torch

from glm5.apps.ocr import ctc
from glm5.apps.ocr.correct import lm_correct
from glm5.apps.ocr.lm import LMScorer
from glm5.apps.ocr.perception import Line, Reading
from glm5.data.tokenizer import load_tokenizer
from glm5.model.config import ModelConfig
from glm5.model.model import GLM5ForCausalLM

TOK = load_tokenizer("glm5/data/assets/tokenizer-8k")


def test_scorer_matches_unpadded_forward(one_thread):
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).init_weights(0).eval()
    scorer = LMScorer(model, TOK, batch_size=3)
    texts = ["The cat sat on the mat.", "a", "床前明月光，疑是地上霜。", "def f(x):\n    return x"]
    got = scorer.logprob(texts)
    for text, lp in zip(texts, got):
        ids = torch.tensor([[TOK.eos_token_id, *TOK.encode(text)]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        want = logp.gather(-1, ids[0, 1:, None]).sum().item()
        assert lp == pytest.approx(want, rel=1e-4, abs=1e-3)


class KeywordScorer:
    """A stand-in language model: +bonus log-probability per occurrence of a word."""

    def __init__(self, word: str, bonus: float):
        self.word, self.bonus, self.calls = word, bonus, []

    def logprob(self, texts):
        self.calls.append(list(texts))
        return [self.bonus * t.count(self.word) for t in texts]


def reading(text: str, doubtful: dict[int, list[tuple[str, float]]]) -> Reading:
    slots = []
    for k, ch in enumerate(text):
        slots.append(ctc.Slot(doubtful[k]) if k in doubtful else ctc.Slot([(ch, 0.99), ("", 0.01)]))
    return Reading(slots)


def page():
    quad = torch.zeros(4, 2).numpy()
    return [Line(quad, reading("the black", {})),
            Line(quad, reading("cot sat", {1: [("o", 0.6), ("a", 0.35), ("", 0.05)]})),
            Line(quad, reading("on a mat", {}))]


def test_language_model_round_corrects_records_and_settles():
    lines = page()
    scorer = KeywordScorer("cat", bonus=5.0)
    settled = set()
    changes, summary = lm_correct(lines, [0, 1, 2], {0: 0, 1: 0, 2: 0}, scorer, threshold=0.9, lm_weight=1.0,
                                  max_candidates=8, max_edits=2, settled=settled, round_no=2)
    assert lines[1].reading.text == "cat sat"
    assert [(c.round, c.line, c.before, c.after) for c in changes] == [(2, 1, "cot sat", "cat sat")]
    assert "language model" in changes[0].why
    assert summary["examined"] == 1 and summary["changed"] == 1 and settled == {1}
    # the candidates were scored inside their context: previous line + candidate + next line
    assert "the black cat sat on a mat" in scorer.calls[0]
    # the chosen character keeps its recogniser probability
    assert lines[1].reading.char_confs[1] == pytest.approx(0.35)
    assert lines[1].history[0]["text"] == "cot sat"


def test_weak_language_model_does_not_override_the_recogniser():
    lines = page()
    changes, _ = lm_correct(lines, [0, 1, 2], {0: 0, 1: 0, 2: 0}, KeywordScorer("cat", bonus=0.3),
                            threshold=0.9, lm_weight=1.0, max_candidates=8, max_edits=2, settled=set(),
                            round_no=2)
    # recogniser: log(0.35 / 0.6) = -0.54 outweighs the +0.3 bonus
    assert changes == [] and lines[1].reading.text == "cot sat"
    assert math.log(0.35 / 0.6) + 0.3 < 0


def test_text_after_each_round_comes_from_the_change_history():
    from glm5.apps.ocr.layout import analyse
    from glm5.apps.ocr.render import PageResult
    lines = page()
    for k, ln in enumerate(lines):
        ln.quad = torch.tensor([[0, 30 * k], [200, 30 * k], [200, 30 * k + 20], [0, 30 * k + 20]]).float().numpy()
    res = PageResult(300, 100, lines, analyse(lines, None))
    lm_correct(lines, [0, 1, 2], {0: 0, 1: 0, 2: 0}, KeywordScorer("cat", 5.0), 0.9, 1.0, 8, 2, set(), 2)
    assert res.reading_text() == "the black\ncat sat\non a mat"
    assert res.reading_text(after_round=1) == res.reading_text(after_round=0) == "the black\ncot sat\non a mat"
