"""Scheduler against exact schedules, block ids and queue states (no model): chunked prefill under the
token budget, admission limits, preemption by recompute, abort, stop conditions, spec drafts, n > 1."""

import pytest

from glm5.infer.config import EngineConfig
from glm5.infer.request import Request, RequestStatus, fan_out
from glm5.infer.sampling import SamplingParams
from glm5.infer.scheduler import Batching, Scheduler

EOS = 0


def make_sched(**kw):
    cfg = dict(block_size=4, num_blocks=20, max_num_batched_tokens=10, max_num_seqs=8, max_model_len=32)
    cfg.update(kw)
    return Scheduler(EngineConfig(**cfg))


def req(rid, n_prompt, max_tokens=16, start=1, **params):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=[EOS])


def step(s, token=7):
    """One engine step with a fake runner that samples `token` (or token(request)) for each request."""
    out = s.schedule()
    sampled = {x.request_id: [token(x.request) if callable(token) else token] for x in out.scheduled if x.samples}
    return out, s.update(out, sampled)


class FakeDetok:
    """Maps token ids to fixed strings (a stand-in for IncrementalDetokenizer)."""

    def __init__(self, vocab):
        self.vocab = vocab

    def add(self, ids):
        return "".join(self.vocab[i] for i in ids)


def test_chunked_prefill_and_decode_share_the_budget():
    s = make_sched()
    a, b = req("a", 15), req("b", 6, start=50)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 10} and out.new_request_ids == ["a"]
    assert a.num_computed_tokens == 10 and a.output_token_ids == [] and a.block_ids == [0, 1, 2]
    out, _ = step(s)  # a finishes its prompt (5) and samples; b gets the remaining 5 of the budget
    assert out.num_scheduled_tokens == {"a": 5, "b": 5} and out.new_request_ids == ["b"]
    assert a.output_token_ids == [7] and b.output_token_ids == []
    assert a.block_ids == [0, 1, 2, 3] and b.block_ids == [4, 5]
    out, _ = step(s)  # decode for a, b's last prompt token: both sample
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [x.start for x in out.scheduled] == [15, 5]
    assert a.output_token_ids == [7, 7] and b.output_token_ids == [7]
    assert a.num_computed_tokens == 16 and b.num_computed_tokens == 6


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    s = make_sched(enable_chunked_prefill=False, max_num_batched_tokens=32)
    s.add_request(req("a", 20))
    s.add_request(req("b", 20, start=40))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 20}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 20}


def test_max_num_seqs_limits_running():
    s = make_sched(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(req(f"r{i}", 3, start=10 * i + 1))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"] and [r.request_id for r in s.waiting] == ["r2"]


def test_prompt_longer_than_max_model_len_is_rejected():
    s = make_sched()
    with pytest.raises(ValueError, match="max_model_len=32"):
        s.add_request(req("long", 33))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(Request("e", [], SamplingParams()))
    with pytest.raises(ValueError, match="cannot hold one request"):
        make_sched(num_blocks=7)  # 32 tokens need 8 blocks of 4


def test_preemption_takes_the_latest_admitted_request():
    s = make_sched(num_blocks=4, max_num_batched_tokens=32, max_model_len=16)
    a, b, c = (req(n, 3, start=10 * i + 1) for i, n in enumerate("abc"))
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # one block each, one free
    out, _ = step(s)  # position 3 still fits the first block
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1} and s.block_manager.num_free_blocks == 1
    out, _ = step(s)  # position 4: a takes the free block; b preempts c and takes its block
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.preempted_ids == ["c"]
    assert a.block_ids == [0, 3] and b.block_ids == [1, 2] and c.block_ids == []
    assert [r.request_id for r in s.running] == ["a", "b"] and list(s.waiting) == [c]
    assert c.status is RequestStatus.PREEMPTED and c.num_preemptions == 1


def test_latest_running_request_is_preempted_and_recomputed():
    s = make_sched(num_blocks=5, max_num_batched_tokens=32, max_model_len=16)
    a, b = req("a", 8, max_tokens=5), req("b", 8, start=20, max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)  # 2 blocks each, 1 free
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    out, _ = step(s)  # position 8: a takes block 4; b has no block left -> b preempts itself
    assert out.num_scheduled_tokens == {"a": 1} and out.preempted_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and b.output_token_ids == [7] and s.num_preemptions == 1
    assert a.block_ids == [0, 1, 4]
    while a.status is RequestStatus.RUNNING:
        out, _ = step(s)
        assert "b" not in out.num_scheduled_tokens or a.is_finished
    out, _ = step(s)  # b comes back: prompt + its output token, the prompt's full blocks from the cache
    (sb,) = out.scheduled
    assert sb.request is b and sb.is_new and sb.is_resumed
    assert sb.start == 8 and sb.num_tokens == 1  # the prompt's two blocks were still cached
    assert b.block_ids == [2, 3, 4] and b.output_token_ids == [7, 7]


def test_preemption_blocks_admission_in_the_same_step():
    s = make_sched(num_blocks=4, max_num_batched_tokens=32, max_model_len=16)
    a, b = req("a", 4, max_tokens=5), req("b", 4, start=20, max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    step(s)  # one block each; two free
    s.add_request(req("c", 2, start=40))
    out, _ = step(s)  # a, b need a second block each -> no room for c
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and [r.request_id for r in s.waiting] == ["c"]
    out, _ = step(s)
    assert out.preempted_ids == [] and list(out.num_scheduled_tokens) == ["a", "b"]


def test_abort_frees_blocks_at_once():
    s = make_sched()
    a, b = req("a", 9), req("b", 3, start=30)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert s.abort("a") is a and a.status is RequestStatus.FINISHED_ABORTED
    assert a.block_ids == [] and s.block_manager.num_free_blocks == 20 - 1
    finished = s.update(out, {"a": [5], "b": [5]})  # a's result arrives after the abort: ignored
    assert finished == [] and a.output_token_ids == [] and b.output_token_ids == []
    assert s.schedule().finished_ids == ["a"]
    assert s.abort("a") is None and s.abort("nope") is None
    s.add_request(req("c", 2, start=60))
    assert s.abort("c").status is RequestStatus.FINISHED_ABORTED and not s.waiting


def run_tokens(s, r, tokens):
    """Feed `tokens` one per step to request r (alone in the scheduler); returns the finished list."""
    it = iter(tokens)
    finished = []
    while not finished and r.status is not RequestStatus.FINISHED_ABORTED:
        _, finished = step(s, token=lambda _req: next(it))
    return finished


def test_eos_stop_token_length_and_min_tokens():
    s = make_sched()
    r = req("eos", 3)
    s.add_request(r)
    run_tokens(s, r, [5, EOS])
    assert r.status.finish_reason == "stop" and r.stop_reason is None and r.output_token_ids == [5, EOS]

    r = req("ign", 3, max_tokens=3, ignore_eos=True)
    s.add_request(r)
    run_tokens(s, r, [EOS, EOS, EOS])
    assert r.status.finish_reason == "length" and r.output_token_ids == [EOS] * 3

    r = req("tok", 3, stop_token_ids=[9])
    s.add_request(r)
    run_tokens(s, r, [5, 9])
    assert r.status.finish_reason == "stop" and r.stop_reason == 9

    r = req("min", 3, min_tokens=3)
    s.add_request(r)
    run_tokens(s, r, [5, EOS, 5, EOS])  # tokens 1 and 2 cannot stop; from token 3 on they can
    assert r.output_token_ids == [5, EOS, 5, EOS] and r.status.finish_reason == "stop"
    r = req("min2", 3, min_tokens=3)
    s.add_request(r)
    run_tokens(s, r, [EOS, EOS, EOS, 5])
    assert r.output_token_ids == [EOS, EOS, EOS] and r.status.finish_reason == "stop"


def test_max_model_len_caps_generation():
    s = make_sched(max_model_len=12)
    r = req("r", 10, max_tokens=None)
    s.add_request(r)
    run_tokens(s, r, [5] * 10)
    assert r.num_tokens == 12 and r.status.finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(include):
    vocab = ["<eos>", "Hello", " wor", "ld", " ST", "O", "P!", "x"]
    s = make_sched()
    r = Request("r", [1, 2], SamplingParams(stop=["STOP"], include_stop_str_in_output=include),
                eos_token_ids=[0], detokenizer=FakeDetok(vocab))
    s.add_request(r)
    out, _ = step(s, token=1)
    assert r.text_for_output() == "He"  # "Hello" minus len("STOP") - 1 = 3 characters held back
    run_tokens(s, r, [2, 3, 4, 5, 6, 7])
    assert r.output_token_ids == [1, 2, 3, 4, 5, 6] and r.stop_reason == "STOP"
    assert r.output_text == ("Hello world STOP" if include else "Hello world ")
    assert r.text_for_output() == r.output_text


def test_spec_drafts_are_scheduled_and_rejections_rolled_back():
    s = make_sched(speculative_num_tokens=3, max_num_batched_tokens=32, max_model_len=28)
    r = req("r", 5)
    s.add_request(r)
    out = s.schedule()
    s.update(out, {"r": [7]}, draft_token_ids={"r": [8, 9, 10]})
    assert r.spec_token_ids == [8, 9, 10] and r.num_computed_tokens == 5
    out = s.schedule()
    (sr,) = out.scheduled
    assert sr.num_tokens == 4 and sr.spec_token_ids == [8, 9, 10] and sr.samples and sr.start == 5
    assert len(r.block_ids) * 4 >= 5 + 4 + 3  # drafts and lookahead slots
    s.update(out, {"r": [8, 9, 11]})  # two drafts accepted, the third rejected -> 11 sampled instead
    assert r.output_token_ids == [7, 8, 9, 11] and r.num_computed_tokens == 8 == r.num_tokens - 1
    assert r.spec_token_ids == []


def test_spec_drafts_trimmed_by_budget_and_stop_inside_drafts():
    s = make_sched(speculative_num_tokens=3, max_num_batched_tokens=3)
    r = req("r", 3)
    s.add_request(r)
    out = s.schedule()
    s.update(out, {"r": [7]}, draft_token_ids={"r": [8, EOS, 10]})
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == [8, EOS] and out.scheduled[0].num_tokens == 3
    finished = s.update(out, {"r": [8, EOS, 12]})
    assert finished == [r] and r.output_token_ids == [7, 8, EOS]  # tokens after EOS dropped


def test_n_children_share_prompt_blocks():
    s = make_sched(max_num_batched_tokens=64)
    children = fan_out("p", list(range(1, 11)), SamplingParams(n=3, seed=5, max_tokens=4), eos_token_ids=[EOS])
    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p"]
    assert [c.params.seed for c in children] == [5, 6, 7] and all(c.parent_id == "p" for c in children)
    for c in children:
        s.add_request(c)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"0_p": 10}  # siblings wait for the prompt's full blocks
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"0_p": 1, "1_p": 2, "2_p": 2}
    c0, c1, c2 = children
    assert c1.block_ids[:2] == c0.block_ids[:2] == c2.block_ids[:2] == [0, 1]
    assert [s.block_manager.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    assert c1.num_cached_tokens == 8 and s.block_manager.prefix_cache_hits == 16


def test_stats_and_finished_ids():
    s = make_sched()
    r = req("r", 3, max_tokens=1)
    s.add_request(r)
    _, finished = step(s)
    assert finished == [r] and not s.has_unfinished_requests()
    stats = s.get_stats()
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0.0
    assert s.schedule().finished_ids == ["r"]
    assert r.metrics.first_token_time is not None and r.metrics.ttft >= 0


# ---- the whole contract against a naive reference, with a fake runner ------------------------------

VOCAB = 11


def next_token(ctx):
    """A deterministic "model": the next token is a function of the whole context."""
    return (sum(ctx[-3:]) * 7 + len(ctx) * 3 + ctx[0]) % VOCAB


def naive_generate(prompt, max_tokens):
    seq = list(prompt)
    while len(seq) - len(prompt) < max_tokens:
        seq.append(next_token(seq))
        if seq[-1] == EOS:
            break
    return seq[len(prompt):]


class FakeRunner:
    """Writes each scheduled token into its slot (block table -> slot), then rebuilds every sampling
    request's context *from the slots*, so a wrong block table, a bad prefix hit or a lost block after
    preemption shows up as a wrong token. Drafts: the true next tokens with every third one corrupted."""

    def __init__(self, block_size):
        self.bs = block_size
        self.slots = {}
        self.step = 0

    def slot(self, req, pos):
        return req.block_ids[pos // self.bs] * self.bs + pos % self.bs

    def run(self, out, num_spec):
        for s in out.scheduled:  # all writes first, as a layer writes KV before attention reads it
            toks = s.request.all_token_ids + s.spec_token_ids
            for pos in range(s.start, s.start + s.num_tokens):
                self.slots[self.slot(s.request, pos)] = toks[pos]
        sampled, drafts = {}, {}
        for s in (s for s in out.scheduled if s.samples):
            req = s.request
            n = req.num_tokens + len(s.spec_token_ids)
            ctx = [self.slots[self.slot(req, p)] for p in range(n)]
            assert ctx == req.all_token_ids + s.spec_token_ids, req
            base = req.num_tokens
            accepted = []
            for d in s.spec_token_ids + [None]:  # greedy verification
                accepted.append(next_token(ctx[:base + len(accepted)]))
                if accepted[-1] != d:
                    break
            sampled[req.request_id] = accepted
            self.step += 1
            guess, seq = [], req.all_token_ids + accepted
            for j in range(num_spec):
                t = next_token(seq + guess)
                guess.append((t + 1) % VOCAB if (self.step + j) % 3 == 0 else t)
            drafts[req.request_id] = guess
        return sampled, drafts


@pytest.mark.parametrize("chunked,prefix,num_spec,seed", [
    (True, True, 0, 0), (True, False, 0, 1), (False, True, 0, 2), (True, True, 2, 3), (True, True, 3, 4),
    (False, False, 2, 5),
])
def test_outputs_match_naive_generation_under_pressure(chunked, prefix, num_spec, seed):
    import random
    rng = random.Random(seed)
    s = make_sched(num_blocks=14, max_num_batched_tokens=24 if chunked else 32, max_num_seqs=5,
                   max_model_len=32, enable_chunked_prefill=chunked, enable_prefix_caching=prefix,
                   speculative_num_tokens=num_spec)
    shared = [rng.randrange(1, VOCAB) for _ in range(9)]
    expected = {}
    for i in range(14):
        prompt = (shared if i % 2 else []) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
        max_tokens = rng.randrange(1, 32 - len(prompt) + 1)
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=[EOS])
        s.add_request(r)
        expected[r.request_id] = (r, naive_generate(prompt, max_tokens))
    runner = FakeRunner(4)
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        sampled, drafts = runner.run(out, num_spec)
        s.update(out, sampled, draft_token_ids=drafts)
    assert not s.has_unfinished_requests()
    for rid, (r, want) in expected.items():
        assert r.output_token_ids == want, rid
    assert s.block_manager.num_free_blocks == 14
    assert s.num_preemptions > 0  # the pool is small enough to force preemption
    if prefix:
        assert s.block_manager.prefix_cache_hits > 0


def test_stop_strings_need_a_detokenizer():
    with pytest.raises(ValueError, match="detokenizer"):
        make_sched().add_request(Request("r", [1, 2], SamplingParams(stop=["x"])))


def test_engine_config_loads_with_overrides_and_validates():
    from glm5.core.config import ConfigError, load_config
    cfg = load_config(EngineConfig, None, ["--max_num_seqs=4", "--session_policy=summarize", "--num_blocks=64"])
    assert cfg.max_num_seqs == 4 and cfg.session_policy == "summarize" and cfg.block_size == 16
    assert (cfg.max_batch_size, cfg.preferred_batch_size, cfg.batch_timeout_ms) == (32, 16, 500)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        load_config(EngineConfig, None, ["--max_num_seqs=0"])
    with pytest.raises(ConfigError, match="quantization"):
        load_config(EngineConfig, None, ["--quantization=int4"])
    with pytest.raises(ValueError, match="chunked prefill"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=32)


def test_batching_caps_running_and_groups_prompts_of_similar_length():
    """With the server's `Batching` the oldest waiting request goes first and the other free places go to the
    prompts closest to it in length (FIFO among equals), never more than max_batch_size running; with
    by_length off, plain FIFO; without a policy, FIFO up to max_num_seqs."""
    lens = [10, 3, 30, 12, 9, 4]

    def admitted(batching, running=0, **kw):
        s = make_sched(num_blocks=40, max_num_batched_tokens=200, max_model_len=64, **kw)
        for i in range(running):
            s.add_request(req(f"x{i}", 2, start=100))
        s.schedule()
        for i, n in enumerate(lens):
            s.add_request(req(f"r{i}", n, start=1 + i))
        out = s.schedule(batching)
        return [x.request_id for x in out.scheduled if x.is_new], [r.request_id for r in s.waiting]

    by_length = Batching(max_batch_size=3, preferred_batch_size=3, batch_timeout_s=0.0, by_length=True)
    assert admitted(by_length) == (["r0", "r4", "r3"], ["r1", "r2", "r5"])
    assert admitted(by_length, running=2) == (["r0"], ["r1", "r2", "r3", "r4", "r5"])  # one free place
    fifo = Batching(max_batch_size=3, preferred_batch_size=3, batch_timeout_s=0.0, by_length=False)
    assert admitted(fifo) == (["r0", "r1", "r2"], ["r3", "r4", "r5"])
    assert admitted(None, max_num_seqs=4) == (["r0", "r1", "r2", "r3"], ["r4", "r5"])


def test_batch_wait_gathers_from_idle_only():
    """An idle engine waits for preferred_batch_size requests or until the oldest waited batch_timeout_s."""
    s = make_sched()
    b = Batching(max_batch_size=4, preferred_batch_size=2, batch_timeout_s=10.0, by_length=True)
    assert s.batch_wait(b) is None  # nothing waits
    first = req("a", 3)
    s.add_request(first)
    t0 = first.metrics.arrival_time
    assert s.batch_wait(b, now=t0 + 4) == pytest.approx(6.0)
    assert s.batch_wait(b, now=t0 + 11) is None  # the oldest waited long enough
    s.add_request(req("b", 3))
    assert s.batch_wait(b, now=t0 + 1) is None  # the preferred batch is there
    s.schedule(b)
    s.add_request(req("c", 3))
    assert s.batch_wait(b, now=t0 + 1) is None  # running: new requests join at the next step
    assert Batching.from_config(EngineConfig()) == Batching(32, 16, 0.5, True)  # the config's one set of defaults
