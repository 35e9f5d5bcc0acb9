"""bench/serve.py prompt-length spread (`--input-len-range`) and the knob summary over ABAB repeats."""

import importlib.util
import math
import random
import statistics
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).parent.parent / "bench" / "serve.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("dist", ["uniform", "log-uniform"])
def test_lengths_cover_the_range_and_follow_the_distribution(dist):
    lo, hi, n = 16, 512, 20000
    lengths = bench.prompt_lengths(random.Random(0), n, 128, (lo, hi), dist)
    assert len(lengths) == n and min(lengths) == lo and max(lengths) == hi  # both ends reachable, none outside
    # the median of each distribution, from its definition: (lo + hi) / 2, or the geometric mean of the
    # interval's ends for log-uniform ([lo, hi + 1) before the floor)
    expect = (lo + hi) / 2 if dist == "uniform" else math.sqrt(lo * (hi + 1))
    assert abs(statistics.median(lengths) - expect) < 0.05 * expect
    short = sum(k < 64 for k in lengths) / n  # log-uniform: [16, 64) is 2 of ~5 octaves; uniform: 48 of 497
    assert abs(short - (math.log(64 / 16) / math.log(513 / 16) if dist == "log-uniform" else 48 / 497)) < 0.02


def test_prompts_are_seeded_and_fixed_length_without_a_range():
    a = bench.make_prompts(3, 50, 128, 8000, (16, 512), "log-uniform")
    assert a == bench.make_prompts(3, 50, 128, 8000, (16, 512), "log-uniform")  # every knob server: same prompts
    assert a != bench.make_prompts(4, 50, 128, 8000, (16, 512), "log-uniform")
    assert len({len(p) for p in a}) > 10
    assert all(100 <= t < 7900 for p in a for t in p)
    assert {len(p) for p in bench.make_prompts(0, 20, 77, 8000)} == {77}
    with pytest.raises(ValueError, match="input-len-range"):
        bench.prompt_lengths(random.Random(0), 1, 128, (64, 16))
    with pytest.raises(ValueError, match="input-len-dist"):
        bench.prompt_lengths(random.Random(0), 1, 128, (16, 64), "normal")


def test_knob_summary_takes_the_median_of_repeats_and_ratios_to_the_first_set():
    def row(label, tok_s, ttft_p99, failed=0):
        ms = {"mean": 1.0, "p50": 10.0, "p99": ttft_p99}
        return {"label": label, "request_rate": 0.0, "output_throughput": tok_s, "request_throughput": tok_s / 64,
                "ttft_ms": ms, "tpot_ms": {"mean": 1.0, "p50": 5.0, "p99": 6.0}, "failed": failed}
    rows = [row("A", 100, 40), row("B", 150, 20), row("A", 110, 60), row("B", 130, 10, failed=1), row("A", 90, 50)]
    a, b = bench.knob_summary(rows)
    assert (a["label"], a["repeats"], b["label"], b["repeats"], b["failed"]) == ("A", 3, "B", 2, 1)
    assert a["median"]["out tok/s"] == 100 and b["median"]["out tok/s"] == 140
    assert b["ratio_to_first"]["out tok/s"] == pytest.approx(1.4)
    assert b["ratio_to_first"]["TTFT p99"] == pytest.approx(15 / 50)
    assert a["ratio_to_first"]["TPOT p50"] == 1.0
