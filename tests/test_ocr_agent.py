"""The OCR agent end to end on small images with the real recogniser (needs `glm5[ocr]`): text comes
back in order, an empty page is an empty valid result, rounds are reported, and `glm5 ocr` writes all
three formats and reports bad files without stopping."""

import json

import pytest

pytest.importorskip("rapidocr_onnxruntime")

from glm5.apps.ocr.agent import OcrAgent, OcrConfig  # noqa: E402
from glm5.apps.ocr.image import ImageError  # noqa: E402
from glm5.apps.ocr.metrics import cer  # noqa: E402
from glm5.apps.ocr.render import to_json, to_markdown  # noqa: E402
from glm5.cli import ocr as ocr_cli  # noqa: E402
from tests._ocr_images import LINES, blank_png, text_png  # noqa: E402


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
