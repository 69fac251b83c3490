"""The operator dashboard in a real browser: Debian's Chromium driven by Playwright, against a
live CPU app (1 prefill + 1 decode replica, a real redis-server) under the route prefix /dash.

Skipped only when Playwright (`pip install playwright`) or /usr/bin/chromium
(`apt-get install chromium`) is missing; Playwright's own browser download is never used."""

from __future__ import annotations

import random
import re
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from deploy.dashboard import install_dashboard
from tests.integration.conftest import deploy

pytestmark = pytest.mark.timeout(300)

MODEL = "llama"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
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
        "model": tiny_llama, "served_model_name": MODEL, "redis_url": serve_cluster.redis.url,
        "num_kv_blocks": 256, "device": "cpu", "transfer_timeout_s": 10.0, "lease_ttl_s": 10.0,
        "prefill": {"replicas": 1, "num_cpus": 0.5}, "decode": {"replicas": 1, "num_cpus": 0.5},
    }
    base = deploy(serve_cluster, "dash", "/dash", args)
    yield base, sync_playwright
    from ray import serve

    serve.delete("dash")


def _number(text: str) -> float:
    return float(text.replace(",", "").rstrip("%"))


def test_dashboard_follows_live_traffic(dash):
    base, sync_playwright = dash
    status = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()
    prefill_ids = [r["worker_id"] for r in status["pools"]["prefill"]]
    decode_ids = [r["worker_id"] for r in status["pools"]["decode"]]
    assert len(prefill_ids) == len(decode_ids) == 1

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.goto(f"{base}/dashboard")

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
            assert page.get_by_test_id("cluster-hit-rate").inner_text() == "0.0%"
            assert page.get_by_test_id("index-health").inner_text() == "healthy"
            # other apps of this test session serve the same model and share its index namespace
            assert page.get_by_test_id("index-live-workers").inner_text() == str(status["index"]["live_workers"])
            assert status["index"]["live_workers"] >= 2
            assert page.get_by_test_id("chart-ttft").get_attribute("data-points") == "0"

            # two prompts sharing a 96-token prefix (6 blocks), then two unrelated ones
            rng = random.Random(11)
            shared = [rng.randrange(10, 1000) for _ in range(96)]
            prompts = [shared + [rng.randrange(10, 1000) for _ in range(8)] for _ in range(2)]
            prompts += [[rng.randrange(10, 1000) for _ in range(40)] for _ in range(2)]
            for prompt in prompts:
                reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
                assert reply.status_code == 200, reply.text
            final = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()
            assert final["requests"]["finished"] == len(prompts)

            page.wait_for_function(
                f"document.querySelector('[data-testid=\"requests-finished\"]').textContent === '{len(prompts)}'",
                timeout=30_000)
            # once traffic stops the page shows exactly what the ingress reports
            hit_rate = final["requests"]["cluster_prefix_hit_rate"]
            assert hit_rate > 0
            page.wait_for_function(
                f"document.querySelector('[data-testid=\"cluster-hit-rate\"]').textContent === "
                f"'{hit_rate * 100:.1f}%'", timeout=10_000)
            assert _number(page.get_by_test_id("cluster-hit-rate").inner_text()) > 0
            decode = final["pools"]["decode"][0]
            assert _number(page.get_by_test_id("transfer-count").inner_text()) == decode["transfers"] > 0
            decode_row = page.locator(f'[data-testid="replica-{decode_ids[0]}"]')
            assert decode_row.locator('[data-testid="requests"]').inner_text() == str(decode["requests"])
            # two polls since the traffic: each percentile is a line of at least two points
            page.wait_for_function(
                "['chart-ttft', 'chart-itl'].every(id => Number(document.getElementById(id).dataset.points) >= 6)",
                timeout=10_000)
            assert page.locator('[data-testid="chart-ttft"] path').count() == 3  # p50, p90, p99
            assert errors == []

            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"dashboard screenshot: {shot}")
        finally:
            browser.close()
