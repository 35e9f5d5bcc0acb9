"""A user mistake on the CLI is one line naming the thing, exit 2; `--debug` shows the traceback (issue 30)."""

import json

import pytest

from glm5.cli.main import main
from glm5.model.config import ModelConfigError


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_a_missing_checkpoint_is_named_as_a_path_not_a_preset(capsys, tmp_path):
    err = one_line_error(capsys, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert err.startswith("glm5 generate: no such checkpoint directory") and "nope" in err and "tiny" in err
    err = one_line_error(capsys, ["generate", "--model", "tinny", "--prompt", "hi"])
    assert "unknown model preset 'tinny'" in err


def test_debug_reraises_with_the_traceback(tmp_path):
    with pytest.raises(ModelConfigError, match="no such checkpoint directory"):
        main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi", "--debug"])


def test_a_corrupt_checkpoint_is_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "num_hidden_layers": 1,
                                                      "hidden_size": 64, "vocab_size": 100}))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    err = one_line_error(capsys, ["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert "model.safetensors" in err and "safetensors" in err


def test_convert_keeps_its_own_debug_flag(capsys, tmp_path):
    err = one_line_error(capsys, ["convert", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert err.startswith("glm5 convert:")


@pytest.mark.parametrize("flag,value", [("--ocr-max-work-mpx", "0"), ("--ocr-timeout-s", "-1"),
                                        ("--ocr-timeout-s", "nan")])
def test_glm5_serve_ocr_limits_must_be_positive(capsys, flag, value):
    """As in `glm5 ocr`: > 0, `inf` for no limit; refused before the engine is built."""
    from glm5.cli.serve import _limit
    from glm5.cli.serve import main as serve_main
    assert serve_main(["--model", "tiny", "--ocr", flag, value]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and out.startswith(f"glm5 serve: {flag}: must be > 0 (inf for no limit)"), out
    assert _limit(float("inf")) is None and _limit(32.0) == 32.0


def test_glm5_serve_starts_without_the_ocr_extra(tmp_path):
    """`pip install glm5[serve]` has no Pillow or RapidOCR: parsing `glm5 serve`'s flags and building the app
    must not import them (the OCR defaults come from numpy-only modules)."""
    import subprocess
    import sys
    code = ("import sys\nfor m in ('PIL', 'rapidocr_onnxruntime', 'onnxruntime', 'multipart', 'python_multipart'):\n"
            "    sys.modules[m] = None\n"
            "from glm5.cli.serve import parse_args, parse_ocr_args\n"
            "ocr, rest = parse_ocr_args(['--model', 'tiny', '--port', '8123'])\n"
            "engine_cfg, server_cfg = parse_args(rest)\n"
            "from glm5.infer.engine import LLMEngine\nfrom glm5.serve.app import create_app\n"
            "import dataclasses\n"
            "app = create_app(LLMEngine(dataclasses.replace(engine_cfg, num_blocks=8, device='cpu')), config=server_cfg)\n"
            "print('ok', ocr.ocr_max_work_mpx)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[0] == "ok", out.stderr[-2000:]
