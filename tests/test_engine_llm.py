"""`LLM` (batch generate with strings and token ids, streaming, chat, beam search) and `glm5 generate`."""

import copy

import pytest
import torch

from glm5.cli.generate import main as generate_main
from glm5.infer.llm import LLM
from glm5.infer.sampling import SamplingParams

from ._tiny import tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", max_model_len=128, max_num_seqs=8, block_size=8)


def test_generate_batch_strings_and_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    text_ids = llm.tokenizer.encode("Hello world")
    outs = llm.generate(["Hello world", [5, 6, 7]], params)
    assert [o.prompt_token_ids for o in outs] == [text_ids, [5, 6, 7]]
    model = llm.engine.model
    for o in outs:
        p = o.prompt_token_ids
        ref = model.generate_greedy(torch.tensor([p]), 5)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref and o.finished
        assert o.outputs[0].text == llm.tokenizer.decode(ref, skip_special_tokens=True)


def test_stream_is_cumulative_and_matches_generate(llm):
    params = SamplingParams(temperature=0.7, seed=4, max_tokens=6, ignore_eos=True)
    seen = [o.outputs[0].token_ids for o in llm.generate_stream("Streaming test", params)]
    assert [len(s) for s in seen] == list(range(1, 7))
    assert all(seen[i] == seen[-1][: len(seen[i])] for i in range(len(seen)))
    assert llm.generate("Streaming test", params)[0].outputs[0].token_ids == seen[-1]


def test_beam_search_width_one_is_greedy(llm):
    p = [9, 10, 11, 12]
    greedy = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    beam = llm.beam_search([p], SamplingParams(temperature=0, use_beam_search=True, beam_width=1, max_tokens=4,
                                               ignore_eos=True))[0]
    assert beam.outputs[0].token_ids == greedy.outputs[0].token_ids
    wide = llm.beam_search([p], SamplingParams(temperature=0, use_beam_search=True, beam_width=3, max_tokens=4,
                                               ignore_eos=True))[0]
    assert len(wide.outputs) == 3
    assert wide.outputs[0].cumulative_logprob >= beam.outputs[0].cumulative_logprob - 1e-4


def test_beam_search_reuses_partial_blocks_and_finds_the_same_beams():
    """Each beam step's requests extend the previous step's by one token: with partial prefix blocks (the
    default without speculation) they reuse the rows of the previous step's last, partly filled block
    (copied into their own) and compute one token each; the beams, scores and tokens equal those of an engine
    without any prefix reuse. Plain requests that share a prefix ending inside a block agree too."""
    model = tiny_model(seed=12)
    opts = dict(device="cpu", max_model_len=128, max_num_seqs=8, block_size=8)
    reuse = LLM(model_obj=copy.deepcopy(model), **opts)
    fresh = LLM(model_obj=copy.deepcopy(model), enable_prefix_caching=False, **opts)
    params = SamplingParams(temperature=0, use_beam_search=True, beam_width=3, max_tokens=12, ignore_eos=True)
    p = list(range(20, 31))  # 11 tokens: a block and 3 rows
    got, ref = reuse.beam_search([p], params)[0], fresh.beam_search([p], params)[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in ref.outputs]
    assert all(abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-4 for a, b in zip(got.outputs, ref.outputs))
    bm = reuse.engine.block_manager
    assert bm.partial_block_hits >= 12  # every step after the first, for its beams
    q = list(range(60, 65))
    both = reuse.beam_search([p, q], params)  # two prompts' searches in the same engine steps
    assert [[o.token_ids for o in r.outputs] for r in both] == [
        [o.token_ids for o in fresh.beam_search([x], params)[0].outputs] for x in (p, q)]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [p + [40, 41], p + [42], p[:9]]  # after `p` was served: 11, 11 and 9 tokens reused
    assert ([o.outputs[0].token_ids for o in reuse.generate(prompts, greedy)]
            == [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy)])


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, seed=0))
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_cli_generate(capsys):
    assert generate_main(["--model", "tiny", "--prompt", "Hi", "--max-tokens", "3", "--temperature", "0",
                          "--max-model-len", "64"]) == 0
    assert capsys.readouterr().out.strip()
    assert generate_main(["--model", "tiny"]) == 2


def test_unknown_engine_option():
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM("tiny", max_num_sequences=3, model_obj=tiny_model())
