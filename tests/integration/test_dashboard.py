"""The operator dashboard in a real browser: Debian's Chromium driven by Playwright, against a
live CPU app (1 prefill + 1 decode replica, a real redis-server) under the route prefix /dash.

Skipped only when Playwright (`pip install playwright`) or /usr/bin/chromium
(`apt-get install chromium`) is missing; Playwright's own browser download is never used."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from deploy.ops.dashboard import install_dashboard
from deploy.ops.status_history import INTERVAL_S
from tests.integration.conftest import deploy

pytestmark = pytest.mark.timeout(300)

MODEL = "llama"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def test_page_and_assets_come_from_pdserve_itself():
    app = FastAPI()
    install_dashboard(app)
    client = TestClient(app)
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # relative references only (the page also lives under route prefixes), nothing external
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(refs) == ["dashboard/static/dashboard.css", "dashboard/static/dashboard.js", "data:,"]
    assert client.get("/dashboard/static/dashboard.css").headers["content-type"].startswith("text/css")
    script = client.get("/dashboard/static/dashboard.js")
    assert script.status_code == 200
    assert re.findall(r"https?://[^\s\"'`]+", script.text) == ["http://www.w3.org/2000/svg"]


# ---------------------------------------------------------------- in the browser
def _chromium_or_skip():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pip install playwright (no `playwright install` needed)")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: apt-get install chromium")
    return sync_playwright


@pytest.fixture(scope="module")
def dash(serve_cluster, tiny_llama):
    sync_playwright = _chromium_or_skip()
    args = {
        "model": tiny_llama,
        "served_model_name": MODEL,
        "redis_url": serve_cluster.redis.url,
        "num_kv_blocks": 256,
        "device": "cpu",
        "transfer_timeout_s": 10.0,
        "lease_ttl_s": 10.0,
        "prefill": {"replicas": 1, "num_cpus": 0.5},
        "decode": {"replicas": 1, "num_cpus": 0.5},
    }
    base = deploy(serve_cluster, "dash", "/dash", args)
    yield base, sync_playwright
    from ray import serve

    serve.delete("dash")


def _number(text: str) -> float:
    return float(text.replace(",", "").rstrip("%"))


def _history(base: str, since: float | None = None) -> list[dict]:
    params = {"since": since} if since is not None else None
    answer = httpx.get(f"{base}/v1/cluster/history", params=params, timeout=10).json()
    assert answer["interval_s"] == INTERVAL_S and answer["window_s"] == 600.0
    return answer["samples"]


def _wait_for_history(base: str, done, timeout_s: float = 60.0) -> list[dict]:
    """Poll the ingress's history until ``done(samples)``; the samples."""
    deadline = time.monotonic() + timeout_s
    samples = _history(base)
    while not done(samples):
        assert time.monotonic() < deadline, f"history never got there: {samples[-3:]}"
        time.sleep(0.5)
        samples = _history(base)
    return samples


def _points(page, chart: str) -> int:
    return int(page.get_by_test_id(chart).get_attribute("data-points"))


def test_dashboard_follows_live_traffic(dash):
    base, sync_playwright = dash
    status = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()
    prefill_ids = [r["worker_id"] for r in status["pools"]["prefill"]]
    decode_ids = [r["worker_id"] for r in status["pools"]["decode"]]
    assert len(prefill_ids) == len(decode_ids) == 1
    assert status["pairs"] == [] and status["http"]["total"] == 0
    # the ingress samples from its start, before anyone looks
    before = _wait_for_history(base, lambda s: len(s) >= 3)
    assert [s["t"] for s in before] == sorted(s["t"] for s in before)
    assert all(s["output_tokens_per_s"] == 0.0 for s in before[1:])
    assert all(s["ttft"]["p50"] is None for s in before)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.goto(f"{base}/dashboard")

            # the first view draws the ingress's history at once: one throughput point per
            # sample after the first (a rate needs two), before this page has polled twice
            page.wait_for_selector("body[data-history-loaded]", timeout=30_000)
            loaded = int(page.locator("body").get_attribute("data-history-loaded"))
            assert loaded >= len(before)
            assert _points(page, "chart-throughput") >= loaded - 1 >= 2
            assert _points(page, "chart-errors") >= 2 * (loaded - 1)  # failed/s and refused/s
            assert page.get_by_test_id("chart-throughput").get_attribute("data-max") == "0"

            # both pools, one row per replica, each healthy
            page.wait_for_selector('[data-testid="pool-decode"] [data-testid^="replica-"]', timeout=30_000)
            for pool, ids in (("prefill", prefill_ids), ("decode", decode_ids)):
                rows = page.locator(f'[data-testid="pool-{pool}"] tbody tr[data-testid^="replica-"]')
                assert rows.count() == len(ids)
                for worker_id in ids:
                    row = page.locator(f'[data-testid="replica-{worker_id}"]')
                    assert row.get_attribute("data-healthy") == "true"
                    assert row.locator('[data-testid="health"]').inner_text() == "healthy"
            assert page.get_by_test_id("requests-finished").inner_text() == "0"
            weights = page.get_by_test_id("model-weights")  # the tiny model is named as random
            assert weights.inner_text().startswith("RANDOM weights") and "warn" in weights.get_attribute("class")
            assert page.get_by_test_id("cluster-hit-rate").inner_text() == "0.0%"
            assert page.get_by_test_id("index-health").inner_text() == "healthy"
            # other apps of this test session serve the same model and share its index namespace
            # (compared with a count read now: the one above may have been read while a loaded
            # Redis lookup timed out, which status shows as None)
            live = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()["index"]["live_workers"]
            assert int(page.get_by_test_id("index-live-workers").inner_text()) >= 2  # this app's two at least
            assert live is None or live >= 2
            assert _points(page, "chart-ttft") == 0
            assert page.locator('[data-testid="pairs"] tr[data-testid^="pair-"]').count() == 0
            assert page.get_by_test_id("pairs").inner_text() == "no transfers yet"
            assert page.get_by_test_id("requests-refused").inner_text() == "0"
            assert page.get_by_test_id("migrations").inner_text() == "0"
            assert page.get_by_test_id("client-errors").inner_text() == "0"
            assert page.get_by_test_id("throughput-tokens").inner_text() == "0.0 tok/s"
            assert page.get_by_test_id("error-rate").inner_text() == "–"  # no request ended yet

            # two prompts sharing a 96-token prefix (6 blocks), then two unrelated ones
            rng = random.Random(11)
            shared = [rng.randrange(10, 1000) for _ in range(96)]
            prompts = [shared + [rng.randrange(10, 1000) for _ in range(8)] for _ in range(2)]
            prompts += [[rng.randrange(10, 1000) for _ in range(40)] for _ in range(2)]
            for prompt in prompts:
                reply = httpx.post(
                    f"{base}/v1/completions",
                    timeout=60,
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0},
                )
                assert reply.status_code == 200, reply.text
            # and one the ingress turns away: a client error, not a failure or a refusal
            wrong = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": "nope", "prompt": "hi"})
            assert wrong.status_code == 404
            final = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()
            assert final["requests"]["finished"] == len(prompts)
            assert final["requests"]["failed"] == 0
            http = final["http"]
            assert (http["ok"], http["refused"], http["client_errors"], http["server_errors"]) == (4, 0, 1, 0)
            assert http["responses"] == {"200": 4, "404": 1}
            # the last minute holds the traffic: tokens moved, no request failed
            rates = final["throughput"]
            assert rates["output_tokens_per_s"] > 0 and rates["requests_per_s"] > 0
            assert rates["error_fraction"] == 0.0 and rates["refused_per_s"] == 0.0

            # the real pair, as the decode replica counted it
            decode = final["pools"]["decode"][0]
            assert decode["transfers"] > 0
            [pair] = final["pairs"]
            assert (pair["prefill"], pair["decode"], pair["prefill_live"]) == (prefill_ids[0], decode_ids[0], True)
            assert pair["transfers"] == decode["transfers"]
            assert pair["transfer_bytes"] == decode["transfer_bytes"] > 0
            assert pair["transfer_failures"] == decode["transfer_failures"] == 0
            assert pair["recomputed_prefills"] == decode["recomputed_prefills"]
            assert 0 < pair["transfer_p50_s"] <= pair["transfer_p99_s"]

            page.wait_for_function(
                f"document.querySelector('[data-testid=\"requests-finished\"]').textContent === '{len(prompts)}'",
                timeout=30_000,
            )
            # throughput and error figures of the last minute, as the page shows them
            page.wait_for_function(
                "parseFloat(document.querySelector('[data-testid=\"throughput-tokens\"]').textContent) > 0",
                timeout=30_000,
            )
            assert re.fullmatch(r"\d+\.\d tok/s", page.get_by_test_id("throughput-tokens").inner_text())
            assert re.fullmatch(r"\d+\.\d\d req/s", page.get_by_test_id("throughput-requests").inner_text())
            assert page.get_by_test_id("error-rate").inner_text() == "0.0%"
            assert page.get_by_test_id("failed-rate").inner_text() == "0.00/s"
            assert page.get_by_test_id("refused-rate").inner_text() == "0.00/s"
            assert page.get_by_test_id("requests-refused").inner_text() == "0"
            assert page.get_by_test_id("client-errors").inner_text() == "1"
            # once traffic stops the page shows exactly what the ingress reports
            hit_rate = final["requests"]["cluster_prefix_hit_rate"]
            assert hit_rate > 0
            page.wait_for_function(
                f"document.querySelector('[data-testid=\"cluster-hit-rate\"]').textContent === '{hit_rate * 100:.1f}%'",
                timeout=30_000,
            )
            assert _number(page.get_by_test_id("cluster-hit-rate").inner_text()) > 0
            assert _number(page.get_by_test_id("transfer-count").inner_text()) == decode["transfers"] > 0
            decode_row = page.locator(f'[data-testid="replica-{decode_ids[0]}"]')
            assert decode_row.locator('[data-testid="requests"]').inner_text() == str(decode["requests"])
            # the pair table: one row, the real pair
            rows = page.locator('[data-testid="pairs"] tr[data-testid^="pair-"]')
            assert rows.count() == 1
            row = page.get_by_test_id(f"pair-{prefill_ids[0]}-{decode_ids[0]}")
            assert row.get_attribute("data-prefill") == prefill_ids[0]
            assert row.get_attribute("data-decode") == decode_ids[0]
            assert row.locator('[data-testid="transfers"]').inner_text() == str(decode["transfers"])
            assert (
                row.locator('[data-testid="transfer-bytes"]').inner_text()
                == decode_row.locator('[data-testid="transfer-bytes"]').inner_text()
            )
            assert row.locator('[data-testid="failures"]').inner_text() == "0"
            assert row.locator('[data-testid="recomputed"]').inner_text() == str(decode["recomputed_prefills"])
            for p in ("p50", "p99"):
                assert re.fullmatch(r"\d+\.\d+ ms", row.locator(f'[data-testid="{p}"]').inner_text())
            # two polls since the traffic: each percentile is a line of at least two points
            page.wait_for_function(
                "['chart-ttft', 'chart-itl'].every(id => Number(document.getElementById(id).dataset.points) >= 6)",
                timeout=30_000,
            )
            assert page.locator('[data-testid="chart-ttft"] path').count() == 3  # p50, p90, p99
            page.wait_for_function(
                "Number(document.getElementById('chart-throughput').dataset.max) > 0", timeout=30_000
            )
            assert errors == []

            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"dashboard screenshot: {shot}")

            # the server keeps what a page saw: a sample after the traffic holds its totals
            after = _wait_for_history(
                base, lambda s: s[-1]["completion_tokens"] == final["requests"]["completion_tokens"]
            )
            assert after[-1]["finished"] == len(prompts) and after[-1]["client_errors"] == 1
            assert max(s["output_tokens_per_s"] or 0 for s in after) > 0
            with_ttft = [s for s in after if s["ttft"]["p50"] is not None]
            assert with_ttft

            # a page opened now draws that history from the history endpoint alone (its status
            # calls are cut off), on its first poll
            fresh = browser.new_page(viewport={"width": 1400, "height": 1000})
            fresh_errors: list[str] = []
            fresh.on("pageerror", lambda exc: fresh_errors.append(str(exc)))
            fresh.route("**/v1/cluster/status", lambda route: route.abort())
            fresh.goto(f"{base}/dashboard")
            fresh.wait_for_selector("body[data-history-loaded]", timeout=30_000)
            assert int(fresh.locator("body").get_attribute("data-history-loaded")) >= len(after)
            assert _points(fresh, "chart-ttft") >= 3 * len(with_ttft)
            assert _points(fresh, "chart-itl") >= 3
            assert float(fresh.get_by_test_id("chart-throughput").get_attribute("data-max")) > 0
            assert fresh.get_by_test_id("conn-status").inner_text().startswith("status unavailable")
            assert fresh.locator("body").get_attribute("data-polls") is None  # no status was shown
            assert fresh_errors == []
        finally:
            browser.close()
