"""Beam search and the temperature schedule in the evaluation harness (seed A1's decodings on HumanEval):
the engine backend's beam search returns what transformers' `generate(num_beams=...)` returns on the same
checkpoint (both through the harness's backends), the schedule reaches the engine's sampler unchanged,
results under another decoding are never reused on resume, and impossible combinations are refused."""

import pytest

from glm5.eval.engine_model import EngineModel
from glm5.eval.lm import GenerationParams, cut_at_stop, decoding_fingerprint
from glm5.eval.tasks import TaskConfig, build_task
from glm5.infer.sampling import SamplingParams

from .eval_fixtures import make_checkpoint

PROMPTS = ["def add(a, b):\n", "The quick brown", "中文"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # index_topk >= every length here: the indexer selects every key, as transformers' reference does
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=4, index_topk=64)


def test_engine_beam_search_equals_transformers_num_beams(ckpt, one_thread):
    pytest.importorskip("transformers")
    from glm5.eval.hf_model import HFModel
    params = GenerationParams(max_tokens=12, beam_width=3, n=2)
    ours = EngineModel(str(ckpt), max_length=48, batch_size=4).generate(PROMPTS, params)
    ref = HFModel(str(ckpt), max_length=48).generate(PROMPTS, params)
    assert [len(o) for o in ours] == [2, 2, 2]
    assert ours == ref


def test_beam_outputs_are_cut_at_the_stop_strings(ckpt, one_thread):
    model = EngineModel(str(ckpt), max_length=48, batch_size=4)
    full = model.generate(PROMPTS, GenerationParams(max_tokens=12, beam_width=2))
    stop = tuple({t[0][3:5] for t in full if len(t[0]) >= 5})  # strings the beams do produce
    cut = model.generate(PROMPTS, GenerationParams(max_tokens=12, beam_width=2, stop=stop))
    assert cut == [[cut_at_stop(t[0], stop)] for t in full]
    assert any(len(c[0]) < len(f[0]) for c, f in zip(cut, full))


def test_temperature_schedule_reaches_the_engine_sampler(ckpt, one_thread):
    model = EngineModel(str(ckpt), max_length=48, batch_size=4)
    got = model.generate(PROMPTS, GenerationParams(max_tokens=10, temperature_schedule=(0.8, 0.2), seed=3))
    want = model.llm.generate([model.prompt_ids(p, False) for p in PROMPTS],
                              SamplingParams(max_tokens=10, temperature_schedule=(0.8, 0.2), seed=3))
    assert got == [[o.outputs[0].text] for o in want]
    greedy = model.generate(PROMPTS, GenerationParams(max_tokens=10))
    assert got != greedy  # the schedule samples (seeded), it is not greedy decoding


def test_decodings_have_distinct_resume_fingerprints():
    prints = [build_task(TaskConfig(task=t, **kw)).fingerprint() for t in ("humaneval", "exact", "queries")
              for kw in ({}, {"beam_width": 4}, {"temperature_schedule": [0.8, 0.2]}, {"temperature": 0.7})]
    for i in range(0, len(prints), 4):
        assert len({repr(p) for p in prints[i:i + 4]}) == 4
    assert decoding_fingerprint(GenerationParams(beam_width=2)) != decoding_fingerprint(GenerationParams())


@pytest.mark.parametrize("kw, match", [
    ({"beam_width": 0}, "beam_width=0"),
    ({"beam_width": 4, "temperature": 0.5}, "temperature 0"),
    ({"beam_width": 2, "n": 3}, "n <= beam_width"),
    ({"beam_width": 2, "temperature_schedule": [0.8, 0.2]}, "no temperature_schedule"),
    ({"temperature_schedule": [0.8]}, r"\[start, end\]"),
    ({"temperature_schedule": [3.0, 0.2]}, "0 <= each <= 2"),
])
def test_impossible_decodings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        TaskConfig(task="humaneval", **kw)


def test_hf_backend_refuses_the_schedule(ckpt):
    pytest.importorskip("transformers")
    from glm5.eval.hf_model import HFModel
    with pytest.raises(ValueError, match="temperature_schedule is a glm5 engine option"):
        HFModel(str(ckpt), max_length=48).generate(PROMPTS, GenerationParams(temperature_schedule=(0.8, 0.2)))


def test_cli_refuses_beam_search_with_sampling_in_one_line(capsys):
    from glm5.cli.eval import main
    assert main(["--task", "humaneval", "--model", "tiny", "--beam-width", "2", "--temperature", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "beam_width=2" in err[0] and "Traceback" not in err[0]
