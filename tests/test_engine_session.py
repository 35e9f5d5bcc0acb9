"""Sessions: later turns are served from the prefix cache, cut histories respect max_session_len with both
policies, and a session's turn equals a fresh request on the same tokens."""

import pytest
import torch

from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.sampling import SamplingParams
from glm5.infer.session import Session

from ._tiny import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=21, index_topk=8)


def make(model, **kw):
    return LLMEngine(EngineConfig(device="cpu", num_blocks=96, block_size=4, max_model_len=96,
                                  max_num_batched_tokens=32, **kw), model=model)


def test_turns_reuse_cached_prefix(model):
    s = Session(make(model))
    turns = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    for t in turns:
        s.send(t, GREEDY)
    st = s.stats()
    assert st["turns"] == 3 and st["cut_tokens"] == 0
    # turn 2 reuses the full blocks of turn 1 (5 + 6 = 11 tokens -> 2 blocks), turn 3 those of 1-2
    assert st["cached_tokens"] >= 8 + 16 and st["kv_bytes_reused"] > 0
    hist = s.history_ids()
    assert len(hist) == sum(map(len, turns)) + 3 * GREEDY.max_tokens
    # the last reply equals a fresh greedy run on the same prompt
    prompt = hist[: -GREEDY.max_tokens]
    ref = model.generate_greedy(torch.tensor([prompt]), GREEDY.max_tokens)[0, len(prompt):].tolist()
    assert hist[-GREEDY.max_tokens:] == ref


@pytest.mark.parametrize("policy", ["drop", "summarize"])
def test_history_is_cut_past_max_session_len(model, policy):
    s = Session(make(model), max_session_len=40, policy=policy, keep_last_turns=1, summary_max_tokens=4)
    for i in range(6):
        s.send([20 + i] * 7, GREEDY)
        assert len(s.history_ids()) <= 40
    st = s.stats()
    assert st["cut_tokens"] > 0 and st["kv_bytes_cut"] > 0
    assert (st["summaries"] > 0) == (policy == "summarize")
    if policy == "summarize":
        assert any(t.role == "summary" for t in s.turns)
    assert s.engine.block_manager.usage == 0.0  # no blocks held between turns
