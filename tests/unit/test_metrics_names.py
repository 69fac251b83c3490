"""Every metric DESIGN.md names is registered by the ingress or a worker (no Ray cluster needed:
ray.util.metrics objects can be created without one)."""

from deploy.ops import metrics
from deploy.ops.metrics import IngressMetrics, WorkerMetrics

DESIGN_METRICS = {
    "pdserve_time_to_first_token_seconds",
    "pdserve_inter_token_latency_seconds",
    "pdserve_e2e_request_latency_seconds",
    "pdserve_request_queue_time_seconds",
    "pdserve_kv_cache_usage_perc",
    "pdserve_num_requests_running",
    "pdserve_num_requests_waiting",
    "pdserve_prefix_cache_queries_total",
    "pdserve_prefix_cache_hits_total",
    "pdserve_kv_transfer_bytes_total",
    "pdserve_kv_transfer_seconds",
    "pdserve_kv_transfer_failures_total",
    "pdserve_recomputed_prefills_total",
    "pdserve_preemptions_total",
    "pdserve_decode_migrations_total",
    "pdserve_decode_live_migrations_total",
    "pdserve_kv_tier_blocks",
    "pdserve_kv_tier_spills_total",
    "pdserve_kv_tier_hits_total",
    "pdserve_kv_tier_loads_total",
    "pdserve_kv_tier_load_seconds_total",
}


def test_every_design_metric_is_registered():
    IngressMetrics("m")
    WorkerMetrics("w", "decode", "m")
    assert DESIGN_METRICS <= set(metrics._metrics)


def test_worker_counters_advance_by_deltas():
    wm = WorkerMetrics("w2", "decode", "m")
    seen = []

    class Spy:
        def inc(self, value, tags=None):
            seen.append((value, tags["worker"]))

    wm.counters = {"transfer_bytes": Spy()}
    snap = {"kv_usage": 0.5, "num_running": 1, "num_waiting": 0, "transfer_bytes": 100}
    wm.refresh(snap)
    wm.refresh({**snap, "transfer_bytes": 150})
    wm.refresh({**snap, "transfer_bytes": 150})
    assert seen == [(100, "w2"), (50, "w2")]


def test_grafana_dashboard_uses_only_exported_names():
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).parents[2] / "deploy/grafana/pdserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs for n in re.findall(r"ray_(pdserve_\w+)", e)}
    assert used == DESIGN_METRICS  # every DESIGN metric has a panel, and no panel reads an unknown name
