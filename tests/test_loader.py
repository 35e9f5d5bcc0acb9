"""Packed loader: boundaries, labels, rank disjointness, resume, curriculum, mixture, infill rows.

Synthetic shards: every token id is globally unique (1000 + its offset in the corpus), so any token in
a batch tells which document and position it came from.
"""

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest
import torch

from glm5.core.resources import bundled
from glm5.data.infilling import IGNORE
from glm5.data.loader import DataLoaderConfig, PackedLoader, StageConfig, eval_batches
from glm5.data.shards import ShardWriter, TokenShards

BASE = 1000
SPECIAL = {"<|endoftext|>": 1, "[MASK]": 2, "[sMASK]": 3, "[gMASK]": 4, "<sop>": 5, "<eop>": 6}


def make_shards(path, n_docs=60, groups=("general", "code"), seed=0, vocab=70000, part_tokens=1500, special=None):
    rng = np.random.default_rng(seed)
    meta = {"special_tokens": special or SPECIAL, "pad_token_id": 0, "eos_token_id": 1,
            "sentence_end_ids": list(range(BASE, BASE + 60000, 7))}
    w = ShardWriter(path, vocab, meta, max_tokens_per_part=part_tokens)
    docs, off = [], 0
    for d in range(n_docs):
        n = int(rng.integers(3, 90))
        ids = np.arange(BASE + off, BASE + off + n)
        w.add(ids, source=f"s{d % 3}", lang="en", domain=groups[d % len(groups)])
        docs.append(ids)
        off += n
    w.close()
    return docs


def locate(docs):
    """token id -> (doc, position)."""
    return {int(t): (d, p) for d, ids in enumerate(docs) for p, t in enumerate(ids)}


@pytest.fixture()
def corpus(tmp_path):
    docs = make_shards(tmp_path / "train")
    return tmp_path / "train", docs


def test_shards_round_trip(corpus):
    path, docs = corpus
    sh = TokenShards(path)
    assert sh.meta["dtype"] == "uint32" and len(sh.meta["parts"]) > 1  # vocab > 65535; parts rolled
    assert len(sh) == len(docs) and sh.num_tokens == sum(map(len, docs))
    for d in (0, 17, len(docs) - 1):
        assert np.array_equal(sh.doc(d), docs[d])
    assert sh.category(1, "domain") == "code" and sorted(sh.groups("domain")) == ["code", "general"]


def check_rows(batch, where):
    """Every segment is a contiguous piece of one document; positions restart; labels are the next
    token inside the piece (last one -100); padding has segment 0 and no loss."""
    for r in range(batch["input_ids"].shape[0]):
        ids, lab = batch["input_ids"][r].tolist(), batch["labels"][r].tolist()
        pos, seg = batch["position_ids"][r].tolist(), batch["segment_ids"][r].tolist()
        for s in sorted(set(seg) - {0}):
            idx = [i for i, x in enumerate(seg) if x == s]
            assert idx == list(range(idx[0], idx[-1] + 1))
            toks = [ids[i] for i in idx]
            doc_pos = [where[t] for t in toks]
            assert len({d for d, _ in doc_pos}) == 1
            assert [p for _, p in doc_pos] == list(range(doc_pos[0][1], doc_pos[0][1] + len(toks)))
            assert [pos[i] for i in idx] == list(range(len(idx)))
            assert [lab[i] for i in idx] == toks[1:] + [IGNORE]
        pad = [i for i, x in enumerate(seg) if x == 0]
        assert all(lab[i] == IGNORE for i in pad)
        assert len(pad) <= 1  # causal rows are filled up to the last slot


def test_packing_keeps_boundaries_and_labels_each_token_once(corpus):
    path, docs = corpus
    where = locate(docs)
    cfg = DataLoaderConfig(train_path=str(path), batch_size=2, seq_len=64, weights={"general": 1.0})
    loader = PackedLoader(cfg, rank=0, world_size=1)
    stream = loader.streams["general"]
    labels = Counter()
    while stream.epoch == 0:
        batch = loader.next_batch()
        check_rows(batch, where)
        labels.update(t for t in batch["labels"].flatten().tolist() if t != IGNORE)
    # Exactly once per non-first token in epoch 0, plus what epoch 1 already consumed.
    expected = Counter()
    general = [d for d in range(len(docs)) if d % 2 == 0]
    for d in general:
        expected.update(docs[d][1:].tolist())
    order1 = stream._order
    for d in order1[: stream.pos]:
        expected.update(docs[d][1:].tolist())
    expected.update(docs[order1[stream.pos]][1: stream.offset + 1].tolist())
    assert labels == expected


def test_ranks_split_one_global_row_sequence(corpus):
    """Elastic order: the rows of ranks 0..W-1 (batch B each) are, in rank order, the rows one process
    gets with batch W*B, for every call, infilling rows included; the state is the same on every rank."""
    path, _ = corpus
    cfg = lambda b: DataLoaderConfig(train_path=str(path), batch_size=b, seq_len=32, seed=5,  # noqa: E731
                                     infill_ratio=0.4)
    one = PackedLoader(cfg(6), rank=0, world_size=1)
    split = [PackedLoader(cfg(2), rank=r, world_size=3) for r in range(3)]
    for _ in range(8):
        ref = one.next_batch()
        parts = [ld.next_batch() for ld in split]
        assert all(torch.equal(torch.cat([p[k] for p in parts]), ref[k]) for k in ref)
    assert all(ld.state_dict()["streams"] == one.state_dict()["streams"] for ld in split)
    assert all(ld.state_dict()["rows"] == one.state_dict()["rows"] for ld in split)


def batches_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_yields_exactly_the_uninterrupted_batches(corpus):
    path, _ = corpus
    cfg = DataLoaderConfig(train_path=str(path), batch_size=3, seed=11, infill_ratio=0.5, stages=[
        StageConfig(until_step=4, seq_len=48, weights={"general": 0.8, "code": 0.2}),
        StageConfig(until_step=0, seq_len=96, weights={"general": 0.4, "code": 0.6})])
    full = PackedLoader(cfg, rank=1, world_size=2)
    reference = [full.next_batch() for _ in range(10)]
    first = PackedLoader(cfg, rank=1, world_size=2)
    head = [first.next_batch() for _ in range(6)]
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
    resumed = PackedLoader(cfg, rank=1, world_size=2)
    resumed.load_state_dict(state)
    tail = [resumed.next_batch() for _ in range(4)]
    assert all(batches_equal(x, y) for x, y in zip(reference, head + tail))
    assert [b["input_ids"].shape[1] for b in reference] == [48] * 4 + [96] * 6  # curriculum
    # the same state resumes in one process with the whole global batch: rank 0's rows, then rank 1's
    rank0 = PackedLoader(cfg, rank=0, world_size=2)
    rank0.load_state_dict(state)
    one = PackedLoader(dataclasses.replace(cfg, batch_size=6), rank=0, world_size=1)
    one.load_state_dict(state)
    for b1, b0, b in zip(tail, [rank0.next_batch() for _ in range(4)], [one.next_batch() for _ in range(4)]):
        assert all(torch.equal(torch.cat([b0[k], b1[k]]), b[k]) for k in b)
    with pytest.raises(ValueError, match="seed"):
        PackedLoader(dataclasses.replace(cfg, seed=12), rank=0, world_size=1).load_state_dict(state)


def test_trainer_data_resumes_at_another_world_size(corpus):
    """A checkpoint written by 2 ranks resumes in 1 process (DCP reshards the weights) at its exact data
    position: the next global batch is the one the 2 ranks would have read together."""
    from types import SimpleNamespace

    from glm5.train.loader_data import LoaderData
    path, _ = corpus
    cfg = lambda b: SimpleNamespace(data=DataLoaderConfig(train_path=str(path), batch_size=b, seq_len=32))  # noqa: E731
    ranks = [LoaderData(cfg(3), rank=r, world_size=2) for r in range(2)]
    for ld in ranks:
        ld.next_batch("clm")
    state = json.loads(json.dumps(ranks[0].state_dict()))
    assert state == json.loads(json.dumps(ranks[1].state_dict())) | {"rank": 0}
    one = LoaderData(cfg(6), rank=0, world_size=1)
    one.load_state_dict(state)
    nxt = [ld.next_batch("clm") for ld in ranks]
    assert batches_equal(one.next_batch("clm"), {k: torch.cat([b[k] for b in nxt]) for k in nxt[0]})


def test_mixture_weights_and_manual_step(corpus):
    path, docs = corpus
    where = locate(docs)
    cfg = DataLoaderConfig(train_path=str(path), batch_size=50, seq_len=16, stages=[
        StageConfig(until_step=10, seq_len=16, weights={"general": 0.9, "code": 0.1}),
        StageConfig(seq_len=24, weights={"general": 0.1, "code": 0.9})])
    loader = PackedLoader(cfg, rank=0, world_size=1)

    def code_fraction(batch):
        first = batch["input_ids"][:, 0].tolist()
        return np.mean([where[t][0] % 2 == 1 for t in first])

    early = np.mean([code_fraction(loader.next_batch()) for _ in range(4)])
    loader.set_step(10)
    late_batch = loader.next_batch()
    late = np.mean([code_fraction(late_batch)] + [code_fraction(loader.next_batch()) for _ in range(3)])
    assert early < 0.25 and late > 0.75 and late_batch["input_ids"].shape[1] == 24
    assert loader.step == 10  # set_step pins the step: the trainer drives the curriculum
    with pytest.raises(ValueError, match="unknown|values"):
        PackedLoader(DataLoaderConfig(train_path=str(path), weights={"math": 1.0}), rank=0, world_size=1)


def test_infill_rows_mask_and_positions(corpus):
    path, docs = corpus
    where = locate(docs)
    cfg = DataLoaderConfig(train_path=str(path), batch_size=4, seq_len=128, seed=3)
    loader = PackedLoader(cfg, rank=0, world_size=1)
    batch = loader.next_batch("glm")
    assert batch["attention_mask"].shape == (4, 128, 128) and batch["attention_mask"].dtype == torch.bool
    n_infill = 0
    for r in range(4):
        seg, mask = batch["segment_ids"][r], batch["attention_mask"][r]
        blk, lab, ids = batch["block_position_ids"][r], batch["labels"][r], batch["input_ids"][r]
        same = seg[:, None] == seg[None, :]
        assert not (mask & ~same).any()  # never across packed samples
        for s in seg.unique().tolist():
            if s == 0:
                continue
            m = seg == s
            if (blk[m] > 0).any():  # a blank-infilling sample
                n_infill += 1
                in_a = blk[m] == 0
                assert (lab[m][in_a] == IGNORE).all() and (lab[m][~in_a] != IGNORE).all()
                sub = mask[m][:, m]
                sep = int(in_a.sum())
                assert sub[:, :sep].all() and not sub[:sep, sep:].any()
                assert torch.equal(sub[sep:, sep:], torch.tril(torch.ones_like(sub[sep:, sep:])))
                masked = [t for t in ids[m][~in_a].tolist() if t != SPECIAL["<sop>"]]
                assert all(t in where for t in masked)
            else:
                L = int(m.sum())
                assert torch.equal(mask[m][:, m], torch.tril(torch.ones(L, L, dtype=torch.bool)))
    assert n_infill > 0
    assert "attention_mask" not in loader.next_batch("clm")


def test_eval_batches_cover_every_token_once(corpus):
    path, docs = corpus
    inputs, row_ends = Counter(), set()
    for rank in range(2):
        for batch in eval_batches(str(path), seq_len=40, batch_size=3, rank=rank, world_size=2):
            assert set(batch) == {"input_ids", "labels", "position_ids", "segment_ids"}
            ids, seg = batch["input_ids"], batch["segment_ids"]
            inputs.update(ids[seg > 0].tolist())
            row_ends |= {int(r[s > 0][-1]) for r, s in zip(ids, seg) if (s > 0).any()}
    # Every token once, except that a document cut at a row edge repeats that edge token.
    total = Counter(t for d in docs for t in d.tolist())
    assert set(inputs) == set(total)
    repeated = {t for t, c in inputs.items() if c > 1}
    assert repeated <= row_ends and all(inputs[t] == 2 for t in repeated)
    # elastic: both ranks run the same number of batches (padded), and together they are one process's
    parts = [list(eval_batches(str(path), seq_len=40, batch_size=3, rank=r, world_size=2)) for r in range(2)]
    one = list(eval_batches(str(path), seq_len=40, batch_size=6, rank=0, world_size=1))
    assert len(parts[0]) == len(parts[1]) == len(one)
    for a, b, ref in zip(*parts, one):
        both = torch.cat([a["labels"], b["labels"]])
        assert torch.equal(both[: len(ref["labels"])], ref["labels"]) and (both[len(ref["labels"]):] == IGNORE).all()


def test_example_config_parses_and_runs(tmp_path):
    from glm5.core.config import load_config
    make_shards(tmp_path / "t", n_docs=40, groups=("tech", "quotes", "literature", "code"))
    cfg = load_config(DataLoaderConfig, "configs/data/loader-example.toml",
                      [f"--train_path={tmp_path / 't'}", "--batch_size=2"])
    assert [s.seq_len for s in cfg.stages] == [256, 512, 1024] and cfg.stage_at(700).seq_len == 1024
    batch = PackedLoader(cfg, rank=0, world_size=1).next_batch()
    assert batch["attention_mask"].shape == (2, 256, 256)
    from glm5.core.config import ConfigError
    with pytest.raises(ConfigError, match="until_step"):
        load_config(DataLoaderConfig, None, ["--stages=[{until_step=0, seq_len=8}, {until_step=5, seq_len=8}]"])


def test_tokenize_cli_round_trip(tmp_path):
    """`glm5 data tokenize`: JSONL -> shards whose documents decode back to the texts (+ EOS)."""
    import gzip
    from pathlib import Path

    from glm5.data.tokenize_cli import TokenizeConfig, run
    from glm5.data.tokenizer import load_tokenizer
    asset = bundled("tokenizer-8k")
    docs = [{"id": "a", "text": "Hello world. Second sentence!", "source": "web", "lang": "en", "domain": "tech"},
            {"id": "b", "text": "def f():\n    return 1\n", "source": "py", "lang": "code", "domain": "code"},
            {"id": "c", "text": "低质量", "source": "web", "lang": "zh", "domain": "tech", "quality": 0.1},
            {"id": "d", "text": "你好，世界。😀", "source": "web", "lang": "zh", "domain": "tech", "quality": 0.9}]
    with gzip.open(tmp_path / "in.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    cfg = TokenizeConfig(splits={"train": [str(tmp_path / "in.jsonl.gz")]}, output=str(tmp_path / "out"),
                         tokenizer=str(asset), min_quality=0.5)
    summary = run(cfg)
    assert summary["train"]["docs"] == 3 and summary["train"]["dtype"] == "uint16"
    sh = TokenShards(tmp_path / "out" / "train")
    tok = load_tokenizer(sh.meta["tokenizer"])  # the copy that travels with the shards
    kept = [d for d in docs if d.get("quality", 1.0) >= 0.5]
    for i, d in enumerate(kept):
        assert tok.decode(sh.doc(i)) == d["text"] + "<|endoftext|>"
        assert (sh.category(i, "source"), sh.category(i, "lang"), sh.category(i, "domain")) == \
            (d["source"], d["lang"], d["domain"])
    assert tok.encode(".")[0] in sh.sentence_end_ids and tok.encode("。")[0] in sh.sentence_end_ids
    assert sh.special_tokens == tok.special_tokens


def test_tiny_model_consumes_infill_batches_without_leaks(corpus):
    """Contract check with the model: a GLM batch runs, and Part A never sees Part B."""
    model_mod = pytest.importorskip("glm5.model.model")
    from glm5.model.config import ModelConfig
    path, _ = corpus
    cfg = ModelConfig.from_preset("tiny")
    cfg.block_position_embedding = True  # synthetic token ids stay below the 8192 vocabulary
    torch.manual_seed(0)
    model = model_mod.GLM5ForCausalLM(cfg).init_weights(0).eval()
    batch = PackedLoader(DataLoaderConfig(train_path=str(path), batch_size=1, seq_len=64, seed=3),
                         rank=0, world_size=1).next_batch("glm")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    blk, seg = batch["block_position_ids"][0], batch["segment_ids"][0]
    j = int(torch.nonzero(blk > 1)[0])  # a Part B token
    changed = {k: v.clone() for k, v in inputs.items()}
    changed["input_ids"][0, j] += 1
    with torch.no_grad():
        a, b = model(**inputs).logits[0], model(**changed).logits[0]
    part_a = (blk == 0) & (seg == seg[j])
    assert torch.allclose(a[part_a], b[part_a], atol=1e-5)
    assert not torch.allclose(a[j], b[j])


def test_long_documents_stage(corpus):
    """Seed D3 'long documents last': a stage with min_doc_tokens only starts long documents."""
    path, docs = corpus
    where = locate(docs)
    cfg = DataLoaderConfig(train_path=str(path), batch_size=4, stages=[
        StageConfig(until_step=2, seq_len=32), StageConfig(seq_len=64, min_doc_tokens=60)])
    loader = PackedLoader(cfg, rank=0, world_size=2)
    early = [loader.next_batch() for _ in range(2)]
    in_progress = {int(s._order[s.pos]) for s in loader.streams.values() if s.offset > 0}  # may finish
    late = [loader.next_batch() for _ in range(6)]
    doc_ids = lambda batch: {where[t][0] for t in batch["input_ids"].flatten().tolist() if t in where}  # noqa: E731
    assert min(len(docs[d]) for b in early for d in doc_ids(b)) < 60
    started_late = set().union(*(doc_ids(b) for b in late)) - in_progress
    assert started_late and min(len(docs[d]) for d in started_late) >= 60
    with pytest.raises(ValueError, match="no document"):
        PackedLoader(DataLoaderConfig(train_path=str(path), stages=[StageConfig(min_doc_tokens=10**6)]),
                     rank=0, world_size=1).next_batch()


FIM = {"<|fim_prefix|>": 7, "<|fim_suffix|>": 8, "<|fim_middle|>": 9}


def test_fim_rows_rebuild_their_documents(tmp_path):
    """Every FIM piece, put back in prefix + middle + suffix order, is a contiguous run of one document;
    SPM and PSM both occur; the middle ends with <|endoftext|>; causal labels on every token."""
    docs = make_shards(tmp_path / "train", n_docs=80, special={**SPECIAL, **FIM})
    where = locate(docs)
    loader = PackedLoader(DataLoaderConfig(train_path=str(tmp_path / "train"), batch_size=6, seq_len=96, seed=2),
                          rank=0, world_size=1)
    batch = loader.next_batch("fim")
    assert "attention_mask" not in batch  # FIM is causal
    orders = Counter()
    for r in range(6):
        ids, seg, lab = batch["input_ids"][r], batch["segment_ids"][r], batch["labels"][r]
        for s in seg.unique().tolist():
            piece = ids[seg == s].tolist()
            if s == 0 or FIM["<|fim_middle|>"] not in piece:
                continue
            assert torch.equal(lab[seg == s][:-1], ids[seg == s][1:])  # causal, aligned
            mid_at = piece.index(FIM["<|fim_middle|>"])
            head, middle = piece[:mid_at], piece[mid_at + 1:]
            assert middle[-1] == SPECIAL["<|endoftext|>"]
            middle = middle[:-1]
            if head[0] == FIM["<|fim_suffix|>"]:  # SPM: <suf> suffix <pre> prefix
                k = head.index(FIM["<|fim_prefix|>"])
                suffix, prefix = head[1:k], head[k + 1:]
                orders["spm"] += 1
            else:  # PSM: <pre> prefix <suf> suffix
                k = head.index(FIM["<|fim_suffix|>"])
                prefix, suffix = head[1:k], head[k + 1:]
                orders["psm"] += 1
            whole = prefix + middle + suffix
            d, p = where[whole[0]]
            assert whole == docs[d][p:p + len(whole)].tolist()
    assert orders["spm"] > 0 and orders["psm"] > 0
    make_shards(tmp_path / "plain", n_docs=10)  # the module's SPECIAL: no FIM tokens
    with pytest.raises(ValueError, match="fim_tokens"):
        PackedLoader(DataLoaderConfig(train_path=str(tmp_path / "plain")), 0, 1).next_batch("fim")


def test_named_groups_split_weights_by_tokens(corpus):
    """The seeds' 60/30/10-style mixture over named groups of domains."""
    path, docs = corpus
    sh = TokenShards(path)
    tokens = {g: int(sh.doc_len[d].sum()) for g, d in sh.groups("domain").items()}
    cfg = DataLoaderConfig(train_path=str(path), groups={"prose": ["general"], "both": ["general", "code"]},
                           weights={"prose": 0.5, "both": 0.5})
    probs = PackedLoader(cfg, rank=0, world_size=1)._probs(cfg.stage_at(0))
    share = tokens["general"] / (tokens["general"] + tokens["code"])
    assert probs.tolist() == pytest.approx([0.5 * (1 - share), 0.5 + 0.5 * share])  # [code, general]
    with pytest.raises(ValueError, match="groups.m"):
        PackedLoader(DataLoaderConfig(train_path=str(path), groups={"m": ["math"]}, weights={"m": 1.0}), 0, 1)
