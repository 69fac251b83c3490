"""Per-pool autoscaling with Serve's own autoscaling_config (PDServeArgs.decode.autoscaling_config):
under load the decode pool grows to its max, idle it shrinks back, and no request is lost or
wrong while replicas come and go; afterwards every replica's blocks are free."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.integration.conftest import deploy, wait_for, wait_idle
from tests.integration.test_faults import MODEL, app_args, expected_text
from tests.unit.engine_helpers import random_prompts

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
AUTOSCALE = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 1,
    "downscale_delay_s": 3,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
}


def decode_replicas(base: str) -> int:
    pools = httpx.get(f"{base}/v1/cluster/status", timeout=15).json()["pools"]
    return sum(1 for r in pools["decode"] if r.get("healthy"))


def test_decode_pool_grows_under_load_and_shrinks_when_idle(serve_cluster, tiny_llama):
    base = deploy(
        serve_cluster,
        "scale",
        "/scale",
        app_args(tiny_llama, serve_cluster.redis.url, decode={"num_cpus": 0.5, "autoscaling_config": AUTOSCALE}),
    )
    prompts = random_prompts((12, 25, 31, 44), seed=71)
    expected = {i: expected_text(tiny_llama, p, 200) for i, p in enumerate(prompts)}
    assert decode_replicas(base) == 1
    stop = threading.Event()
    answers: list[tuple[int, int, str]] = []

    def client(i: int) -> None:
        while not stop.is_set():
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 200, "temperature": 0}
            resp = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
            answers.append(
                (i, resp.status_code, resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text)
            )

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: decode_replicas(base) == 2, 180, "the decode pool did not grow to its max of 2")
        time.sleep(3)  # keep the load on while the new replica takes its share
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert answers and all(code == 200 and text == expected[i] for i, code, text in answers), [
        a for a in answers if a[1] != 200 or a[2] != expected[a[0]]
    ][:3]
    wait_for(lambda: decode_replicas(base) == 1, 180, "the idle decode pool did not shrink back to 1")
    wait_idle(base)
    from ray import serve

    serve.delete("scale")
