"""The dashboard's server-side window (deploy/ops/status_history.py), the status endpoint's added
figures (deploy/ops/cluster_status.py: pair table, rates), the decode workers' per-pair counters
(workers/worker_stats.py) and ``pdserve status``'s table (deploy/ops/status_table.py). No Ray."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from deploy.api.http_errors import install_error_handlers
from deploy.api.openai_protocol import RequestError
from deploy.ops.cluster_status import extend_status, pair_table
from deploy.ops.dashboard import install_dashboard
from deploy.ops.status_history import INTERVAL_S, RESPONSES, ResponseCounts, StatusHistory, condense
from deploy.ops.status_table import format_status
from workers.engine.stats import EngineStats
from workers.worker_stats import PairStats, WorkerStats, percentiles

NO_LATENCY = {"p50": None, "p90": None, "p99": None}


def status_at(
    t: float,
    *,
    tokens: int = 0,
    finished: int = 0,
    failed: int = 0,
    refused: int = 0,
    total: int | None = None,
    decode_bytes: dict[str, int] | None = None,
    aborted: int | None = None,
) -> dict:
    requests = {
        "started": finished + failed,
        "finished": finished,
        "failed": failed,
        "active": 0,
        "completion_tokens": tokens,
        "ttft_s": dict(NO_LATENCY),
        "itl_s": dict(NO_LATENCY),
    }
    if aborted is not None:
        requests["aborted"] = aborted
    http = {"refused": refused, "client_errors": 0, "total": finished + refused if total is None else total}
    decode = [
        {"worker_id": w, "healthy": True, "transfer_bytes": b, "kv_usage": 0.5} for w, b in (decode_bytes or {}).items()
    ]
    return {
        "time": t,
        "requests": requests,
        "http": http,
        "pools": {"prefill": [{"worker_id": "p1", "healthy": True, "kv_usage": 0.25}], "decode": decode},
    }


# ---------------------------------------------------------------- samples and rates
def test_a_sample_carries_the_rates_since_the_previous_one():
    first, bytes1 = condense(status_at(100.0, decode_bytes={"d1": 1000}), None, {})
    assert first["t"] == 100.0 and first["output_tokens_per_s"] is None and first["transfer_bytes_per_s"] is None
    second, bytes2 = condense(
        status_at(102.0, tokens=40, finished=4, failed=1, refused=2, decode_bytes={"d1": 5000}), first, bytes1
    )
    assert second["output_tokens_per_s"] == 20.0
    assert second["requests_per_s"] == 2.0
    assert second["failed_per_s"] == 0.5
    assert second["refused_per_s"] == 1.0
    assert second["aborted_per_s"] is None  # the ingress does not count aborts apart (yet)
    assert second["transfer_bytes_per_s"] == 2000.0
    assert second["kv_usage"] == {"prefill": 0.25, "decode": 0.5}
    assert bytes2 == {"d1": 5000}


def test_a_replaced_decode_replica_adds_no_negative_bandwidth():
    first, bytes1 = condense(status_at(10.0, decode_bytes={"d1": 9000, "d2": 100}), None, {})
    # d1 restarted (counter went down), d2 moved 400 bytes, d3 is new
    second, _ = condense(status_at(12.0, decode_bytes={"d1": 50, "d2": 500, "d3": 7000}), first, bytes1)
    assert second["transfer_bytes_per_s"] == 200.0


def test_the_ring_keeps_the_window_and_drops_out_of_order_samples():
    history = StatusHistory(interval_s=2.0, window_s=10.0)
    for i in range(20):
        history.record(status_at(1000.0 + 2 * i, tokens=10 * i))
    times = [s["t"] for s in history.samples]
    assert times == [1028.0, 1030.0, 1032.0, 1034.0, 1036.0, 1038.0]
    assert history.record(status_at(1037.0)) is None  # older than the newest sample
    assert [s["t"] for s in history.export(since=1034.0)["samples"]] == [1036.0, 1038.0]
    exported = history.export()
    assert exported["interval_s"] == 2.0 and exported["window_s"] == 10.0 and len(exported["samples"]) == 6
    assert all(s["output_tokens_per_s"] == 5.0 for s in exported["samples"])


def test_rates_over_the_last_minute_come_from_the_oldest_sample_in_it():
    history = StatusHistory(interval_s=2.0)
    history.record(status_at(0.0, tokens=0, decode_bytes={"d1": 0}))  # outside the minute
    history.record(status_at(50.0, tokens=100, finished=10, failed=0, refused=0, total=10, decode_bytes={"d1": 0}))
    history.record(status_at(80.0, tokens=400, finished=25, failed=5, refused=5, total=30, decode_bytes={"d1": 3000}))
    now = status_at(100.0, tokens=700, finished=40, failed=10, refused=10, total=50, decode_bytes={"d1": 3000})
    rates = history.rates(now)
    assert rates["window_s"] == 50.0  # from the sample at t=50
    assert rates["output_tokens_per_s"] == 12.0  # 600 tokens / 50 s
    assert rates["requests_per_s"] == 0.6
    assert rates["failed_per_s"] == 0.2
    assert rates["refused_per_s"] == 0.2
    assert rates["error_fraction"] == pytest.approx(10 / 40)  # 10 failed of 30 finished + 10 failed
    assert rates["refusal_fraction"] == 0.25  # 10 refused of 40 answers
    assert rates["transfer_bytes_per_s"] == 100.0  # 3000 bytes between t=50 and t=80
    assert rates["aborted_per_s"] is None


def test_aborted_requests_count_as_ended_but_not_as_errors():
    history = StatusHistory()
    history.record(status_at(0.0, aborted=0))
    rates = history.rates(status_at(10.0, finished=6, failed=2, aborted=2))
    assert rates["aborted_per_s"] == 0.2
    assert rates["error_fraction"] == 0.2


def test_no_rates_without_a_sample_to_measure_from():
    rates = StatusHistory().rates(status_at(5.0, tokens=10))
    assert rates["window_s"] is None and rates["output_tokens_per_s"] is None and rates["error_fraction"] is None


async def test_the_sampler_task_feeds_the_ring_and_survives_a_failed_round():
    calls = []

    async def collect():
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("a replica did not answer")
        return status_at(float(len(calls)), tokens=len(calls))

    history = StatusHistory(collect, interval_s=0.01)
    assert history.start() is history
    try:
        for _ in range(500):
            if len(history.samples) >= 3:
                break
            await asyncio.sleep(0.01)
        assert [s["t"] for s in history.samples][:3] == [1.0, 3.0, 4.0]
        assert history.errors == 1
        assert history.ensure_running()  # already running: nothing new
    finally:
        history.stop()


async def test_a_stopped_sampler_stays_stopped_and_keeps_its_samples():
    calls = []

    async def collect():
        calls.append(1)
        return status_at(float(len(calls)))

    history = StatusHistory(collect, interval_s=0.01).start()
    for _ in range(500):
        if history.samples:
            break
        await asyncio.sleep(0.01)
    history.stop()  # the ingress drains
    await asyncio.sleep(0.05)
    taken = len(calls)
    assert not history.ensure_running()  # a status read during the drain starts nothing
    await asyncio.sleep(0.05)
    assert len(calls) == taken and history._task is not None and history._task.done()
    assert history.export()["samples"]  # what was sampled stays readable


def test_without_an_event_loop_the_sampler_waits_for_one():
    async def collect():
        return status_at(1.0)

    history = StatusHistory(collect).start()
    assert history._task is None and not history.ensure_running()


# ---------------------------------------------------------------- completion responses by status
def test_completion_answers_are_counted_by_http_status():
    app = FastAPI()
    install_error_handlers(app)
    install_dashboard(app)

    @app.post("/v1/completions")
    async def completions(body: dict):
        if body.get("full"):
            raise RequestError("the server is at capacity", None, status=503, error_type="server_overloaded")
        if body.get("stream"):

            async def events():
                yield "data: 1\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        raise RuntimeError("a bug")

    client = TestClient(app, raise_server_exceptions=False)
    before = RESPONSES.snapshot()
    assert client.post("/v1/completions", json={}).status_code == 200
    assert client.post("/v1/completions", json={"stream": True}).text.endswith("[DONE]\n\n")
    refused = client.post("/v1/completions", json={"full": True})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert client.post("/v1/completions", content=b"{not json").status_code == 400
    assert client.post("/v1/chat/completions", json={}).status_code == 500
    assert client.get("/dashboard").status_code == 200  # not a completion: not counted
    after = RESPONSES.snapshot()
    delta = {k: after[k] - before[k] for k in ("total", "ok", "refused", "client_errors", "server_errors")}
    assert delta == {"total": 5, "ok": 2, "refused": 1, "client_errors": 1, "server_errors": 1}


def test_429_is_a_refusal_and_503_is_not_a_server_error():
    counts = ResponseCounts()
    for status in (200, 200, 429, 503, 404, 500):
        counts.add(status)
    assert counts.snapshot() == {
        "responses": {"200": 2, "404": 1, "429": 1, "500": 1, "503": 1},
        "total": 6,
        "ok": 2,
        "refused": 2,
        "client_errors": 1,
        "server_errors": 1,
    }


# ---------------------------------------------------------------- pairs
def test_pair_counters_on_the_decode_side():
    stats = WorkerStats("decode")
    for seconds in (0.010, 0.020, 0.030, 0.040, 1.0):
        stats.peer("p1").transferred(1000, seconds)
    stats.peer("p1").failed(recomputed=True)
    stats.peer("p2").recomputed_prefills += 1
    pairs = stats.pairs()
    assert pairs["p1"] == {
        "transfers": 5,
        "transfer_bytes": 5000,
        "transfer_seconds": pytest.approx(1.1),
        "transfer_failures": 1,
        "recomputed_prefills": 1,
        "pair_groups": 0,
        "pair_groups_since_failure": 0,
        "transfer_p50_s": 0.030,
        "transfer_p99_s": 1.0,
        "transfer_samples": 5,
    }
    assert pairs["p2"]["transfers"] == 0 and pairs["p2"]["transfer_p50_s"] is None
    assert pairs["p2"]["recomputed_prefills"] == 1
    assert "peers" not in stats.counters() and stats.counters()["role"] == "decode"


def test_a_pair_keeps_a_bounded_window_of_durations():
    pair = PairStats()
    for i in range(2000):
        pair.transferred(1, float(i))
    snap = pair.snapshot()
    assert snap["transfers"] == 2000 and snap["transfer_samples"] == 512
    assert snap["transfer_p50_s"] == percentiles(range(1488, 2000))["p50"]


def test_a_pair_counts_the_groups_it_created():
    pair = PairStats()
    pair.transferred(1, 0.1, created_pair=True)  # the first group
    pair.transferred(1, 0.1)
    pair.failed()  # the group is torn down: none since the failure yet
    assert pair.snapshot()["pair_groups"] == 1 and pair.snapshot()["pair_groups_since_failure"] == 0
    pair.transferred(1, 0.1, created_pair=True)  # over a new group
    pair.transferred(1, 0.1)
    snap = pair.snapshot()
    assert snap["pair_groups"] == 2 and snap["pair_groups_since_failure"] == 1 and snap["transfers"] == 4


def test_worker_snapshot_includes_its_pairs():
    state = EngineStats(
        num_blocks=8,
        num_free_blocks=6,
        num_cached_blocks=1,
        num_waiting=0,
        num_running=1,
        num_awaiting_kv=0,
        num_held=0,
        preemptions=0,
        evictions=0,
        prefix_queries=3,
        prefix_hits=1,
    )
    engine = SimpleNamespace(stats=lambda: state, running_left=lambda: [(5, 2)])
    stats = WorkerStats("decode")
    stats.transfers += 1
    stats.peer("p1").transferred(64, 0.5)
    snap = stats.snapshot(engine)
    assert snap["transfers"] == 1 and snap["free_blocks"] == 6 and snap["num_running"] == 1
    assert snap["kv_usage"] == 0.25 and snap["prefix_queries"] == 3 and snap["prefix_hits"] == 1
    assert snap["pairs"]["p1"]["transfer_bytes"] == 64
    assert snap["running_left"] == [[5, 2]]


def test_the_status_merges_every_decode_replicas_pairs():
    pair = {
        "transfers": 2,
        "transfer_bytes": 10,
        "transfer_seconds": 0.2,
        "transfer_failures": 0,
        "recomputed_prefills": 0,
        "transfer_p50_s": 0.1,
        "transfer_p99_s": 0.1,
        "transfer_samples": 2,
    }
    pools = {
        "prefill": [{"worker_id": "p1", "healthy": True}, {"worker_id": "p2", "healthy": False}],
        "decode": [
            {"worker_id": "d2", "healthy": True, "pairs": {"p1": pair, "p2": {**pair, "transfers": 1}}},
            {"worker_id": "d1", "healthy": True, "pairs": {"p1": {**pair, "transfers": 7}}},
            {"worker_id": "d3", "healthy": False, "error": "gone"},
        ],
    }
    rows = pair_table(pools)
    assert [(r["prefill"], r["decode"], r["transfers"], r["prefill_live"]) for r in rows] == [
        ("p1", "d1", 7, True),
        ("p1", "d2", 2, True),
        ("p2", "d2", 1, False),
    ]
    assert pair_table({"colocated": [{"worker_id": "c1", "healthy": True, "pairs": {}}]}) == []


def test_extend_status_adds_pairs_http_and_rates():
    history = StatusHistory()
    history.record(status_at(0.0))
    ingress = SimpleNamespace(history=history, stats=SimpleNamespace(aborted=3))
    status = status_at(10.0, tokens=50, finished=5)
    status["pools"]["decode"] = [
        {"worker_id": "d1", "healthy": True, "transfer_bytes": 0, "pairs": {"p1": {"transfers": 1}}}
    ]
    out = extend_status(status, ingress)
    assert out["pairs"] == [{"prefill": "p1", "decode": "d1", "prefill_live": True, "transfers": 1}]
    assert out["throughput"]["output_tokens_per_s"] == 5.0
    assert out["requests"]["aborted"] == 3  # read from the request figures when they count it
    assert set(out["http"]) >= {"total", "ok", "refused", "client_errors", "server_errors"}
    assert out["history"] == {"samples": 1, "interval_s": INTERVAL_S, "window_s": 600.0}


# ---------------------------------------------------------------- pdserve status
def full_status() -> dict:
    replica = {
        "healthy": True,
        "kv_usage": 0.125,
        "free_blocks": 224,
        "total_blocks": 256,
        "num_running": 1,
        "num_waiting": 0,
        "requests": 4,
        "prompt_tokens": 100,
        "cached_prompt_tokens": 25,
        "transfer_bytes": 3 * 2**20,
        "transfer_failures": 0,
        "recomputed_prefills": 1,
    }
    latency = {"p50": 0.012, "p90": 0.02, "p99": 0.03}
    return {
        "model": "llama",
        "mode": "disaggregated",
        "block_size": 16,
        "pools": {
            "prefill": [{**replica, "worker_id": "pre1", "node_ip": "10.0.0.11"}],
            "decode": [{**replica, "worker_id": "dec1"}, {"worker_id": "dec2", "healthy": False, "error": "gone"}],
        },
        "pairs": [
            {
                "prefill": "pre1",
                "decode": "dec1",
                "prefill_live": True,
                "transfers": 4,
                "transfer_bytes": 3 * 2**20,
                "transfer_p50_s": 0.004,
                "transfer_p99_s": 0.0125,
                "transfer_failures": 1,
                "recomputed_prefills": 2,
            },
            {
                "prefill": "old",
                "decode": "dec1",
                "prefill_live": False,
                "transfers": 1,
                "transfer_bytes": 0,
                "transfer_p50_s": None,
                "transfer_p99_s": None,
                "transfer_failures": 0,
                "recomputed_prefills": 0,
            },
        ],
        "requests": {
            "finished": 4,
            "active": 0,
            "failed": 1,
            "aborted": 2,
            "cluster_prefix_hit_rate": 0.25,
            "ttft_s": latency,
            "itl_s": latency,
            "e2e_s": latency,
            "window_s": 300.0,
        },
        "http": {"ok": 4, "refused": 1, "client_errors": 2, "server_errors": 0, "total": 7},
        "throughput": {
            "window_s": 60.0,
            "output_tokens_per_s": 12.5,
            "requests_per_s": 0.25,
            "failed_per_s": 0.0,
            "refused_per_s": 0.02,
            "aborted_per_s": 0.03,
            "error_fraction": 0.0,
        },
        "index": {"configured": True, "healthy": True, "live_workers": 2},
        "conversations": None,
    }


def test_status_table_names_units_and_shows_the_pairs():
    text = format_status(full_status())
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("pool"))
    units = lines[header + 1]
    for unit in ("%", "blocks", "seqs", "MiB", "prompts"):
        assert unit in units.split()
    assert "12.5%" in lines[header + 3] and "224/256" in lines[header + 3] and "3.0" in lines[header + 3]
    assert lines[header + 3].split()[:3] == ["prefill", "pre1", "10.0.0.11"]  # each replica's node address
    assert lines[header + 4].split()[:3] == ["decode", "dec1", "-"]  # an older server sends none
    assert lines[header + 5].split()[:4] == ["decode", "dec2", "-", "DOWN"]
    pair_header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["prefill", "decode", "transfers"])
    assert lines[pair_header + 1].split() == ["MiB", "ms", "ms", "prompts"]
    assert lines[pair_header + 3].split() == ["pre1", "dec1", "4", "3.0", "4", "12", "1", "2"]
    assert lines[pair_header + 4].split() == ["old", "(gone)", "dec1", "1", "0.0", "-", "-", "0", "0"]
    assert "requests: 4 finished, 0 active, 1 failed, 2 aborted;" in text
    assert "throughput (last 60 s): 12.5 output tokens/s, 0.25 requests/s" in text
    assert "errors (last 60 s): 0.0% of requests failed, 0.00 failed/s, 0.02 refused/s, 0.03 aborted/s" in text
    assert "HTTP answers: 4 ok, 1 refused (503/429), 2 client errors (4xx), 0 server errors (5xx)" in text


def test_status_table_reads_an_older_servers_status():
    status = full_status()
    for key in ("pairs", "http", "throughput"):
        del status[key]
    del status["requests"]["aborted"]
    text = format_status(status)
    assert "KV transfers by pair" not in text and "throughput" not in text
    assert "requests: 4 finished, 0 active, 1 failed; cluster prefix hit rate 25.0%" in text
