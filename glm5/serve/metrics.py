"""Prometheus text exposition with vLLM's metric names (docs/design/metrics.md), written by hand.

Latency histograms are observed by the async engine from its own monotonic timestamps; gauges and
prefix-cache counters come from `engine.get_stats()` at scrape time. Every series has `model_name`.
Speculative decoding (MTP) uses vLLM v1's counter families (`vllm:spec_decode_num_drafts`, ...; samples
carry the `_total` suffix as prometheus_client writes them, per-position counts a `position` label);
`vllm:gpu_prefix_cache_hit_rate` is hits / queries since start; `glm5:lora_requests_total` counts
finished requests per LoRA adapter.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)

HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", E2E_BUCKETS),
    "vllm:request_queue_time_seconds": ("Histogram of time spent waiting in the queue in seconds.",
                                        E2E_BUCKETS),
}
COUNTERS = {
    "vllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "vllm:generation_tokens_total": "Number of generation tokens processed.",
    "vllm:request_success_total": "Count of successfully processed requests.",
}
# gauge / counter name -> (help, the `engine.get_stats()` keys tried in order)
FROM_STATS = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches.",
                                  ("num_running", "num_requests_running")),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed.",
                                  ("num_waiting", "num_requests_waiting")),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage.",
                                 ("kv_cache_usage", "kv_cache_usage_perc")),
    "vllm:prefix_cache_queries": ("counter", "Prefix-cache queries, in tokens.",
                                  ("prefix_cache_queries",)),
    "vllm:prefix_cache_hits": ("counter", "Prefix-cache hits, in tokens.", ("prefix_cache_hits",)),
}


# counter family -> (help, the `engine.get_stats()` key); present only when the engine drafts (MTP)
SPEC_DECODE = {
    "vllm:spec_decode_num_drafts": ("Number of spec decoding drafts.", "spec_num_drafts"),
    "vllm:spec_decode_num_draft_tokens": ("Number of draft tokens.", "spec_num_draft_tokens"),
    "vllm:spec_decode_num_accepted_tokens": ("Number of accepted tokens.", "spec_num_accepted_tokens"),
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
LORA_REQUESTS = "glm5:lora_requests_total"


class _Histogram:
    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v


class ServerMetrics:
    """Thread-safe: observed from the engine thread, rendered from the HTTP thread."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.lock = threading.Lock()
        self.hist = {name: _Histogram(b) for name, (_, b) in HISTOGRAMS.items()}
        self.counters: dict[tuple[str, str], float] = {}
        self.lora_requests: dict[str, int] = {}  # adapter name -> finished requests

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            self.hist[name].observe(value)

    def inc(self, name: str, value: float = 1.0, reason: str = "") -> None:
        with self.lock:
            self.counters[(name, reason)] = self.counters.get((name, reason), 0.0) + value

    def count_lora_request(self, name: str) -> None:
        with self.lock:
            self.lora_requests[name] = self.lora_requests.get(name, 0) + 1

    def render(self, stats: dict, extra_queued: int = 0) -> str:
        label = f'model_name="{_escape(self.model_name)}"'
        lines: list[str] = []
        with self.lock:
            for name, (help_, buckets) in HISTOGRAMS.items():
                self._render_hist(lines, name, help_, self.hist[name], label)
            for name, help_ in COUNTERS.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
                series = {r: v for (n, r), v in self.counters.items() if n == name} or {"": 0.0}
                for reason, v in sorted(series.items()):
                    extra = f',finished_reason="{_escape(reason)}"' if reason else ""
                    lines.append(f"{name}{{{label}{extra}}} {v}")
        for name, (kind, help_, keys) in FROM_STATS.items():
            value = next((float(stats[k]) for k in keys if k in stats and stats[k] is not None), 0.0)
            if name == "vllm:num_requests_waiting":
                value += extra_queued  # requests the server holds back (dynamic batching, max_batch_size)
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {value}"]
        self._render_hit_rate(lines, stats, label)
        self._render_spec_decode(lines, stats, label)
        with self.lock:
            lines += [f"# HELP {LORA_REQUESTS} Finished requests per LoRA adapter.", f"# TYPE {LORA_REQUESTS} counter"]
            lines += [f'{LORA_REQUESTS}{{{label},lora_name="{_escape(n)}"}} {v}'
                      for n, v in sorted(self.lora_requests.items())]
        self._render_expert_load(lines, stats.get("expert_load") or {}, label)
        return "\n".join(lines) + "\n"

    @staticmethod
    def _render_hit_rate(lines, stats: dict, label: str) -> None:
        queries, hits = stats.get("prefix_cache_queries") or 0, stats.get("prefix_cache_hits") or 0
        name = "vllm:gpu_prefix_cache_hit_rate"
        lines += [f"# HELP {name} Prefix-cache hit rate (hit tokens over queried tokens, since start).",
                  f"# TYPE {name} gauge", f"{name}{{{label}}} {hits / queries if queries else 0.0}"]

    @staticmethod
    def _render_spec_decode(lines, stats: dict, label: str) -> None:
        """vLLM's speculative-decoding counters; absent when the engine does not draft."""
        if "spec_num_drafts" not in stats:
            return
        for name, (help_, key) in SPEC_DECODE.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name}_total{{{label}}} {stats[key]}"]
        lines += [f"# HELP {PER_POS} Accepted tokens per draft position.", f"# TYPE {PER_POS} counter"]
        lines += [f'{PER_POS}_total{{{label},position="{pos}"}} {n}'
                  for pos, n in enumerate(stats["spec_num_accepted_tokens_per_pos"])]

    @staticmethod
    def _render_expert_load(lines, load: dict, label: str) -> None:
        """Per MoE layer: tokens per expert (counter) and the max/mean imbalance (gauge)."""
        if not load:
            return
        name = "glm5:moe_expert_tokens_total"
        lines += [f"# HELP {name} Tokens routed to each expert of each MoE layer.", f"# TYPE {name} counter"]
        for layer, entry in sorted(load.items()):
            for e, n in enumerate(entry["tokens_per_expert"]):
                lines.append(f'{name}{{{label},layer="{layer}",expert="{e}"}} {n}')
        name = "glm5:moe_expert_load_imbalance"
        lines += [f"# HELP {name} Max over mean tokens per expert of each MoE layer (1 = even).",
                  f"# TYPE {name} gauge"]
        lines += [f'{name}{{{label},layer="{layer}"}} {entry["imbalance"]}' for layer, entry in sorted(load.items())]

    @staticmethod
    def _render_hist(lines, name, help_, h: _Histogram, label) -> None:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip([*h.buckets, float("inf")], h.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            lines.append(f'{name}_bucket{{{label},le="{le}"}} {cumulative}')
        lines.append(f"{name}_count{{{label}}} {cumulative}")
        lines.append(f"{name}_sum{{{label}}} {h.sum}")


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
