"""autoscaling: pd on a real Ray Serve with a real redis-server: under a prompt-heavy load the
policy grows the prefill pool within its budget, logs the change with its signals and shows it
in the status endpoint, pdserve status and the dashboard (when Playwright and chromium are
here); idle, it shrinks the pool back; every answer is exact and afterwards no block is held."""

from __future__ import annotations

import glob
import os
import re
import threading

import httpx
import pytest

from deploy.ops.status_table import format_status
from tests.integration.conftest import deploy, wait_for, wait_idle
from tests.integration.test_faults import MODEL, app_args, expected_text
from tests.unit.engine_helpers import random_prompts

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

# Quick to react, so the test runs in a minute or two: with a TTFT target this short a busy
# prefill replica is never enough; decode stays at its minimum (two-token outputs, a loose TPOT).
PD = {
    "policy": "pd",
    "max_total_replicas": 3,
    "ttft_target_s": 0.05,
    "tpot_target_s": 5.0,
    "interval_s": 0.5,
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 3.0,
    "cooldown_s": 1.0,
}
NUM_PROMPTS = 3000  # each sent once: a repeated prompt would be a decode-side hit that skips prefill


def status(base: str) -> dict:
    return httpx.get(f"{base}/v1/cluster/status", timeout=15).json()


def targets(base: str) -> dict:
    """The autoscaler's targets ({} while a loaded machine makes its answer late)."""
    return status(base)["autoscaling"].get("targets", {})


def autoscaler_log_lines(app: str) -> list[str]:
    """The lines of this session's Serve replica log files of ``app``'s autoscaler."""
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()  # noqa: SLF001 - tests only
    lines = []
    for path in glob.glob(os.path.join(session, "logs", "serve", f"replica_{app}_autoscaler_*.log")):
        with open(path, errors="replace") as f:
            lines += f.readlines()
    return lines


def check_dashboard(base: str) -> None:
    """The dashboard's autoscaling panel: the budget, the change with its signals, the timeline."""
    try:
        from tests.integration.test_dashboard import CHROMIUM, CHROMIUM_ARGS, _chromium_or_skip

        sync_playwright = _chromium_or_skip()
    except pytest.skip.Exception:
        return  # the status endpoint and pdserve status were checked; the page needs a browser
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{base}/dashboard")
            page.wait_for_selector('[data-testid="autoscaling-decisions"] td.mono', timeout=30_000)
            summary = page.get_by_test_id("autoscaling-summary").inner_text()
            assert re.fullmatch(
                r"budget 3 replicas · prefill [12] \(1–2\) · decode 1 \(1–2\) · targets TTFT 50\.0 ms, "
                r"TPOT 5000\.0 ms",
                summary,
            ), summary  # prefill 1 again if idle long enough
            first_row = page.locator('[data-testid="autoscaling-decisions"] tr').last
            cells = first_row.locator("td").all_inner_texts()
            assert cells[1:3] == ["1 → 2", "1 → 1"] and "queued prompt tokens" in cells[3], cells
            assert int(page.get_by_test_id("chart-replicas").get_attribute("data-points")) >= 2
            assert errors == []
        finally:
            browser.close()


def test_pd_policy_grows_the_prefill_pool_under_prompt_load_and_logs_it(serve_cluster, tiny_llama):
    pd = {**PD, "dashboard_url": serve_cluster.dashboard_url}  # the replica counts are set through its REST API
    base = deploy(serve_cluster, "pdscale", "/pdscale", app_args(tiny_llama, serve_cluster.redis.url, autoscaling=pd))
    first = status(base)["autoscaling"]
    assert first["targets"] == {"prefill": 1, "decode": 1} and first["budget"] == 3
    assert first["bounds"] == {"prefill": [1, 2], "decode": [1, 2]} and first["error"] is None
    prompts = random_prompts([300 + i % 40 for i in range(NUM_PROMPTS)], seed=5)
    unsent = list(range(NUM_PROMPTS))
    stop = threading.Event()
    answers: list[tuple[int, int, str]] = []

    def client() -> None:
        while not stop.is_set() and unsent:
            i = unsent.pop()
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 2, "temperature": 0}
            resp = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
            answers.append(
                (i, resp.status_code, resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text)
            )

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: targets(base).get("prefill") == 2, 180, "the pd policy did not grow the prefill pool to 2")
        wait_for(
            lambda: sum(r.get("healthy", False) for r in status(base)["pools"]["prefill"]) == 2,
            180,
            "the second prefill replica did not come up",
        )
        # Now, under load: once the clients stop, the pool shrinks back within seconds (this
        # test's delays), possibly before the answers below are checked.
        grown = status(base)
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert answers and all(code == 200 for _, code, _ in answers), [a for a in answers if a[1] != 200][:3]
    for i, _, text in answers[::10]:  # a sample: the reference is slow beside the server
        assert text == expected_text(tiny_llama, prompts[i], 2), i
    change = grown["autoscaling"]["decisions"][0]
    assert (change["from"], change["prefill"], change["decode"]) == ({"prefill": 1, "decode": 1}, 2, 1)
    assert change["line"].startswith("prefill 1 -> 2, decode 1 -> 1 (budget 3) | prefill: ")
    assert "queued prompt tokens" in change["line"] and "TPOT" in change["line"]
    assert "autoscaling (pd): budget 3 replicas; prefill 2" in format_status(grown)
    check_dashboard(base)
    wait_for(
        lambda: any(f"autoscaling: {change['line']}" in line for line in autoscaler_log_lines("pdscale")),
        30,
        "the change was not logged in the autoscaler's replica log",
    )
    # idle: back to the minimum
    try:
        wait_for(lambda: targets(base).get("prefill") == 1, 180, "the idle prefill pool did not shrink back to 1")
    except AssertionError as exc:  # say why: the autoscaler's last round (needs, signals, what held it)
        raise AssertionError(f"{exc}; last round: {status(base)['autoscaling'].get('last')}") from None
    shrunk = status(base)["autoscaling"]["decisions"][-1]
    assert (shrunk["prefill"], shrunk["decode"]) == (1, 1)
    wait_for(lambda: len(status(base)["pools"]["prefill"]) == 1, 120, "the retired prefill replica did not stop")
    wait_idle(base)
    from ray import serve

    serve.delete("pdscale")
