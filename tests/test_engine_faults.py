"""Per-request fault isolation in `LLMEngine.step()` (glm5/infer/faults.py), on a tiny random model.

The poison is the bug from issue 16 itself: a stop id outside the vocabulary with min_tokens > 0 makes
the batched sampler raise IndexError. `add_request` now refuses it, so the tests slip it in after
admission (as a future bug would). The reference for the survivors is the model's own full-recompute
greedy decode (`generate_greedy`), which shares no code with the engine step."""

import pytest
import torch

from glm5.infer.engine import LLMEngine
from glm5.infer.faults import EngineFault
from glm5.infer.sampling import SamplingParams

from ._tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = dict(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture
def engine():
    return LLMEngine(model=tiny_model(), device="cpu", dtype="float32", max_model_len=64, num_blocks=32,
                     block_size=8, max_num_seqs=8)


def run(engine: LLMEngine, max_steps: int = 100) -> dict:
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def poison(engine: LLMEngine, request_id: str, prompt: list[int], n: int = 1) -> None:
    params = SamplingParams(min_tokens=3, n=n, **GREEDY)
    engine.add_request(request_id, prompt_token_ids=prompt, params=params)
    for r in engine.scheduler.requests.values():  # after the vocabulary check: the sampler indexes past V
        if request_id in (r.request_id, r.parent_id):
            r.params.stop_token_ids.append(10**6)


def greedy(engine: LLMEngine, prompt: list[int]) -> list[int]:
    return engine.model.generate_greedy(torch.tensor([prompt]), 5)[0, len(prompt):].tolist()


@pytest.mark.parametrize("n", [1, 2])
def test_a_failing_request_is_aborted_and_the_batch_carries_on(engine, n):
    prompts = {"a": [5, 6, 7], "b": [9, 10, 11, 12, 13], "c": [20, 21]}
    engine.add_request("a", prompt_token_ids=prompts["a"], params=SamplingParams(**GREEDY))
    poison(engine, "bad", [30, 31, 32], n=n)
    engine.add_request("b", prompt_token_ids=prompts["b"], params=SamplingParams(**GREEDY))
    engine.add_request("c", prompt_token_ids=prompts["c"], params=SamplingParams(**GREEDY))
    final = run(engine)
    assert set(final) == {"a", "b", "c", "bad"}
    bad = final["bad"]
    assert bad.finished and "IndexError" in bad.error and len(bad.outputs) == n
    assert all(o.finish_reason == "abort" for o in bad.outputs)
    for rid, prompt in prompts.items():
        assert final[rid].error is None and final[rid].outputs[0].token_ids == greedy(engine, prompt), rid
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # its blocks came back
    assert not engine._groups and not engine._errors
    engine.add_request("after", prompt_token_ids=prompts["a"], params=SamplingParams(**GREEDY))
    assert run(engine)["after"].outputs[0].token_ids == greedy(engine, prompts["a"])


def test_a_failure_every_request_hits_is_an_engine_fault(engine, monkeypatch):
    def broken(out, **kw):
        raise RuntimeError("the device is gone")
    monkeypatch.setattr(engine.runner, "run", broken)
    for i in range(2):
        engine.add_request(f"r{i}", prompt_token_ids=[5, 6, 7], params=SamplingParams(**GREEDY))
    outs = engine.step()  # 2 failed requests: not yet a streak of 3
    assert sorted(o.request_id for o in outs) == ["r0", "r1"] and all(o.error for o in outs)
    engine.add_request("r2", prompt_token_ids=[5, 6, 7], params=SamplingParams(**GREEDY))
    with pytest.raises(EngineFault, match="3 requests failed in a row"):
        engine.step()


def test_a_device_error_is_not_blamed_on_a_request(engine, monkeypatch):
    def device_error(out, **kw):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(engine.runner, "run", device_error)
    engine.add_request("r", prompt_token_ids=[5, 6, 7], params=SamplingParams(**GREEDY))
    with pytest.raises(torch.AcceleratorError):
        engine.step()


def test_successes_reset_the_failure_streak(engine):
    for i in range(4):  # 4 bad requests over time, each followed by good ones: never an engine fault
        poison(engine, f"bad{i}", [30 + i, 31, 32])
        engine.add_request(f"ok{i}", prompt_token_ids=[5, 6, 7 + i], params=SamplingParams(**GREEDY))
        final = run(engine)
        assert final[f"bad{i}"].error and final[f"ok{i}"].error is None
