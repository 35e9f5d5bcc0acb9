"""The partitioned global dedup and the executor seam, as plain functions (no Ray): fast.

The distributed pieces (band records shuffled into partitions, candidate pairs and verification per
partition, union-find per partition then merged, the keep rule per component group) must decide exactly
what one process decides, and what the greedy datasketch-LSH rule this project used before decides
(`_reference`, kept here as the oracle). The executor tests cover retries and the failing-shard error.
"""

import sys

import numpy as np
import pytest
from datasketch import MinHash, MinHashLSH

from glm5.core.config import ConfigError, load_config
from glm5.data.pipeline import runner, stages
from glm5.data.pipeline.config import DataConfig, DedupConfig
from glm5.data.pipeline.dedup import (SCHEME, band_records, candidate_pairs, components, exact_dups, exact_key,
                                      global_dedup, keep_rule, key_partition, num_perm, signature, verify_pairs)
from glm5.data.pipeline.executor import ExecutorConfig, JobFailed, LocalExecutor, RayExecutor
from glm5.data.pipeline.shards import expand_inputs, read_jsonl, write_jsonl
from tests.test_data_pipeline_dedup import _planted


def _reference(keys, sigs, cfg: DedupConfig) -> dict[int, tuple[str, int]]:
    """The greedy rule with a datasketch LSH index of the documents kept so far (the old implementation)."""
    removed, first = {}, {}
    lsh = MinHashLSH(num_perm=num_perm(cfg), params=(cfg.num_bands, cfg.rows_per_band))
    for i, k in enumerate(keys):
        if cfg.exact and k in first:
            removed[i] = ("exact_dup", first[k])
            continue
        first.setdefault(k, i)
        m = MinHash(num_perm=num_perm(cfg), seed=cfg.seed, hashvalues=sigs[i], scheme=SCHEME)
        ok = [c for c in lsh.query(m) if cfg.verify_threshold <= 0 or np.mean(sigs[c] == sigs[i]) >= cfg.verify_threshold]
        if ok:
            removed[i] = ("near_dup", min(ok))
        else:
            lsh.insert(i, m, check_duplication=False)
    return removed


def _partitioned(keys, sigs, cfg: DedupConfig, parts: int) -> dict[int, tuple[str, int]]:
    """The steps of dedup_shuffle.run_dedup, in memory, with `parts` partitions."""
    idx = np.arange(len(keys), dtype=np.int64)
    removed = {}
    for p in range(parts if cfg.exact else 0):
        mine = [i for i in range(len(keys)) if key_partition(keys[i], parts) == p]
        removed.update({g: ("exact_dup", t) for g, t in exact_dups(idx[mine], [keys[i] for i in mine]).items()})
    alive = np.array([i for i in idx if int(i) not in removed], np.int64)
    shards = np.array_split(alive, 3)  # records come from several shards
    recs: dict[int, list] = {}
    for s in shards:
        for p, r in band_records(s, sigs[s], cfg, parts).items():
            recs.setdefault(p, []).append(r)
    edges, labels = [], []
    for p, rs in recs.items():
        pairs = candidate_pairs(*(np.concatenate([r[k] for r in rs]) for k in range(3)))
        e = verify_pairs(pairs, sigs[pairs[:, 0]], sigs[pairs[:, 1]], cfg.verify_threshold)
        comp = components(e)
        edges.append(e)
        labels += [(n, r) for n, r in comp.items()]
    root = components(np.array(labels, np.int64).reshape(-1, 2))
    e = np.concatenate(edges)
    for g in range(parts):
        mine = e[[root[a] % parts == g for a in e[:, 0].tolist()]]
        removed.update({n: ("near_dup", t) for n, t in keep_rule(mine.reshape(-1, 2)).items()})
    return dict(sorted(removed.items()))


@pytest.mark.parametrize("cfg", [DedupConfig(), DedupConfig(verify_threshold=0.0), DedupConfig(exact=False),
                                 DedupConfig(num_bands=6, rows_per_band=3, verify_threshold=0.4)])
def test_partitioned_dedup_equals_single_process_and_reference(cfg):
    docs, _ = _planted(num_base=40, variants=5, seed=3)
    docs += [docs[7].upper(), docs[50], "  ".join(docs[61].split())]  # exact copies of a base and of variants
    keys = [exact_key(d) for d in docs]
    sigs = np.stack([signature(d, cfg) for d in docs])
    one = global_dedup(keys, sigs, cfg)
    assert one == _reference(keys, sigs, cfg)
    assert sum(r == "near_dup" for r, _ in one.values()) > 50  # chains and clusters are exercised
    for parts in (1, 2, 5):
        assert _partitioned(keys, sigs, cfg, parts) == one, parts


def test_pieces():
    edges = np.array([[5, 9], [1, 5], [2, 3], [9, 12]], np.int64)
    assert components(edges) == {1: 1, 5: 1, 9: 1, 12: 1, 2: 2, 3: 2}
    # 1-5, 5-9, 9-12: 1 kept, 5 removed (twin 1), 9 kept (its earlier neighbour 5 is gone), 12 removed (twin 9)
    assert keep_rule(edges) == {5: 1, 12: 9, 3: 2}
    assert exact_dups(np.array([4, 2, 9]), ["a", "a", "a"]) == {4: 2, 9: 2}
    vals = np.array([[1, 2], [1, 2], [1, 3], [1, 2]], np.uint64)
    band = np.array([0, 0, 0, 1], np.int32)
    assert candidate_pairs(np.array([7, 3, 5, 9]), band, vals).tolist() == [[3, 7]]  # same band and values
    sig = np.array([[1, 2, 3, 4], [1, 2, 3, 5]], np.uint64)
    pairs = np.array([[0, 1]])
    assert len(verify_pairs(pairs, sig[[0]], sig[[1]], 0.75)) == 1 and len(verify_pairs(pairs, sig[[0]], sig[[1]], 0.8)) == 0


def _flaky(path, x):
    """Fails on the first call for a given marker file, then succeeds."""
    if not path.exists():
        path.write_text("failed once")
        raise OSError("transient")
    return x * 2


def _broken(x):
    raise ValueError(f"bad input {x}")


@pytest.mark.parametrize("workers", [1, 2])
def test_local_executor_retries_then_names_the_failed_job(tmp_path, workers):
    ex = LocalExecutor(ExecutorConfig(num_workers=workers, max_retries=1))
    jobs = [(tmp_path / f"m{i}", i) for i in range(4)]
    assert ex.map(_flaky, jobs, [f"job {i}" for i in range(4)], "t") == [0, 2, 4, 6]  # in job order
    with pytest.raises(JobFailed, match=r"^shard 00001 failed after 2 attempts: ValueError: bad input 1$"):
        ex.map(_broken, [(1,)], ["shard 00001"], "t")


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    from glm5.core.resources import bundled

    docs = [d for i, d in enumerate(read_jsonl(bundled("corpus/train.jsonl.gz"))) if i % 150 == 0]
    prose = next(d for d in docs if d["source"] == "python-docs")
    docs.append({**prose, "id": "planted/near", "text": prose["text"].replace("the", "a", 3)})
    path = tmp_path_factory.mktemp("in") / "a.jsonl.gz"
    write_jsonl(path, docs)
    return path


def _cfg(inp, out, *overrides):
    return load_config(DataConfig, "configs/data/default.toml",
                       [f"--input.paths={inp}", f"--run.output_dir={out}", "--run.shard_docs=40",
                        "--run.num_workers=1", "--run.progress=false", "--quality.max_train_docs=100", *overrides])


def _outputs(out):
    return {p.relative_to(out).as_posix(): p.read_bytes() for sub in ("data", "excluded")
            for p in sorted((out / sub).glob("*"))}


def test_dedup_partitions_and_globbed_inputs_give_the_same_bytes(sample, tmp_path):
    base = tmp_path / "base"
    runner.run(_cfg(f"['{sample}']", base))
    assert any(d["id"] == "planted/near" and d["reason"] == "near_dup"
               for p in (base / "excluded").glob("*") for d in read_jsonl(p))
    other = tmp_path / "parts"
    runner.run(_cfg(f"['{sample.parent}/*.jsonl.gz']", other, "--run.dedup_partitions=3", "--run.num_workers=2"))
    assert _outputs(other) == _outputs(base)


def test_glob_matching_nothing_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"input pattern '.*/nothing-\*\.jsonl' matches no file"):
        expand_inputs([str(tmp_path / "nothing-*.jsonl")])
    with pytest.raises(FileNotFoundError, match="matches no file"):
        runner.run(_cfg(f"['{tmp_path}/x.jsonl', '{tmp_path}/nothing-*.jsonl']", tmp_path / "o"))


def test_fsspec_inputs(sample, tmp_path):
    fsspec = pytest.importorskip("fsspec")  # an optional dependency; installed by the dev extra
    with fsspec.open("memory://glm5-test/in/a.jsonl.gz", "wb") as f:
        f.write(sample.read_bytes())
    stats = runner.run(_cfg("['memory://glm5-test/in/*.jsonl.gz']", tmp_path / "m", "--quality.enabled=false"))
    assert stats["num_in"] == sum(1 for _ in read_jsonl(sample))


def test_failing_shard_stops_the_run_naming_it_and_resume_works(sample, tmp_path, monkeypatch, capsys):
    from glm5.cli import main as cli

    base = tmp_path / "base"
    runner.run(_cfg(f"['{sample}']", base))
    real = stages.local_shard

    def bad(cfg, in_path, out_dir):
        if out_dir.name == "00001":
            raise RuntimeError("disk on fire")
        return real(cfg, in_path, out_dir)
    monkeypatch.setattr(stages, "local_shard", bad)
    out = tmp_path / "failing"
    argv = ["data", "run", "--config", "configs/data/default.toml", f"--input.paths=['{sample}']",
            f"--run.output_dir={out}", "--run.shard_docs=40", "--run.num_workers=1", "--run.progress=false",
            "--quality.max_train_docs=100"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("glm5 data: local pass shard 00001 failed after 3 attempts: RuntimeError: disk on fire; the "
                   "finished shards are kept: rerun the same command to resume")
    assert (out / "work" / "local" / "00000" / "stats.json").is_file()  # finished work kept
    with pytest.raises(JobFailed) as e:  # --debug: the traceback, with the job's own exception chained
        cli.main([*argv, "--debug"])
    assert isinstance(e.value.__cause__.__cause__, RuntimeError)
    monkeypatch.undo()
    assert cli.main(argv) == 0
    assert _outputs(out) == _outputs(base)


def test_ray_errors_are_one_line(tmp_path, capsys, monkeypatch):
    from glm5.cli import main as cli

    argv = ["data", "run", "--run.executor=ray", "--run.ray_address=127.0.0.1:1", f"--run.output_dir={tmp_path}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach the Ray cluster at run.ray_address='127.0.0.1:1'" in err
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed
    with pytest.raises(ConfigError, match=r"needs Ray: pip install .*\[cluster\]"):
        RayExecutor(ExecutorConfig(executor="ray"))


def test_dedup_resumes_at_partition_granularity(sample, tmp_path, monkeypatch):
    from glm5.data.pipeline import dedup_shuffle

    base = tmp_path / "base"
    runner.run(_cfg(f"['{sample}']", base))
    real = dedup_shuffle.keep_partition

    def bad(cfg, work, p):
        if p == 5:
            raise RuntimeError("killed")
        return real(cfg, work, p)
    monkeypatch.setattr(dedup_shuffle, "keep_partition", bad)
    out = tmp_path / "resumed"
    with pytest.raises(JobFailed, match="dedup keep partition 005 failed"):
        runner.run(_cfg(f"['{sample}']", out))
    monkeypatch.undo()
    d = out / "work" / "dedup" / "p8"
    done = {p: p.stat().st_mtime_ns for p in [*d.glob("lsh/*.npz"), *d.glob("exact/*.npz"), *d.glob("keep/*.json")]}
    assert len(list(d.glob("keep/*.json"))) == 5 and not (out / "work" / "dedup.json").exists()
    runner.run(_cfg(f"['{sample}']", out))
    assert {p: p.stat().st_mtime_ns for p in done} == done  # finished jobs were not redone
    assert len(list(d.glob("keep/*.json"))) == 8
    assert _outputs(out) == _outputs(base)


def test_input_sharding_is_a_job_per_file_or_one_with_a_limit(tmp_path):
    from glm5.data.pipeline.shards import make_input_shards

    for name, n in (("a", 5), ("b", 3)):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"text": f"{name} {i}"} for i in range(n)])
    ex = LocalExecutor(ExecutorConfig(num_workers=2))
    m = make_input_shards([str(tmp_path / "*.jsonl")], "text", 2, tmp_path / "s1", 0, ex)
    assert [(s["path"], s["num_docs"]) for s in m["shards"]] == [
        ("input-00000-00000.jsonl.gz", 2), ("input-00000-00001.jsonl.gz", 2), ("input-00000-00002.jsonl.gz", 1),
        ("input-00001-00000.jsonl.gz", 2), ("input-00001-00001.jsonl.gz", 1)]
    docs = [d for s in m["shards"] for d in read_jsonl(tmp_path / "s1" / s["path"])]
    assert [d["id"] for d in docs] == [f"a/{i}" for i in range(5)] + [f"b/{i}" for i in range(3)]
    m = make_input_shards([str(tmp_path / "*.jsonl")], "text", 2, tmp_path / "s2", 6, ex)
    assert m["num_docs"] == 6 and [s["num_docs"] for s in m["shards"]] == [2, 2, 2]


def test_tokenize_on_a_process_pool_matches_in_process(tmp_path):
    import shutil

    from glm5.data.tokenize_cli import TokenizeConfig, run

    def shards(workers: int) -> dict[str, bytes]:
        out = tmp_path / "tokens"  # one directory: meta.json records its path
        shutil.rmtree(out, ignore_errors=True)
        run(TokenizeConfig(splits={"train": ["bundled:corpus/validation.jsonl.gz"]}, output=str(out), batch_docs=32,
                           run=ExecutorConfig(num_workers=workers)))
        return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    one = shards(1)
    assert sum(k.endswith(".bin") for k in one) == 1 and len(one["train/part-00000.bin"]) > 10_000
    assert shards(2) == one  # 14 encode jobs over 2 processes, written in input order
