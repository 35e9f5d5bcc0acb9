"""The language-model round: the scorer's batched, padded log-probabilities equal one-at-a-time ones
from the model's forward, and `lm_correct` picks, records and settles corrections."""

import dataclasses
import math

import pytest
import torch

from glm5.apps.ocr import ctc
from glm5.apps.ocr.correct import LmRule, lm_correct
from glm5.apps.ocr.lm import LMScorer
from glm5.apps.ocr.perception import Line, Reading
from glm5.data.tokenizer import load_tokenizer
from glm5.model.config import ModelConfig
from glm5.model.model import GLM5ForCausalLM

TOK = load_tokenizer("glm5/data/assets/tokenizer-8k")
# the decision alone (no protection, no per-edit gain): what the tests below the first few build on
RULE = LmRule(lm_weight=1.0, threshold=0.9, max_candidates=8, max_edits=2, unsupported=True, protect_conf=1.0,
              min_rival=0.0, min_lm_gain=0.0)


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
    changes, summary = lm_correct(lines, [0, 1, 2], {0: 0, 1: 0, 2: 0}, scorer, RULE, settled=settled,
                                  round_no=2)
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
    changes, _ = lm_correct(lines, [0, 1, 2], {0: 0, 1: 0, 2: 0}, KeywordScorer("cat", bonus=0.3), RULE,
                            settled=set(), round_no=2)
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
    lm_correct(lines, [0, 1, 2], {0: 0, 1: 0, 2: 0}, KeywordScorer("cat", 5.0), RULE, set(), 2)
    assert res.reading_text() == "the black\ncat sat\non a mat"
    assert res.reading_text(after_round=1) == res.reading_text(after_round=0) == "the black\ncot sat\non a mat"


def test_rule_margin_and_threshold_keep_the_recogniser_reading():
    # "cat sat" leads "cot sat" by 5 + log(0.35 / 0.6) = 4.46 nats with lm_weight 1
    lead = 5.0 + math.log(0.35 / 0.6)
    for margin, changed in ((lead - 0.1, True), (lead + 0.1, False)):
        lines = page()
        rule = dataclasses.replace(RULE, min_margin=margin)
        changes, _ = lm_correct(lines, [0, 1, 2], {0: 0, 1: 0, 2: 0}, KeywordScorer("cat", 5.0), rule, set(), 2)
        assert (lines[1].reading.text == "cat sat") == changed and len(changes) == int(changed)
    # a character at 0.6 is not doubtful under a 0.5 threshold: the line is not even scored
    lines, scorer = page(), KeywordScorer("cat", 5.0)
    changes, summary = lm_correct(lines, [0, 1, 2], {0: 0, 1: 0, 2: 0}, scorer,
                                  LmRule(lm_weight=1.0, threshold=0.5), set(), 2)
    assert changes == [] and scorer.calls == [] and summary["examined"] == 0


def test_rule_rejects_bad_values():
    for bad in ({"lm_weight": -1}, {"threshold": 0.0}, {"min_margin": -0.5}, {"max_candidates": 1}):
        with pytest.raises(ValueError):
            LmRule(**bad)


def plain(text: str, conf: float = 0.95, odd: dict[int, float] = {}) -> Reading:  # noqa: B006 - read only
    return Reading([ctc.Slot([(ch, odd.get(k, conf)), ("", 1 - odd.get(k, conf))]) for k, ch in enumerate(text)])


def test_round_one_readings_vote_on_the_stretches_where_they_disagree():
    from glm5.apps.ocr.correct import SpanSlot, chosen_reading, merged_slots
    cur = plain("the fle is")
    alts = [("raw", plain("the file is", odd={5: 0.4})), ("upscaled", plain("the fle is"))]
    slots = merged_slots(cur, alts)
    spans = [s for s in slots if isinstance(s, SpanSlot)]
    assert len(spans) == 1 and "".join(s.best for s in slots) == "the fle is"
    # two readings spell nothing there (probability 1 each), one spells "i" with 0.4: 2 : 0.4
    (t0, p0), (t1, p1) = spans[0].options
    assert (t0, t1) == ("", "i") and p0 == pytest.approx(2 / 2.4) and p1 == pytest.approx(0.4 / 2.4)
    k = slots.index(spans[0])
    fixed = chosen_reading(slots, tuple(1 if j == k else 0 for j in range(len(slots))))
    assert fixed.text == "the file is" and fixed.char_confs[5] == pytest.approx(0.4)
    assert len(fixed.char_confs) == len("the file is")
    # readings that agree add nothing to search
    assert merged_slots(cur, [("raw", plain("the fle is"))]) == cur.slots


def test_language_model_round_can_take_a_stretch_from_another_reading():
    quad = torch.zeros(4, 2).numpy()
    lines = [Line(quad, plain("open the fle"), "binarised",
                  alternatives=[("raw", plain("open the file", odd={10: 0.4})), ("padded", plain("open the fle"))])]
    scorer = KeywordScorer("file", bonus=5.0)
    changes, _ = lm_correct(lines, [0], {0: 0}, scorer,
                            LmRule(lm_weight=1.0, threshold=0.9, alternatives=True, same_length=False), set(), 2)
    assert lines[0].reading.text == "open the file" and len(changes) == 1
    lines[0].reading = plain("open the fle")  # without alternatives there is nothing to choose from
    changes, _ = lm_correct(lines, [0], {0: 0}, scorer, LmRule(lm_weight=1.0, threshold=0.9, alternatives=False),
                            set(), 2)
    assert changes == [] and lines[0].reading.text == "open the fle"


def test_candidates_keep_the_recognisers_reading_first_when_another_choice_spells_it():
    from glm5.apps.ocr.correct import SpanSlot, candidates
    # the stretch's current text "ab" (0.2) spelled again by its rival "a" (0.8) plus an optional
    # insertion "b" (0.4): that choice is likelier than the greedy one (0.32 > 0.12) and reads the same
    slots = [ctc.Slot([("x", 0.99)]),
             SpanSlot([("ab", 0.2), ("a", 0.8)], [[ctc.Slot([("a", 0.9)]), ctc.Slot([("b", 0.9)])],
                                                 [ctc.Slot([("a", 0.9)])]]),
             ctc.Slot([("", 0.6), ("b", 0.4)])]
    cands = candidates(slots, 0.9, max_candidates=8)
    texts = [c.text(slots) for c in cands]
    assert cands[0].choice == (0, 0, 0) and texts[0] == "xab"
    assert len(texts) == len(set(texts)) and set(texts) == {"xab", "xa", "xabb"}


def test_same_length_rule_offers_substitutions_only():
    from glm5.apps.ocr.correct import candidates
    slots = [ctc.Slot([("c", 0.99)]), ctc.Slot([("o", 0.5), ("a", 0.3), ("", 0.2)]), ctc.Slot([("", 0.6), ("s", 0.4)]),
             ctc.Slot([("t", 0.99)])]
    free = {c.text(slots) for c in candidates(slots, 0.9)}
    assert {"cot", "cat", "cost", "cast"} <= free
    assert {c.text(slots) for c in candidates(slots, 0.9, same_length=True)} == {"cot", "cat"}


def confident_page(alternatives=()):
    # "cot sat": the "o" read at 0.85 (doubtful under 0.9), its rival "a" at 0.1
    quad = torch.zeros(4, 2).numpy()
    return [Line(quad, reading("cot sat", {1: [("o", 0.85), ("a", 0.1), ("", 0.05)]}), "raw",
                 alternatives=list(alternatives))]


def test_a_confident_character_changes_only_with_support_from_another_reading():
    from glm5.apps.ocr.agent import OcrConfig
    rule = LmRule(lm_weight=1.0, unsupported=True, protect_conf=0.8)
    strong = KeywordScorer("cat", bonus=50.0)  # the language model wants "cat" whatever it costs
    # the same case without protection: the language model wins (the behaviour the rule prevents)
    lines = confident_page()
    lm_correct(lines, [0], {0: 0}, strong, LmRule(lm_weight=1.0, unsupported=True, protect_conf=1.0), set(), 2)
    assert lines[0].reading.text == "cat sat"
    # protected: no candidate may change the "o", so none is even scored
    lines, scorer = confident_page(), KeywordScorer("cat", bonus=50.0)
    changes, summary = lm_correct(lines, [0], {0: 0}, scorer, rule, set(), 2)
    assert changes == [] and lines[0].reading.text == "cot sat" and scorer.calls == [] and summary["examined"] == 0
    # round 1's other crops do not read "a" there: still no support
    lines = confident_page([("padded", plain("cot sat")), ("binarised", plain("cut sat"))])
    assert lm_correct(lines, [0], {0: 0}, strong, rule, set(), 2)[0] == []
    # another crop reads "a": the change is supported and the language model may make it
    lines = confident_page([("padded", plain("cat sat"))])
    changes, _ = lm_correct(lines, [0], {0: 0}, strong, rule, set(), 2)
    assert lines[0].reading.text == "cat sat" and len(changes) == 1
    # the agent's defaults: a character read at 0.95 stays unless supported, even when a caller widens
    # the characters a language-model round may look at (lm_threshold 1.0)
    default = dataclasses.replace(OcrConfig().lm_rule, threshold=1.0)
    quad = torch.zeros(4, 2).numpy()
    sure = lambda alts=(): [Line(quad, reading("cot sat", {1: [("o", 0.95), ("a", 0.04), ("", 0.01)]}),  # noqa: E731
                                 "raw", alternatives=list(alts))]
    lines = sure()
    assert lm_correct(lines, [0], {0: 0}, strong, default, set(), 2)[0] == [] and lines[0].reading.text == "cot sat"
    lines = sure([("padded", plain("cat sat"))])
    assert len(lm_correct(lines, [0], {0: 0}, strong, default, set(), 2)[0]) == 1


def test_a_rival_the_recogniser_finds_implausible_needs_support():
    rule = LmRule(lm_weight=1.0, unsupported=True, protect_conf=0.9, min_rival=0.2)
    strong = KeywordScorer("cat", bonus=50.0)
    quad = torch.zeros(4, 2).numpy()
    # "o" at 0.6, "a" at 0.1: 0.1 < 0.2 * 0.6, so the recogniser's own rival is too weak
    lines = [Line(quad, reading("cot sat", {1: [("o", 0.6), ("a", 0.1), ("", 0.3)]}))]
    assert lm_correct(lines, [0], {0: 0}, strong, rule, set(), 2)[0] == []
    lines = [Line(quad, reading("cot sat", {1: [("o", 0.6), ("a", 0.3), ("", 0.1)]}))]
    assert len(lm_correct(lines, [0], {0: 0}, strong, rule, set(), 2)[0]) == 1


def test_by_default_every_change_needs_another_reading_to_support_it():
    from glm5.apps.ocr.agent import OcrConfig
    strong = KeywordScorer("cat", bonus=50.0)  # the language model wants "cat" whatever it costs
    quad = torch.zeros(4, 2).numpy()
    # "o" at 0.5 and "a" at 0.45: doubtful, a close rival, and 50 nats for the change
    make = lambda alts=(): [Line(quad, reading("cot sat", {1: [("o", 0.5), ("a", 0.45), ("", 0.05)]}),  # noqa: E731
                                 "raw", alternatives=list(alts))]
    default = OcrConfig().lm_rule
    assert not default.unsupported
    lines, scorer = make([("padded", plain("cot sat"))]), KeywordScorer("cat", bonus=50.0)
    changes, summary = lm_correct(lines, [0], {0: 0}, scorer, default, set(), 2)
    assert changes == [] and lines[0].reading.text == "cot sat" and scorer.calls == [] and summary["examined"] == 0
    lines = make([("padded", plain("cat sat"))])  # another crop reads "a" there
    assert len(lm_correct(lines, [0], {0: 0}, strong, default, set(), 2)[0]) == 1
    assert lines[0].reading.text == "cat sat"
    # the guarded rule of before (`lm_unsupported`) lets the model's word alone make it
    lines = make()
    assert len(lm_correct(lines, [0], {0: 0}, strong, OcrConfig(lm_unsupported=True).lm_rule, set(), 2)[0]) == 1


def test_language_model_gain_per_edit():
    # "cat" is worth 5 nats to the model; a rule asking for 6 per changed character keeps "cot"
    for need, changed in ((4.0, True), (6.0, False)):
        lines = page()
        rule = LmRule(lm_weight=1.0, threshold=0.9, unsupported=True, min_lm_gain=need)
        lm_correct(lines, [0, 1, 2], {0: 0, 1: 0, 2: 0}, KeywordScorer("cat", 5.0), rule, set(), 2)
        assert (lines[1].reading.text == "cat sat") == changed


def test_support_aligns_other_readings_character_by_character():
    from glm5.apps.ocr.correct import slot_support
    cur = plain("the fle is")
    support = slot_support(cur.slots, [("a", plain("the fie is")), ("b", plain("tho file is"))])
    assert support[5] == {"l", "i"}  # "a" reads "i" there; "b"'s "fi" for "f" is not position by position
    assert support[2] == {"e", "o"} and support[0] == {"t"}


class BonusScorer:
    """A stand-in language model: a bonus per occurrence of each of several strings."""

    def __init__(self, bonuses: dict[str, float]):
        self.bonuses, self.calls = bonuses, []

    def logprob(self, texts):
        self.calls.append(list(texts))
        return [sum(b * t.count(w) for w, b in self.bonuses.items()) for t in texts]


def test_an_edit_that_rides_along_with_a_strong_one_must_pay_for_itself():
    quad = torch.zeros(4, 2).numpy()
    # "( 1)" is right; the model wants "owner" by 25 nats and, weakly, "( l)" by 7
    text = "chmod( 1) owmer"
    make = lambda: [Line(quad, reading(text, {7: [("1", 0.67), ("l", 0.32), ("", 0.01)],  # noqa: E731
                                              12: [("m", 0.6), ("n", 0.35), ("", 0.05)]}))]
    scorer = BonusScorer({"owner": 25.0, "( l)": 7.0})
    lines = make()
    lm_correct(lines, [0], {0: 0}, scorer, LmRule(lm_weight=1.0, unsupported=True, min_lm_gain=0.0), set(), 2)
    assert lines[0].reading.text == "chmod( l) owner"  # without a per-edit gain both go through
    lines = make()
    rule = LmRule(lm_weight=1.0, unsupported=True, min_lm_gain=10.0)
    changes, _ = lm_correct(lines, [0], {0: 0}, scorer, rule, set(), 2)
    assert lines[0].reading.text == "chmod( 1) owner" and len(changes) == 1
