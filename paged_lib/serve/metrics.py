"""``/metrics``: the server's numbers in Prometheus' text format, under vLLM's names.

vLLM declares counters without ``_total`` and ``prometheus_client`` adds it when they are
scraped, so ``vllm:prompt_tokens`` is read as ``vllm:prompt_tokens_total``; the same here.
Every sample carries ``model_name``, as vLLM's do. The engine thread writes, a scrape
reads: one lock around both.
"""

from __future__ import annotations

import bisect
import threading

#: vLLM's buckets for ``vllm:time_to_first_token_seconds``
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)

GAUGES = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:num_requests_swapped": "Number of requests swapped out to the CPU pool.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
}
COUNTERS = {
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
}
#: vLLM's buckets for its request-latency and per-token histograms
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.",
                                         TTFT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.",
                                         REQUEST_LATENCY_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.",
                                         TOKEN_LATENCY_BUCKETS),
    "vllm:request_time_per_output_token_seconds": (
        "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS),
}
#: ``vllm:request_success`` is counted per ``finished_reason``
FINISHED_REASONS = ("stop", "length", "abort", "error")


def _labels(pairs: dict[str, str]) -> str:
    def escape(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in pairs.items()) + "}"


class ServerMetrics:
    """Gauges set after each engine-loop turn, counters and histograms added to: time to
    first token, end-to-end latency, inter-token latency (between a request's consecutive
    outputs) and each request's time per output token (after its first)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.gauges = dict.fromkeys(GAUGES, 0.0)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)
        #: per histogram: a count per bucket (the last is +Inf) and the sum
        self._hist = {name: ([0] * (len(b) + 1), [0.0]) for name, (_, b) in HISTOGRAMS.items()}

    def set(self, **gauges: float) -> None:
        with self._lock:
            for key, value in gauges.items():
                self.gauges[f"vllm:{key}"] = float(value)

    def add(self, name: str, amount: int) -> None:
        with self._lock:
            self.counters[name] += amount

    def request_finished(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1

    def observe(self, name: str, seconds: float) -> None:
        """One observation of histogram ``name`` (one of :data:`HISTOGRAMS`)."""
        counts, total = self._hist[name]
        with self._lock:
            counts[bisect.bisect_left(HISTOGRAMS[name][1], seconds)] += 1
            total[0] += seconds

    def observe_ttft(self, seconds: float) -> None:
        self.observe("vllm:time_to_first_token_seconds", seconds)

    def render(self) -> str:
        """The exposition text (``text/plain; version=0.0.4``)."""
        model = {"model_name": self.model_name}
        lines = []
        with self._lock:
            for name, help_ in GAUGES.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge",
                          f"{name}{_labels(model)} {self.gauges[name]}"]
            for name, help_ in COUNTERS.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter",
                          f"{name}_total{_labels(model)} {float(self.counters[name])}"]
            name = "vllm:request_success"
            lines += [f"# HELP {name} Count of finished requests, by finished reason.",
                      f"# TYPE {name} counter"]
            lines += [f"{name}_total{_labels({**model, 'finished_reason': r})} {float(n)}"
                      for r, n in self.finished.items()]
            for name, (help_, buckets) in HISTOGRAMS.items():
                counts, seconds = self._hist[name]
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
                total = 0
                for le, n in zip((*map(str, buckets), "+Inf"), counts, strict=True):
                    total += n
                    lines.append(f"{name}_bucket{_labels({**model, 'le': le})} {float(total)}")
                lines += [f"{name}_count{_labels(model)} {float(total)}",
                          f"{name}_sum{_labels(model)} {seconds[0]}"]
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """``{sample name with labels: value}`` from exposition text (for tests and tools):
    ``parse_metrics(t)['vllm:num_requests_running{model_name="m"}']``."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
