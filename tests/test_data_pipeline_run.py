"""End-to-end `glm5 data run` on a sample of the bundled corpus: outputs, stats, exclusions, resumption.

Idempotence: a run interrupted (a stage raising after shard k, in the local or the final pass) and then
rerun must give byte-identical data and exclusion shards to one clean run, with no temp files left.
"""

import gzip
import json
from pathlib import Path

import pytest

from glm5.cli import data as data_cli
from glm5.core.config import ConfigError, load_config
from glm5.core.resources import bundled
from glm5.data.pipeline import runner, stages
from glm5.data.pipeline.config import DataConfig
from glm5.data.pipeline.shards import read_jsonl, write_jsonl

CORPUS = bundled("corpus/train.jsonl.gz")


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """Every 60th corpus document (~350 docs, all sources), plus planted duplicates and a PII line."""
    docs = [d for i, d in enumerate(read_jsonl(CORPUS)) if i % 60 == 0]
    prose = next(d for d in docs if d["source"] == "python-docs")
    docs.append({**prose, "id": "planted/exact", "text": prose["text"].upper()})  # exact dup modulo case
    docs.append({**prose, "id": "planted/near", "text": prose["text"].replace("the", "a", 3)})
    docs.append({"id": "planted/german", "text": "Die Katze sitzt auf der Matte und schläft den ganzen Tag. " * 5,
                 "source": "planted", "lang": "de", "domain": "quotes"})
    pii = next(d for d in docs if d["source"] == "debian-reference-en")
    docs.append({**pii, "id": "planted/pii", "text": pii["text"] + "\nContact: admin.person@example.com or 8.8.4.4\n"})
    path = tmp_path_factory.mktemp("corpus") / "sample.jsonl.gz"
    write_jsonl(path, docs)
    return path


def _cfg(sample: Path, out: Path, *overrides: str) -> DataConfig:
    return load_config(DataConfig, "configs/data/default.toml",
                       [f"--input.paths=['{sample}']", f"--run.output_dir={out}", "--run.shard_docs=100",
                        "--run.num_workers=1", "--run.progress=false", "--quality.max_train_docs=300", *overrides])


def _outputs(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes()
            for sub in ("data", "excluded") for p in sorted((out / sub).glob("*"))}


@pytest.fixture(scope="module")
def clean_run(sample, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("clean")
    return out, runner.run(_cfg(sample, out))


def test_run_outputs_stats_and_exclusions(clean_run, sample):
    out, stats = clean_run
    num_in = sum(1 for _ in read_jsonl(sample))
    docs = [d for p in sorted((out / "data").glob("*.jsonl.gz")) for d in read_jsonl(p)]
    excluded = [d for p in sorted((out / "excluded").glob("*.jsonl.gz")) for d in read_jsonl(p)]
    assert stats["num_in"] == num_in and stats["num_out"] == len(docs) > 0
    assert len(docs) + len(excluded) == num_in  # every input document is either kept or excluded
    assert set(docs[0]) == {"id", "text", "source", "lang", "domain", "quality"}
    assert all(0.0 <= d["quality"] <= 1.0 for d in docs)
    by_id = {d["id"]: d for d in excluded}
    assert by_id["planted/exact"]["stage"] == "dedup" and by_id["planted/exact"]["reason"] == "exact_dup"
    assert by_id["planted/near"]["reason"] == "near_dup" and by_id["planted/near"]["dup_of"]
    assert by_id["planted/german"]["reason"] == "lang:de"
    assert all(0.0 <= d["quality"] < 0.25 for d in excluded if d["stage"] == "quality")
    kept = {d["id"]: d for d in docs}
    if "planted/pii" in kept:
        assert "<EMAIL>" in kept["planted/pii"]["text"] and "<IP>" in kept["planted/pii"]["text"]
    stage_names = [s["stage"] for s in stats["stages"]]
    assert stage_names == ["normalize", "langid", "filters", "pii", "signatures", "dedup", "quality", "domain"]
    for a, b in zip(stats["stages"], stats["stages"][1:]):
        assert b["in"] == a["out"]  # counts chain from stage to stage
    assert sum(stats["drops"].values()) == len(excluded)
    assert json.loads((out / "stats.json").read_text())["num_out"] == len(docs)


def _interrupt(monkeypatch, module, name: str, after: int):
    real, calls = getattr(module, name), []

    def flaky(*args):
        if len(calls) == after:
            raise RuntimeError("simulated crash")
        calls.append(1)
        return real(*args)
    monkeypatch.setattr(module, name, flaky)


@pytest.mark.parametrize("stage_fn", ["local_shard", "final_shard"])
def test_interrupted_run_resumes_to_identical_output(clean_run, sample, tmp_path, monkeypatch, stage_fn):
    out = tmp_path / "resumed"
    _interrupt(monkeypatch, stages, stage_fn, after=2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        runner.run(_cfg(sample, out))
    monkeypatch.undo()
    assert not (out / "stats.json").exists()
    runner.run(_cfg(sample, out))
    assert _outputs(out) == _outputs(clean_run[0])
    assert not list(out.rglob(".tmp-*"))  # nothing half-written left behind
    runner.run(_cfg(sample, out))  # a third run has nothing to do and changes nothing
    assert _outputs(out) == _outputs(clean_run[0])


def test_parallel_workers_match_in_process(clean_run, sample, tmp_path):
    out = tmp_path / "parallel"
    runner.run(_cfg(sample, out, "--run.num_workers=2"))
    assert _outputs(out) == _outputs(clean_run[0])


def test_changed_config_is_refused_unless_overwrite(clean_run, sample, tmp_path):
    out = tmp_path / "cfg"
    runner.run(_cfg(sample, out, "--input.limit=50", "--quality.enabled=false"))
    with pytest.raises(ConfigError, match="different config"):
        runner.run(_cfg(sample, out, "--input.limit=60", "--quality.enabled=false"))
    stats = runner.run(_cfg(sample, out, "--input.limit=60", "--quality.enabled=false", "--run.overwrite=true"))
    assert stats["num_in"] == 60


def test_cli_stats_and_dispatch(clean_run, capsys):
    out, stats = clean_run
    assert data_cli.main(["stats", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["docs"] == stats["num_out"]
    assert sum(v[0] for v in summary["source"].values()) == summary["docs"]
    assert summary["drops"] == stats["drops"]
    assert data_cli.main(["stats", str(out)]) == 0
    assert "by source" in capsys.readouterr().out
    assert data_cli.main(["nope"]) == 2
    assert data_cli.SUBCOMMANDS["tokenizer"][0] == "glm5.data.tokenizer_cli:main"


def test_bundled_corpus_format():
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        first = [json.loads(next(f)) for _ in range(5)]
    assert all(set(d) == {"id", "text", "source", "lang", "domain"} for d in first)
    total = sum(p.stat().st_size for p in CORPUS.parent.glob("*.gz"))
    assert total <= 25_000_000


def test_passes_start_the_biggest_shards_first():
    from glm5.data.pipeline.runner import largest_first

    assert largest_first([0, 1, 2, 3, 4], [5, 9, 5, 1, 9]) == [1, 4, 0, 2, 3]
    assert largest_first([2, 3], [5, 9, 5, 1]) == [2, 3]  # resumed: only the shards left to do
