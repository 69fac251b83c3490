"""KV tiers through the product (real Serve, real Redis, real HTTP): a prompt whose KV left the
prefill replica's device pool is answered from its host tier, then from its disk tier, and after
the replica is killed and Serve starts it again, from the files the dead one wrote; every answer
is the cold one, token for token, with the prefix reported as cached."""

from __future__ import annotations

import shutil
import time

import httpx
import pytest
import ray
from ray import serve

from tests.integration.conftest import deploy, wait_for, wait_idle
from tests.unit.engine_helpers import hf_greedy, random_prompts
from workers.models.config import ModelConfig

pytestmark = pytest.mark.timeout(600)
APP, MODEL = "kv-tiers", "m"
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_llama) -> str:
    # its own model key: its tiers and index entries meet no other test's
    return str(shutil.copytree(tiny_llama, tmp_path_factory.mktemp("tiers-model") / "llama-tiers"))


@pytest.fixture(scope="module")
def app(serve_cluster, model_dir, tmp_path_factory):
    block_bytes = BLOCK * ModelConfig.from_dir(model_dir).kv_bytes_per_token(4)
    base = deploy(
        serve_cluster,
        APP,
        "/tiers",
        {
            "model": model_dir,
            "served_model_name": MODEL,
            "redis_url": serve_cluster.redis.url,
            "num_kv_blocks": 32,  # 512 tokens: two 300-token prompts push a third out
            "device": "cpu",
            "transfer_timeout_s": 10.0,
            "lease_ttl_s": 10.0,
            "prefill": {
                "replicas": 1,
                "num_cpus": 0.5,
                "host_kv_gib": 80 * block_bytes / 2**30,  # 80 blocks: four prompts' worth, not nine
                "disk_kv_gib": 400 * block_bytes / 2**30,
                "disk_kv_path": str(tmp_path_factory.mktemp("disk-kv")),
            },
            "decode": {"replicas": 1, "num_cpus": 0.5},
        },
    )
    yield base
    wait_idle(base)
    serve.delete(APP)


def complete(base: str, prompt: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    return {"text": out["choices"][0]["text"], "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"]}


def prefill_stats(base: str) -> dict:
    (replica,) = httpx.get(f"{base}/v1/cluster/status", timeout=15).json()["pools"]["prefill"]
    return replica


def expected_text(model_dir: str, prompt: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(hf_greedy(model_dir, tuple(prompt), 12))


def settle(base: str) -> None:
    """Until the prefill replica's copies down are written (its disk tier stops growing)."""
    last = -1
    for _ in range(40):
        blocks = prefill_stats(base).get("disk_blocks", 0)
        if blocks == last:
            return
        last = blocks
        time.sleep(0.5)


def test_an_evicted_prefix_comes_back_from_host_then_disk_then_after_a_restart(app, model_dir):
    prompt, *others = random_prompts((200,) + (300,) * 10, seed=91)
    cold = complete(app, prompt)
    assert cold["cached"] == 0 and cold["text"] == expected_text(model_dir, prompt)

    for other in others[:3]:  # 900 tokens through a 512-token pool: the prompt's blocks leave it
        complete(app, other)
    settle(app)
    before = prefill_stats(app)
    assert before["host_blocks"] > 0 and before["disk_blocks"] > 0
    from_host = complete(app, prompt)
    after = prefill_stats(app)
    assert from_host == {"text": cold["text"], "cached": 192}  # 12 full blocks; the last token computed
    assert after["host_hits"] - before["host_hits"] == 12 and after["disk_hits"] == before["disk_hits"]

    for other in others[3:8]:  # 1,500 more tokens: past the host tier's 80 blocks too
        complete(app, other)
    settle(app)
    before = prefill_stats(app)
    from_disk = complete(app, prompt)
    after = prefill_stats(app)
    assert from_disk == {"text": cold["text"], "cached": 192}
    assert after["disk_hits"] - before["disk_hits"] == 12

    # Killed (its process and its memory gone): Serve starts another, which takes the dead one's
    # directory, verifies its files and announces them in the index.
    prefix = f"SERVE_REPLICA::{APP}#prefill#"
    (victim,) = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].startswith(prefix)]
    old_id = before["worker_id"]
    wait_idle(app)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    def replaced() -> bool:
        try:
            pool = httpx.get(f"{app}/v1/cluster/status", timeout=15).json()["pools"].get("prefill", [])
        except httpx.HTTPError:
            return False
        return len(pool) == 1 and pool[0].get("healthy") and pool[0]["worker_id"] != old_id

    wait_for(replaced, 120, "Serve replaced the killed prefill replica")
    restarted = prefill_stats(app)
    assert restarted["disk_blocks"] >= 12 and restarted["host_blocks"] == 0
    for other in others[8:]:  # the decode replica's cache lets the prompt go too (else decode computes it)
        complete(app, other)
    again = complete(app, prompt)
    assert again == {"text": cold["text"], "cached": 192}
    assert prefill_stats(app)["disk_hits"] == 12
