"""`train_indexers(model_dir, out_dir)`: the packaged `train/smollm2-indexer` run on a tiny checkpoint: text
tokenised with the checkpoint's own tokenizer, only indexer tensors change, the written directory holds the
source's tokenizer files and generation config byte for byte and the configured index_topk, an interrupted
run resumes to the same weights (row draws included), shards of another tokenizer are refused."""

import gzip
import json
import random

import pytest
import torch

from glm5.core.config import load_config
from glm5.core.io import LazyTensors, safetensors_files
from glm5.data.tokenizer import load_tokenizer
from glm5.model.config import ModelConfig
from glm5.model.hf_adapter import save_pretrained
from glm5.model.model import GLM5ForCausalLM
from glm5.train.config import TrainConfig
from glm5.train.indexer_train import CONFIG, prepare_tokens, train_indexers

MODEL = dict(vocab_size=8192, hidden_size=32, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16,
             first_k_dense_replace=1, num_nextn_predict_layers=0, index_topk=1024, eos_token_id=[8156])
WORDS = "the of indexer key query attention sparse dense token layer model train def return class import".split()


def _corpus(path, n_docs=12, words=120):
    rng = random.Random(0)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i in range(n_docs):
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            f.write(json.dumps({"text": text, "domain": "code" if i % 3 == 0 else "tech", "lang": "en",
                                "source": "test"}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexer_train")
    model_dir = root / "model"
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", **MODEL)).init_weights(seed=0)
    save_pretrained(model, model_dir)
    load_tokenizer("bundled:tokenizer-8k").save(model_dir)
    corpus = {"train": [_corpus(root / "train.jsonl.gz")], "validation": [_corpus(root / "val.jsonl.gz", 3)]}
    return root, model_dir, corpus


def _overrides(steps: int) -> list[str]:
    return [f"--train.steps={steps}", "--train.time_limit_min=0", "--train.num_threads=0",
            "--model.overrides={index_topk = 8}", "--data.seq_len=64", "--dsa.indexer_kl_rows=16",
            "--data.stages=[{until_step = 0, seq_len = 64, min_doc_tokens = 64, weights = {tech = 0.65, code = 0.35}}]",
            "--optim.lr=1e-2", "--checkpoint.every=2", "--log.progress=false", "--log.measure_peak=false",
            "--log.eval_batches=1"]


def _tensors(d) -> dict[str, torch.Tensor]:
    t = LazyTensors(safetensors_files(d))
    return {k: t.get(k) for k in t.keys()}


def test_packaged_config_trains_only_the_indexers_on_long_rows():
    cfg = load_config(TrainConfig, CONFIG)
    assert cfg.train.trainable == "indexer" and cfg.dsa.indexer_warmup_steps == 0
    assert cfg.model.overrides["index_topk"] == 256 and cfg.data.stages[0].seq_len >= 1024
    assert cfg.data.stages[0].min_doc_tokens >= cfg.data.stages[0].seq_len  # one document per row
    assert cfg.dsa.indexer_kl_rows > 0


def test_train_indexers_writes_the_source_with_trained_indexers(source):
    root, model_dir, corpus = source
    out = root / "out"
    res = train_indexers(model_dir, out, data_dir=root / "tokens", corpus=corpus, overrides=_overrides(4))
    assert res["steps"] == 4 and res["resumed_at"] == 0 and len(res["indexer_kl"]) == 4
    assert all(k > 0 for k in res["indexer_kl"]) and res["train_s"] > 0 and "val_loss" in res
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text())["index_topk"] == 8 == res["index_topk"]
    meta = json.loads((root / "tokens" / "train" / "meta.json").read_text())
    assert meta["tokenizer_source"] == str(model_dir)
    before, after = _tensors(model_dir), _tensors(out)
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".indexer." in k for k in changed)
    assert {k.split(".self_attn.")[0] for k in changed} == {"model.layers.0", "model.layers.1"}


def test_interrupted_run_resumes_to_the_same_weights(source):
    root, model_dir, corpus = source
    # a constant LR: the schedule of a 2-step run is the first half of the 4-step one's (the stop at step 2
    # stands for an interruption; the trainer resumes from its step-2 checkpoint)
    const = ["--schedule.name=constant"]
    full = train_indexers(model_dir, root / "full", data_dir=root / "tokens", corpus=corpus,
                          overrides=_overrides(4) + const)
    train_indexers(model_dir, root / "part", data_dir=root / "tokens", corpus=corpus,
                   overrides=_overrides(2) + const)
    res = train_indexers(model_dir, root / "part", data_dir=root / "tokens", corpus=corpus,
                         overrides=_overrides(4) + const)
    assert res["resumed_at"] == 2 and res["indexer_kl"] == full["indexer_kl"][2:]
    a, b = _tensors(root / "full"), _tensors(root / "part")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_shards_of_another_tokenizer_are_refused(source, tmp_path):
    root, model_dir, corpus = source
    other = tmp_path / "other"
    save_pretrained(GLM5ForCausalLM(ModelConfig.from_preset("tiny", **MODEL)).init_weights(seed=0), other)
    tok = load_tokenizer("bundled:tokenizer-8k")
    tok.tok.add_tokens(["<extra-token>"])
    tok.save(other)
    prepare_tokens(model_dir, tmp_path / "tokens", corpus)
    with pytest.raises(ValueError, match="another tokenizer"):
        prepare_tokens(other, tmp_path / "tokens", corpus)
