"""Prometheus metrics through ``ray.util.metrics`` (Ray exports them; Grafana reads them).

Names follow DESIGN.md (and vLLM's where one exists). Worker gauges are refreshed from the
engine thread at most every ``REFRESH_S``; counters advance by the difference of the worker's
cumulative counters since the last refresh, so nothing on the hot path touches the exporter.
"""

from __future__ import annotations

import threading
import time

from ray.util.metrics import Counter, Gauge, Histogram

LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
REFRESH_S = 0.5

_lock = threading.Lock()
_metrics: dict[str, object] = {}


def _get(kind, name: str, description: str, tag_keys: tuple[str, ...] = (), **kwargs):
    with _lock:
        metric = _metrics.get(name)
        if metric is None:
            metric = kind(name, description=description, tag_keys=tag_keys, **kwargs)
            _metrics[name] = metric
        return metric


def _hist(name: str, description: str, tag_keys: tuple[str, ...] = ()) -> Histogram:
    return _get(Histogram, name, description, tag_keys, boundaries=LATENCY_BOUNDARIES)


class IngressMetrics:
    def __init__(self, model: str) -> None:
        self.tags = {"model": model}
        self.ttft = _hist("pdserve_time_to_first_token_seconds", "Time to first token", ("model",))
        self.itl = _hist("pdserve_inter_token_latency_seconds", "Time between output tokens", ("model",))
        self.e2e = _hist("pdserve_e2e_request_latency_seconds", "Request latency, arrival to last token", ("model",))
        # Same tag keys as the workers' local-scope series of these counters.
        prefix_keys = ("scope", "worker", "role", "model")
        self.queries = _get(
            Counter, "pdserve_prefix_cache_queries_total", "Prompt tokens looked up in a prefix cache", prefix_keys
        )
        self.hits = _get(
            Counter, "pdserve_prefix_cache_hits_total", "Prompt tokens served from a prefix cache", prefix_keys
        )
        self.requests = _get(Counter, "pdserve_requests_total", "Requests by outcome", ("outcome", "model"))
        self.migrations = _get(
            Counter,
            "pdserve_decode_migrations_total",
            "Decode streams resumed on another replica after theirs died",
            ("model",),
        )
        self.live_migrations = _get(
            Counter,
            "pdserve_decode_live_migrations_total",
            "Decode streams moved to another replica with their KV (nothing recomputed)",
            ("model",),
        )

    def first_token(self, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        self.ttft.observe(ttft_s, tags=self.tags)
        tags = {"scope": "cluster", "worker": "ingress", "role": "ingress", **self.tags}
        self.queries.inc(prompt_tokens, tags=tags)
        if cached_tokens:
            self.hits.inc(cached_tokens, tags=tags)

    def migrated(self) -> None:
        self.migrations.inc(1, tags=self.tags)

    def moved_live(self) -> None:
        self.live_migrations.inc(1, tags=self.tags)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds, tags=self.tags)

    def finished(self, e2e_s: float | None, outcome: str) -> None:
        if e2e_s is not None:
            self.e2e.observe(e2e_s, tags=self.tags)
        self.requests.inc(1, tags={"outcome": outcome, **self.tags})


_WORKER_COUNTERS = {
    # cumulative WorkerStats / engine field -> (metric name, description, extra tags)
    "prefix_queries": ("pdserve_prefix_cache_queries_total", "", {"scope": "local"}),
    "prefix_hits": ("pdserve_prefix_cache_hits_total", "", {"scope": "local"}),
    "transfer_bytes": ("pdserve_kv_transfer_bytes_total", "KV bytes received over transfers", {}),
    "transfer_failures": ("pdserve_kv_transfer_failures_total", "KV transfers that failed", {}),
    "transfer_corrupt": (
        "pdserve_kv_transfer_corrupt_total",
        "KV transfers whose blocks arrived with another checksum than was sent",
        {},
    ),
    "recomputed_prefills": ("pdserve_recomputed_prefills_total", "Prompts recomputed on decode", {}),
    "preemptions": ("pdserve_preemptions_total", "Sequences preempted for lack of KV blocks", {}),
    # KV tiers under the KV cache (workers/engine/kv_tiers.py): one metric per quantity, a tag per tier
    "host_spills": ("pdserve_kv_tier_spills_total", "KV blocks copied down into a tier", {"tier": "host"}),
    "disk_spills": ("pdserve_kv_tier_spills_total", "KV blocks copied down into a tier", {"tier": "disk"}),
    "host_hits": ("pdserve_kv_tier_hits_total", "KV blocks loaded back from a tier", {"tier": "host"}),
    "disk_hits": ("pdserve_kv_tier_hits_total", "KV blocks loaded back from a tier", {"tier": "disk"}),
    "tier_loads": ("pdserve_kv_tier_loads_total", "Loads of a request's blocks from the tiers", {}),
    "tier_load_s": ("pdserve_kv_tier_load_seconds_total", "Seconds those loads took, summed", {}),
}


class WorkerMetrics:
    def __init__(self, worker_id: str, role: str, model: str) -> None:
        self.tags = {"worker": worker_id, "role": role, "model": model}
        tag_keys = ("worker", "role", "model")
        self.kv_usage = _get(Gauge, "pdserve_kv_cache_usage_perc", "Fraction of KV blocks in use", tag_keys)
        self.running = _get(Gauge, "pdserve_num_requests_running", "Sequences running", tag_keys)
        self.waiting = _get(Gauge, "pdserve_num_requests_waiting", "Sequences waiting", tag_keys)
        self.queue_time = _hist("pdserve_request_queue_time_seconds", "Time from arrival to first schedule", tag_keys)
        self.transfer_seconds = _hist("pdserve_kv_transfer_seconds", "Duration of one KV transfer", tag_keys)
        self.tier_blocks = _get(Gauge, "pdserve_kv_tier_blocks", "KV blocks a tier holds", ("tier", *tag_keys))
        self.counters = {
            field: _get(Counter, name, desc or name, (*extra, *tag_keys))
            for field, (name, desc, extra) in _WORKER_COUNTERS.items()
        }
        self._last: dict[str, float] = {}
        self._last_refresh = 0.0

    def due(self) -> bool:
        return time.monotonic() - self._last_refresh >= REFRESH_S

    def refresh(self, snapshot: dict) -> None:
        """Gauges and counter deltas from a worker snapshot (WorkerStats.snapshot)."""
        self._last_refresh = time.monotonic()
        self.kv_usage.set(snapshot["kv_usage"], tags=self.tags)
        self.running.set(snapshot["num_running"], tags=self.tags)
        self.waiting.set(snapshot["num_waiting"], tags=self.tags)
        for tier in ("host", "disk"):
            if snapshot.get(f"{tier}_capacity"):
                self.tier_blocks.set(snapshot[f"{tier}_blocks"], tags={"tier": tier, **self.tags})
        for field, counter in self.counters.items():
            value = snapshot.get(field, 0)
            delta = value - self._last.get(field, 0)
            if delta > 0:
                extra = _WORKER_COUNTERS[field][2]
                counter.inc(delta, tags={**extra, **self.tags})
            self._last[field] = value

    def request_timing(self, timing: dict | None) -> None:
        if not timing:
            return
        queue = timing.get("prefill_queue_s", timing.get("decode_queue_s"))
        if queue is not None:
            self.queue_time.observe(queue, tags=self.tags)
        if "transfer_s" in timing:
            self.transfer_seconds.observe(timing["transfer_s"], tags=self.tags)
