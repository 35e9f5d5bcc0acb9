"""The OCR agent end to end on small images with the real recogniser (needs `glm5[ocr]`): text comes
back in order, an empty page is an empty valid result, rounds are reported, and `glm5 ocr` writes all
three formats and reports bad files without stopping."""

import json

import pytest

pytest.importorskip("rapidocr_onnxruntime")

from glm5.apps.ocr.agent import MAX_WORK_MPX, OcrAgent, OcrConfig  # noqa: E402
from glm5.apps.ocr.image import ImageError  # noqa: E402
from glm5.apps.ocr.limits import Deadline, OcrOverBudget, OcrTimeout  # noqa: E402
from glm5.apps.ocr.metrics import cer  # noqa: E402
from glm5.apps.ocr.render import to_json, to_markdown  # noqa: E402
from glm5.cli import ocr as ocr_cli  # noqa: E402
from tests._ocr_images import LINES, MANY, CountingSession, blank_png, estimate, text_png  # noqa: E402


@pytest.fixture(scope="module")
def agent():
    return OcrAgent(OcrConfig(rounds=1, num_threads=1))


def test_reads_lines_in_order_with_confidences(agent):
    res = agent.read_bytes(text_png(), "two-lines.png")
    edits, n = cer(res.reading_text(), "\n".join(LINES))
    assert edits / n < 0.1, res.reading_text()
    doc = to_json(res)
    flat = [ln for b in doc["blocks"] for ln in b["lines"]]  # the detector may cut a line into pieces
    assert len(flat) >= 2 and all(0.5 < ln["confidence"] <= 1.0 for ln in flat)
    assert all(len(ln["char_confidences"]) == len(ln["text"]) for ln in flat)
    assert flat[0]["box"][1] < flat[-1]["box"][1]
    assert to_markdown(res).startswith("The quick brown fox jumps over the lazy dog")
    assert [r["round"] for r in doc["rounds"]] == [0, 1]


def test_blank_page_is_empty_and_valid(agent):
    res = agent.read_bytes(blank_png(), "blank.png")
    assert res.lines == [] and to_markdown(res) == ""
    doc = to_json(res)
    assert doc["blocks"] == [] and doc["reading_order"] == [] and doc["changes"] == []


def test_language_model_rounds_without_a_model_are_skipped(agent):
    res = agent.read_bytes(blank_png(), rounds=3)
    assert res.rounds[-1] == {"round": 2, "kind": "language-model", "skipped": "no correction model configured"}


def test_bad_bytes_raise_image_error(agent):
    with pytest.raises(ImageError, match="x.png: not a supported image"):
        agent.read_bytes(b"GIF89a-not-really", "x.png")


def test_cli_formats_and_bad_files(tmp_path, capsys):
    img = tmp_path / "page.png"
    img.write_bytes(text_png())
    bad = tmp_path / "notes.txt"
    bad.write_text("not an image")
    out = tmp_path / "out.json"
    rc = ocr_cli.main([str(img), "--format", "json", "--rounds", "0", "--threads", "1", "--output", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["name"] == "page.png" and len(doc["blocks"]) >= 1
    rc = ocr_cli.main([str(bad), str(img), "--format", "txt", "--rounds", "0", "--threads", "1"])
    captured = capsys.readouterr()
    assert rc == 1 and "notes.txt: not a supported image" in captured.err
    assert "lazy dog" in captured.out
    assert ocr_cli.main([str(img), "--rounds", "-1"]) == 2


# ---------------------------------------------------------------- limits (glm5/apps/ocr/limits.py)

@pytest.fixture
def counted(agent, monkeypatch):
    now = [0.0]
    session = CountingSession(agent.perception.recognizer.session, now)
    monkeypatch.setattr(agent.perception.recognizer, "session", session)
    return session, now


def test_deadline_stops_recognition_between_batches(agent, counted):
    session, now = counted
    deadline = Deadline(1.5, clock=lambda: now[0])  # passes after the 2nd batch (1 fake second each)
    with pytest.raises(OcrTimeout, match=r"recognition stage: .* limit of 1\.5 s") as e:
        agent.read_bytes(text_png(MANY), "many.png", deadline=deadline)
    assert e.value.stage == "recognition" and session.runs == 2
    assert agent._lock.acquire(blocking=False)  # the page is given up: the agent is free again
    agent._lock.release()


def test_deadline_in_round_one_and_no_deadline(agent, counted):
    session, now = counted
    n = len(agent.read_bytes(text_png(MANY), rounds=0).lines)  # no deadline: reads through
    batches0 = session.runs
    assert n >= 17 and batches0 >= 3
    deadline = Deadline(batches0 + 0.5, clock=lambda: now[0])  # round 0 fits, round 1 does not
    with pytest.raises(OcrTimeout) as e:
        agent.read_bytes(text_png(MANY), rounds=1, deadline=deadline)
    assert e.value.stage in ("re-recognition", "layout")


def test_work_budget_refuses_before_recognition(agent, counted):
    session, _ = counted
    png = text_png(MANY)
    est = estimate(agent, png)
    assert est.lines >= 17 and 0 < est.total(0) < est.total(1)
    limit = (est.total(0) + est.total(1)) / 2  # rounds=0 fits, rounds=1 does not
    strict = OcrAgent(OcrConfig(rounds=1, max_work_mpx=limit), perception=agent.perception)
    with pytest.raises(OcrOverBudget, match=r"many\.png: .* more than the limit max_work_mpx=.*with rounds=0 it "
                                             r"needs") as e:
        strict.read_bytes(png, "many.png")
    assert e.value.estimate == est and session.runs == 0  # refused before any line was recognised
    assert "Line 19" in strict.read_bytes(png, rounds=0).reading_text()


def test_limits_config_is_validated(agent):
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="max_work_mpx"):
            OcrConfig(max_work_mpx=bad)
        with pytest.raises(ValueError, match="timeout_s"):
            OcrConfig(timeout_s=bad)
        with pytest.raises(ValueError, match="timeout_s"):
            Deadline(bad)
    assert OcrConfig().timeout_s is None and OcrConfig().max_work_mpx == MAX_WORK_MPX > 0
    assert OcrAgent(OcrConfig(), perception=agent.perception).deadline() is None  # no limit by default
    now = [100.0]
    d = Deadline(5, clock=lambda: now[0])
    assert d.start == 100.0 and d.remaining() == 5
    d.check("x")
    now[0] = 105.0  # exactly at the limit: passed
    with pytest.raises(OcrTimeout, match="at the x stage: .* limit of 5 s"):
        d.check("x")
    d = OcrAgent(OcrConfig(timeout_s=7.5), perception=agent.perception).deadline()
    assert d.limit_s == 7.5 and 0 < d.remaining() <= 7.5


# ---------------------------------------------------------------- the limits on `glm5 ocr`

@pytest.mark.parametrize("flag,value", [("--max-work-mpx", "0"), ("--max-work-mpx", "-1"), ("--max-work-mpx", "nan"),
                                        ("--timeout-s", "0"), ("--timeout-s", "-2.5")])
def test_cli_limit_flags_must_be_positive(tmp_path, capsys, flag, value):
    img = tmp_path / "page.png"
    img.write_bytes(text_png())
    assert ocr_cli.main([str(img), "--rounds", "0", flag, value]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"glm5 ocr: {flag}: must be > 0 ")


def test_cli_over_budget_page_is_reported_and_the_others_read(agent, tmp_path, capsys):
    small, many = text_png(), text_png(MANY)
    limit = (estimate(agent, small).total(0) + estimate(agent, many).total(0)) / 2  # the small page fits
    (tmp_path / "many.png").write_bytes(many)
    (tmp_path / "small.png").write_bytes(small)
    rc = ocr_cli.main([str(tmp_path / "many.png"), str(tmp_path / "small.png"), "--format", "txt", "--rounds", "0",
                       "--threads", "1", "--max-work-mpx", f"{limit:.6f}"])
    captured = capsys.readouterr()
    assert rc == 1 and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("glm5 ocr: many.png: reading this page needs an estimated ")
    assert f"more than the limit max_work_mpx={float(f'{limit:.6f}'):g}." in captured.err
    assert "lazy dog" in captured.out and "Line 19" not in captured.out  # the later file is still read
    rc = ocr_cli.main([str(tmp_path / "many.png"), "--format", "txt", "--rounds", "0", "--threads", "1",
                       "--max-work-mpx", "inf", "--timeout-s", "inf"])
    assert rc == 0 and "Line 19" in capsys.readouterr().out  # inf: no limit (and no OverflowError waiting)


def test_cli_timeout_names_the_file(tmp_path, capsys, monkeypatch):
    ticks = [0.0]

    def clock():  # every reading of the clock is one second later: the page runs out at its first checks
        ticks[0] += 1.0
        return ticks[0]

    monkeypatch.setattr(OcrAgent, "clock", staticmethod(clock))
    (tmp_path / "a.png").write_bytes(text_png())
    (tmp_path / "b.png").write_bytes(blank_png())
    rc = ocr_cli.main([str(tmp_path / "a.png"), str(tmp_path / "b.png"), "--rounds", "0", "--threads", "1",
                       "--timeout-s", "2.5"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 1 and len(err) == 2, err
    for line, name in zip(err, ("a.png", "b.png")):
        assert line.startswith(f"glm5 ocr: {name}: OCR stopped at the ") and "limit of 2.5 s" in line
