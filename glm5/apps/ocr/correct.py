"""The correction rounds. Each takes the page's lines, rewrites the doubtful ones and says what it did.

Round 1 (`rerecognise`): every line with a character under the confidence threshold is cropped again
in several ways (padded, upscaled and denoised, binarised and deskewed) and read again; the reading
with the best mean slot confidence wins if it beats the current one by `MIN_GAIN`.

Rounds 2+ (`lm_correct`): the remaining doubtful lines get candidate readings from their confusion
networks (rivals, deletions, insertions at doubtful slots only, at most `max_edits` of them) and, where
round 1 read the line several ways, from the stretches where those readings disagree (`merged_slots`:
the crops vote on each stretch). A glm5 language model scores each candidate inside its neighbouring
lines: `lm_weight * log P_lm(context with candidate) + log P_recogniser(candidate)` (a noisy-channel
combination). The best candidate replaces the recogniser's reading only if it leads it by
`min_margin` nats (`LmRule`, tuned on pages apart from the evaluation's: docs/ocr.md). By default
only substitutions are offered (`same_length`): given deletions, a weak model drops rare characters.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from difflib import SequenceMatcher

import numpy as np

from glm5.apps.ocr import ctc
from glm5.apps.ocr.limits import Deadline, check
from glm5.apps.ocr.perception import Line, Reading, Recognizer, crop_line
from glm5.apps.ocr.render import Change, join_lines


MIN_DELETE = 0.3
MIN_GAIN = 0.03  # round 1 replaces a reading only if its mean slot confidence rises by this much


def doubtful(line: Line, threshold: float) -> bool:
    return bool(line.reading.slots) and line.reading.min_conf < threshold


def slot_score(reading: Reading) -> float:
    """Mean confidence over all slots, doubtful insertions included (0 for an empty reading)."""
    return float(np.mean([s.conf for s in reading.slots])) if reading.slots else 0.0


# ---------------------------------------------------------------- round 1


def crop_variants(bgr: np.ndarray, quad: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Re-processed crops of one line: (name, BGR image). The last is binarised, and deskewed by the
    ink's own slant when that is more than 0.3 degrees."""
    import cv2  # noqa: PLC0415 - optional dependency

    padded = crop_line(bgr, quad, pad=0.12)
    up = cv2.resize(padded, None, fx=2.0, fy=2.0, interpolation=cv2.INTER_CUBIC)
    denoised = cv2.medianBlur(up, 3)
    gray = cv2.cvtColor(cv2.GaussianBlur(up, (3, 3), 0), cv2.COLOR_BGR2GRAY)
    _, binary = cv2.threshold(gray, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    binarised, skew = _deskew(cv2.cvtColor(binary, cv2.COLOR_GRAY2BGR), binary)
    return [("padded", padded), ("upscaled+denoised", denoised),
            ("binarised+deskewed" if skew else "binarised", binarised)]


def _deskew(image: np.ndarray, binary: np.ndarray) -> tuple[np.ndarray, float]:
    """Rotate a line crop so that its ink lies level (angle of the ink's minimum-area rectangle);
    returns the image and the angle applied (0.0 when the ink is level or the estimate implausible)."""
    import cv2  # noqa: PLC0415

    ink = np.column_stack(np.nonzero(binary < 128))  # [N, 2] (row, col)
    if len(ink) < 20:
        return image, 0.0
    (_, _), (w, h), angle = cv2.minAreaRect(ink[:, ::-1].astype(np.float32))
    if w < h:
        angle -= 90.0
    angle = ((angle + 45.0) % 90.0) - 45.0
    if abs(angle) < 0.3 or abs(angle) > 5.0:
        return image, 0.0
    rows, cols = image.shape[:2]
    m = cv2.getRotationMatrix2D((cols / 2, rows / 2), angle, 1.0)
    return cv2.warpAffine(image, m, (cols, rows), flags=cv2.INTER_CUBIC, borderValue=(255, 255, 255)), angle


def rerecognise(lines: list[Line], bgr: np.ndarray, recognizer: Recognizer, threshold: float,
                round_no: int = 1, deadline: Deadline | None = None) -> tuple[list[Change], dict]:
    """Round 1 over all doubtful lines; replaces readings in place, returns changes and a summary.
    `deadline` is checked between lines while cropping and between the recogniser's batches."""
    todo = [i for i, ln in enumerate(lines) if doubtful(ln, threshold)]
    crops, owners = [], []
    for i in todo:
        check(deadline, "re-recognition")
        for name, img in crop_variants(bgr, lines[i].quad):
            crops.append(img)
            owners.append((i, name))
    readings = recognizer(crops, deadline, "re-recognition") if crops else []
    best: dict[int, tuple[float, str, Reading]] = {}
    for (i, name), r in zip(owners, readings):
        s = slot_score(r)
        lines[i].alternatives.append((name, r))
        if s > best.get(i, (-1.0,))[0]:
            best[i] = (s, name, r)
    changes = []
    for i in todo:
        if i not in best:
            continue
        s, name, r = best[i]
        old = slot_score(lines[i].reading)
        if s < old + MIN_GAIN:  # small gains are noise between equally good readings
            continue
        before = lines[i].reading.text
        lines[i].history.append({"round": round_no, "text": before, "source": lines[i].source})
        lines[i].alternatives = [(lines[i].source, lines[i].reading)] + [a for a in lines[i].alternatives if a[1] is not r]
        lines[i].reading, lines[i].source = r, name
        if r.text != before:
            changes.append(Change(round_no, i, before, r.text,
                                  f"re-recognised from a {name} crop: confidence {old:.2f} -> {s:.2f}"))
    summary = {"round": round_no, "kind": "re-recognition", "examined": len(todo), "changed": len(changes),
               "doubtful_after": sum(doubtful(ln, threshold) for ln in lines)}
    return changes, summary


# ---------------------------------------------------------------- rounds 2+


@dataclass
class Candidate:
    choice: tuple[int, ...]  # option index per slot
    rec_logprob: float
    edits: int

    def text(self, slots: list[ctc.Slot]) -> str:
        return "".join(s.options[k][0] for s, k in zip(slots, self.choice))


def candidates(slots: list[ctc.Slot], threshold: float, max_candidates: int = 16, per_slot: int = 3,
               max_edits: int = 3, same_length: bool = False) -> list[Candidate]:
    """Beam over the confusion network: doubtful slots may take their top `per_slot` options or
    "nothing" (deletion); other slots keep their best. With `same_length`, only options as long as the
    slot's best (substitutions). Greedy reading first; distinct texts only."""
    beams = [Candidate((), 0.0, 0)]
    for s in slots:
        opts = [0]
        if s.conf < threshold:
            opts += [k for k in range(1, min(per_slot, len(s.options))) if s.options[k][0]]
            # dropping a character: only when the recogniser itself gives that >= MIN_DELETE (a language
            # model, weak or not, likes shorter texts)
            opts += [k for k, (t, p) in enumerate(s.options) if t == "" and k and p >= MIN_DELETE]
            if same_length:
                opts = [k for k in opts if len(s.options[k][0]) == len(s.best)]
        grown = []
        for b in beams:
            for k in opts:
                edits = b.edits + (k != 0)
                if edits <= max_edits:
                    p = max(s.options[k][1], 1e-6)
                    grown.append(Candidate(b.choice + (k,), b.rec_logprob + math.log(p), edits))
        grown.sort(key=lambda c: -c.rec_logprob)
        beams = grown[: max_candidates * 2]
        if not any(b.edits == 0 for b in beams):  # the greedy reading always stays in the beam
            beams.append(next(b for b in grown if b.edits == 0))
    # the greedy reading first, so that another choice spelling the same text (a `SpanSlot` need not
    # put its likeliest option first) never takes its place
    greedy = next(b for b in beams if b.edits == 0)
    out, seen = [greedy], {greedy.text(slots)}
    for c in beams:
        t = c.text(slots)
        if t not in seen:
            seen.add(t)
            out.append(c)
    return out[:max_candidates]


def chosen_reading(slots: list[ctc.Slot], choice: tuple[int, ...]) -> Reading:
    """The reading that spells `choice`: each slot's chosen option moved to the front; a `SpanSlot`
    is replaced by the chosen reading's own slots for that stretch (so every character keeps its
    recogniser confidence and rivals)."""
    out: list[ctc.Slot] = []
    for s, k in zip(slots, choice):
        if isinstance(s, SpanSlot):
            out += s.pieces[k]
        else:
            out.append(ctc.Slot([s.options[k]] + [o for j, o in enumerate(s.options) if j != k]))
    return Reading(out)


@dataclass
class SpanSlot(ctc.Slot):
    """A stretch of the line where round 1's readings disagree: one option per distinct text (the
    current reading's first, whatever its weight), `pieces[k]` the slots that spell option k."""

    pieces: list[list[ctc.Slot]] = field(default_factory=list)


def merged_slots(reading: Reading, alternatives: list[tuple[str, Reading]]) -> list[ctc.Slot]:
    """The reading's confusion network with every stretch where an alternative reading spells something
    else turned into one `SpanSlot`. Option weights vote like ROVER: each reading adds its own
    probability of the stretch (product of its characters' confidences) to the text it spells, and
    the weights are normalised, so a stretch that several crops read alike is more certain."""
    cur = reading.slots
    keys = [s.best for s in cur]
    aligned, blocks = [], []
    for _, alt in alternatives:
        ops = SequenceMatcher(None, keys, [s.best for s in alt.slots], autojunk=False).get_opcodes()
        aligned.append((alt, ops))
        blocks += [(i1, i2) for tag, i1, i2, _, _ in ops if tag != "equal"]
    regions: list[list[int]] = []
    for lo, hi in sorted(blocks):  # overlapping or touching blocks of any alternative form one region
        if regions and lo <= regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], hi)
        else:
            regions.append([lo, hi])
    out, done = [], 0
    for lo, hi in regions:
        weights: dict[str, float] = {}
        pieces: dict[str, tuple[float, list[ctc.Slot]]] = {}
        for slots in [cur[lo:hi]] + [alt.slots[_map(ops, lo, True):_map(ops, hi, False)] for alt, ops in aligned]:
            text = "".join(s.best for s in slots)
            p = math.exp(sum(math.log(max(s.conf, 1e-6)) for s in slots))
            weights[text] = weights.get(text, 0.0) + p
            if text not in pieces or p > pieces[text][0]:  # spell it with the surest reading's slots
                pieces[text] = (p, slots)
        if len(weights) < 2:
            continue
        total = sum(weights.values())
        first = "".join(s.best for s in cur[lo:hi])
        texts = [first] + sorted((t for t in weights if t != first), key=lambda t: -weights[t])
        out += cur[done:lo]
        out.append(SpanSlot([(t, weights[t] / total) for t in texts], [list(cur[lo:hi])] + [pieces[t][1] for t in texts[1:]]))
        done = hi
    return out + cur[done:]


def _map(ops: list[tuple], x: int, start: bool) -> int:
    """Position in the other sequence of boundary `x` of the first (opcodes from `SequenceMatcher`);
    an insertion exactly at `x` falls after a start boundary and before an end boundary."""
    hits = [op for op in ops if op[1] <= x <= op[2]]
    tag, i1, i2, j1, j2 = hits[0] if start else hits[-1]
    if tag == "equal":
        return j1 + (x - i1)
    return j1 if (start and x == i1) or (not start and x != i2) else j2


@dataclass(frozen=True)
class Edit:
    """One character a candidate changes: slot index, the recogniser's reading and the candidate's,
    their recogniser probabilities, and whether another round-1 reading of the line reads the new
    text there (`supported`: independent visual evidence for the change)."""

    slot: int
    before: str
    after: str
    p_before: float
    p_after: float
    supported: bool


def edits_of(slots: list[ctc.Slot], cand: Candidate, support: list[set[str]] | None = None) -> list[Edit]:
    """What `cand` changes relative to the recogniser's reading (option 0 at every slot). A `SpanSlot`
    option comes from another reading of the line, so it is supported by construction."""
    out = []
    for j, (s, k) in enumerate(zip(slots, cand.choice)):
        if k == 0:
            continue
        (t0, p0), (t1, p1) = s.options[0], s.options[k]
        sup = isinstance(s, SpanSlot) or (support is not None and t1 in support[j])
        out.append(Edit(j, t0, t1, float(p0), float(p1), bool(sup)))
    return out


def slot_support(slots: list[ctc.Slot], alternatives: list[tuple[str, Reading]]) -> list[set[str]]:
    """Per slot of the reading, the texts that round 1's other readings of the line put there (their
    best option, aligned character by character; a stretch replaced by one of equal length maps
    position by position, other stretches give nothing)."""
    keys = [s.best for s in slots]
    out: list[set[str]] = [set() for _ in slots]
    for _, alt in alternatives:
        other = [s.best for s in alt.slots]
        for tag, i1, i2, j1, j2 in SequenceMatcher(None, keys, other, autojunk=False).get_opcodes():
            if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
                for d in range(i2 - i1):
                    out[i1 + d].add(other[j1 + d])
    return out


@dataclass(frozen=True, kw_only=True)
class LmRule:
    """When a language-model round may replace the recogniser's reading (see docs/ocr.md for how the
    defaults were tuned on pages apart from the evaluation's)."""

    lm_weight: float = 0.25
    """Weight of the language model's log-probability against the recogniser's."""
    threshold: float = 0.9
    """Only characters (and optional insertions) under this confidence may change; a line with none is
    not examined."""
    min_margin: float = 0.0
    """Nats by which the best candidate's score must beat the recogniser's own reading's to replace it."""
    max_candidates: int = 8
    """Candidate readings scored per doubtful line."""
    max_edits: int = 3
    """Most characters (or disagreeing stretches) one line may change."""
    alternatives: bool = False
    """Also draw candidates from round 1's other readings of the line (`merged_slots`)."""
    same_length: bool = True
    """Substitutions only: no candidate drops or adds a character. A language model gains many nats by
    dropping a rare character (a rare CJK character, `*`, `#`), which a weak one cannot outweigh."""
    unsupported: bool = False
    """May a change be made that no other round-1 reading of the line (another crop) supports, i.e. on
    the language model's word alone? Off by default: every character round 2 changes then has visual
    evidence besides the recogniser's first reading. On, such a change is held to the three guards below.
    Measured in docs/ocr.md: the guards kept unsupported breaks out of the pages they were tuned on, but
    on other pages unsupported edits the model preferred by 9-17 nats still broke right characters
    (`fsck.ext4` -> `fsck ext4`, `PyObject`-style case changes, docstring quotes, a CJK character)."""
    protect_conf: float = 0.9
    """With `unsupported`: a character the recogniser read at this confidence or more may change only
    with support: another round-1 reading of the line (another crop) reads the new character there.
    1.0 = no protection."""
    min_rival: float = 0.1
    """With `unsupported`: an unsupported change needs the new character's recogniser probability to be at
    least this fraction of the read character's (the recogniser itself must find the rival plausible)."""
    min_lm_gain: float = 8.0
    """With `unsupported`: nats by which the language model alone must prefer each unsupported changed
    character (one no other round-1 reading puts there): the winner against the same candidate with that one character
    put back (`lm_correct`); a supported one needs only a gain above 0. An edit that rides along with a
    strong one (the model gains 25 nats from `owmer` -> `owner` and would also take `chmod( 1)` ->
    `chmod( l)` for 7) must pay for itself; edits that do not are put back."""

    def __post_init__(self):
        if self.lm_weight < 0:
            raise ValueError("lm_weight: must be >= 0")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("lm_threshold: must be in (0, 1]")
        if self.min_margin < 0:
            raise ValueError("lm_margin: must be >= 0")
        if self.max_candidates < 2 or self.max_edits < 1:
            raise ValueError("max_candidates: must be >= 2 and max_edits >= 1")
        if not 0.0 < self.protect_conf <= 1.0:
            raise ValueError("lm_protect_conf: must be in (0, 1]")
        if not 0.0 <= self.min_rival <= 1.0:
            raise ValueError("lm_min_rival: must be in [0, 1]")
        if self.min_lm_gain < 0:
            raise ValueError("lm_min_gain: must be >= 0")

    def admits(self, edits: list[Edit]) -> bool:
        """May a candidate make these edits at all (before any language-model score)? Every edit must be
        supported, unless `unsupported` allows it for a character read under `protect_conf` changed to a
        rival the recogniser gives at least `min_rival` of its probability."""
        return all(e.supported or (self.unsupported and e.p_before < self.protect_conf
                                   and e.p_after >= self.min_rival * e.p_before)
                   for e in edits)


def lm_correct(lines: list[Line], order: list[int], block_of: dict[int, int], scorer, rule: LmRule,
               settled: set[int], round_no: int, code_lines: set[int] = frozenset(),
               deadline: Deadline | None = None, trace: list | None = None) -> tuple[list[Change], dict]:
    """One language-model round over the doubtful, unsettled lines (in reading order); `deadline` is
    checked before each line is scored. Candidates the rule does not admit (`LmRule.admits`) are not
    scored; the best of the rest replaces the reading if it leads it by `min_margin` in the combined
    score and each of its edits gains `min_lm_gain` in the language model's own (`_edits_that_pay`).
    `trace`, when a list, gets one dict per scored line (every candidate's text, edits and scores, and
    the leave-one-out gains of the winner's edits) for offline study of the rule."""
    changes, examined = [], 0
    for pos, i in enumerate(order):
        if i in settled:
            continue
        check(deadline, f"language-model round {round_no}")
        slots = (merged_slots(lines[i].reading, lines[i].alternatives) if rule.alternatives
                 else lines[i].reading.slots)
        if not any(s.conf < rule.threshold for s in slots):
            continue
        cands = candidates(slots, rule.threshold, rule.max_candidates, max_edits=rule.max_edits,
                           same_length=rule.same_length)
        support = slot_support(slots, lines[i].alternatives)
        edits = [edits_of(slots, c, support) for c in cands]
        keep = [k for k in range(len(cands)) if k == 0 or rule.admits(edits[k])]
        cands, edits = [cands[k] for k in keep], [edits[k] for k in keep]
        if len(cands) < 2:
            settled.add(i)
            continue
        examined += 1
        prefix, suffix = _context(lines, order, block_of, pos)
        texts = [c.text(slots).strip() for c in cands]
        sep = "\n" if i in code_lines else None
        full = [_join(prefix + [t] + suffix, sep) for t in texts]
        lm = scorer.logprob(full)
        totals = [rule.lm_weight * a + c.rec_logprob for a, c in zip(lm, cands)]
        ranked = sorted(range(len(cands)), key=lambda k: -totals[k])
        best, runner_up = ranked[0], ranked[1]
        if totals[best] - totals[runner_up] > math.log(9.0):  # posterior >= 0.9 among the top two
            settled.add(i)
        chosen, gains = None, []
        if best != 0:
            score = lambda c: scorer.logprob([_join(prefix + [c.text(slots).strip()] + suffix, sep)])[0]  # noqa: E731
            known = {c.choice: a for c, a in zip(cands, lm)}
            need = {e.slot: 0.0 if e.supported else rule.min_lm_gain for e in edits[best]}
            chosen, gains = _edits_that_pay(cands[best], slots, known, score, need)
        if trace is not None:
            offsets = np.cumsum([0] + [len(s.best) for s in slots]).tolist()  # slot -> character offset
            trace.append({"line": i, "round": round_no, "texts": [c.text(slots) for c in cands], "lm": lm,
                          "rec": [c.rec_logprob for c in cands], "best": best, "gains": gains,
                          "edits": [[asdict(e) | {"pos": offsets[e.slot]} for e in es] for es in edits]})
        # cands[0] is the recogniser's reading: keep it unless the winner (less the edits that do not pay
        # for themselves) leads it by the margin
        if chosen is None or chosen.edits == 0:
            continue
        total = rule.lm_weight * known[chosen.choice] + chosen.rec_logprob
        if total - totals[0] < rule.min_margin or total <= totals[0]:
            continue
        best_lm = known[chosen.choice]
        before = lines[i].reading.text
        lines[i].history.append({"round": round_no, "text": before, "source": lines[i].source})
        lines[i].reading = chosen_reading(slots, chosen.choice)
        lines[i].source = "language-model"
        changes.append(Change(round_no, i, before, lines[i].reading.text,
                              f"language model preferred it among {len(cands)} candidates: score "
                              f"{total:.2f} vs {totals[0]:.2f} for the recogniser's reading "
                              f"(lm {best_lm:.2f} vs {lm[0]:.2f}, recogniser {chosen.rec_logprob:.2f} "
                              f"vs {cands[0].rec_logprob:.2f})"))
    summary = {"round": round_no, "kind": "language-model", "examined": examined, "changed": len(changes),
               "doubtful_after": sum(doubtful(ln, rule.threshold) for ln in lines)}
    return changes, summary


def _edits_that_pay(cand: Candidate, slots: list[ctc.Slot], known: dict[tuple, float], score,
                    need: dict[int, float]) -> tuple[Candidate, list[float]]:
    """`cand` less the edits the language model does not want by `need[slot]` nats on their own: each
    edit's gain is the model's log-probability of the candidate minus that of the candidate with that
    one slot put back (scored with `score` when it is not in `known`, which gets it); the edit furthest
    under its need is put back and the rest checked again. Returns the candidate (possibly with no
    edit left) and the gains of the first check (for the trace)."""
    first: list[float] | None = None
    while cand.edits:
        gains = []
        for j, k in enumerate(cand.choice):
            if k == 0:
                continue
            back = cand.choice[:j] + (0,) + cand.choice[j + 1:]
            if back not in known:
                known[back] = score(_with_choice(slots, back))
            gains.append((known[cand.choice] - known[back], j))
        if first is None:
            first = [g for g, _ in gains]
        short, j = min((g - need.get(j, 0.0), j) for g, j in gains)
        if short >= 0:
            break
        cand = _with_choice(slots, cand.choice[:j] + (0,) + cand.choice[j + 1:])
        if cand.choice not in known and cand.edits:
            known[cand.choice] = score(cand)
    return cand, first or []


def _with_choice(slots: list[ctc.Slot], choice: tuple[int, ...]) -> Candidate:
    rec = sum(math.log(max(s.options[k][1], 1e-6)) for s, k in zip(slots, choice))
    return Candidate(choice, rec, sum(k != 0 for k in choice))


def _context(lines: list[Line], order: list[int], block_of: dict[int, int], pos: int,
             before: int = 2, after: int = 1) -> tuple[list[str], list[str]]:
    """Texts of up to `before` lines before and `after` lines after, within the same block."""
    block = block_of.get(order[pos])
    prev = [order[p] for p in range(max(0, pos - before), pos) if block_of.get(order[p]) == block]
    nxt = [order[p] for p in range(pos + 1, min(len(order), pos + 1 + after)) if block_of.get(order[p]) == block]
    text = lambda j: lines[j].reading.text.strip()  # noqa: E731
    return [text(j) for j in prev], [text(j) for j in nxt]


def _join(parts: list[str], sep: str | None) -> str:
    parts = [p for p in parts if p]
    return sep.join(parts) if sep is not None else join_lines(parts)
