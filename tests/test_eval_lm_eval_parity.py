"""The harness's log-likelihoods equal lm-evaluation-harness's own scoring (its `hf` model: transformers'
GlmMoeDsaForCausalLM on the same checkpoint): same tokenisation (context/continuation split, trailing
spaces, empty context, the tokenizer's special prefix), same rolling windows, same numbers."""

import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from glm5.eval.engine_model import EngineModel  # noqa: E402
from glm5.eval.lm import GenerationParams, rolling_windows  # noqa: E402

from .eval_fixtures import make_checkpoint  # noqa: E402

REQUESTS = [("The following are questions.\n\nWhat is 2+2?\nAnswer:", " B"), ("Hello", " world, how are you"),
            ("", "an empty context"), ("trailing space ", "moves"), ("中文测试", "，你好")]
TEXTS = ["A long text that needs several windows. " * 12, "短文本"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, one_thread):
    from lm_eval.models.huggingface import HFLM
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"))
    hf = HFLM(pretrained=str(ckpt), dtype="float32", device="cpu", batch_size=4, max_length=48)
    ours = EngineModel(str(ckpt), max_length=48, device="cpu")
    ours.ckpt = ckpt
    return hf, ours


def test_rolling_windows_match_lm_eval():
    tokens = list(range(100, 137))
    for max_len in (1, 5, 16, 37, 64):
        ref = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 7, max_len, 1)]
        assert [(list(a), list(b)) for a, b in ref] == rolling_windows(tokens, 7, max_len)


def test_loglikelihood_equals_lm_eval_hf(models):
    hf, ours = models
    # a continuation that is the model's own greedy output must be flagged greedy by both; the first of
    # these contexts whose pair splits into the context's own tokens and the greedy text's (a merge across
    # the cut, or a trailing newline moved into the continuation, scores other tokens than were generated)
    for context in ("Hello", "Hello\n", "The answer is", "def f(x):\n"):
        greedy = ours.generate([context], GenerationParams(max_tokens=3))[0][0]
        ctx, cont = ours.encode_pair(context, greedy)
        if ctx == ours.prompt_ids(context, False) and cont == ours.tokenizer.encode(greedy, add_special_tokens=False):
            break
    reqs = REQUESTS + [(context, greedy)]
    ref = hf.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)])
    got = ours.loglikelihood(reqs)
    for (lp_ref, g_ref), (lp, g) in zip(ref, got):
        assert lp == pytest.approx(lp_ref, abs=2e-4)
        assert g == g_ref
    assert got[-1][1] is True


def test_one_token_choices_share_their_context(models):
    """Letter answers go through one next-token distribution per context; the scores equal scoring each
    choice as its own prompt (the engine's prompt log-probs)."""
    _, ours = models
    ctx = "Question?\nA. x\nB. y\nAnswer:"
    reqs = [(ctx, f" {c}") for c in "ABCD"]
    shared = ours.loglikelihood(reqs)
    ours.share_prefix = False
    try:
        separate = ours.loglikelihood(reqs)
    finally:
        ours.share_prefix = True
    for (a, ga), (b, gb) in zip(shared, separate):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb


def test_rolling_loglikelihood_equals_lm_eval_hf(models):
    hf, ours = models
    ref = hf.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(TEXTS)])
    got = ours.loglikelihood_rolling(TEXTS)
    for r, (lp, n) in zip(ref, got):
        assert lp == pytest.approx(r, abs=1e-3)
        assert n > 0


def test_hf_backend_equals_lm_eval_hf(models):
    """The transformers backend (used for teachers from other families) scores like lm-eval's `hf`."""
    from glm5.eval.hf_model import HFModel
    hf, ours = models
    mine = HFModel(str(ours.ckpt), max_length=48, batch_size=3)
    ref = hf.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)])
    for (a, ga), (b, gb) in zip(mine.loglikelihood(REQUESTS), ref):
        assert a == pytest.approx(b, abs=2e-4) and ga == gb
    assert mine.generate(["Hello"], GenerationParams(max_tokens=4)) == ours.generate(["Hello"],
                                                                                  GenerationParams(max_tokens=4))
