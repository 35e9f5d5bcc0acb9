"""`LLM` (batch generate with strings and token ids, streaming, chat, beam search) and `glm5 generate`."""

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
