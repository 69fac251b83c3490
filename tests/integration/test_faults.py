"""Failure semantics through the real system (Ray Serve, redis-server, gloo pair groups):
replica deaths, a stalled transfer, an unclaimed lease, Redis lost and back, a client that
leaves, tenants kept apart. After each: every replica's free blocks == total blocks, and the
service still answers with the reference output."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import ray

from tests.integration.conftest import deploy, wait_idle
from tests.redis_server import RedisServer
from tests.unit.engine_helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(900)
MODEL = "llama"


def app_args(model_dir: str, redis_url: str, **overrides) -> dict:
    args = {
        "model": model_dir,
        "served_model_name": MODEL,
        "redis_url": redis_url,
        "num_kv_blocks": 256,
        "device": "cpu",
        "transfer_timeout_s": 5.0,
        "lease_ttl_s": 10.0,
        "prefill": {"replicas": 1, "num_cpus": 0.5},
        "decode": {"replicas": 1, "num_cpus": 0.5},
    }
    return {**args, **overrides}


def replicas(app: str, deployment: str) -> list[str]:
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return [n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].startswith(prefix)]


def kill(name: str) -> None:
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def expected_text(tiny_llama: str, prompt: list[int], n: int) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama).decode(
        hf_greedy(tiny_llama, tuple(prompt), n), skip_special_tokens=True
    )


def complete(base: str, prompt, max_tokens: int, timeout: float = 120, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


def wait_replicas(app: str, deployment: str, count: int, base: str, timeout_s: float = 120) -> None:
    """Until Serve has replaced killed replicas and the app answers again."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            pool = httpx.get(f"{base}/v1/cluster/status", timeout=15).json()["pools"].get(deployment, [])
        except httpx.HTTPError:
            pool = []
        if len(pool) == count and all(r.get("healthy") for r in pool):
            return
        time.sleep(1)
    raise AssertionError(f"{deployment} did not come back to {count} healthy replicas")


# ----------------------------------------------------------------- app 1: deaths
@pytest.fixture(scope="module")
def slow_prefill_app(serve_cluster, tiny_llama):
    """2 prefill replicas that each wait 2 s before prefilling: time to kill one mid-request."""
    base = deploy(
        serve_cluster,
        "faults",
        "/faults",
        app_args(
            tiny_llama,
            serve_cluster.redis.url,
            prefill={"replicas": 2, "num_cpus": 0.5},
            fault_injection={"prefill_delay_s": 2.0},
        ),
    )
    yield base
    from ray import serve

    wait_idle(base, timeout_s=60)
    serve.delete("faults")


def test_prefill_replica_death_is_retried_with_the_same_output(slow_prefill_app, tiny_llama):
    base = slow_prefill_app
    prompts = random_prompts((20, 33, 47, 61), seed=81)
    results: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        results[i] = complete(base, prompts[i], 12)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(1.0)  # all four are inside the 2 s prefill delay, spread over both replicas
    victim = replicas("faults", "prefill")[0]
    kill(victim)
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(prompts):
        assert results[i].status_code == 200, results[i].text
        assert results[i].json()["choices"][0]["text"] == expected_text(tiny_llama, prompt, 12)
    wait_replicas("faults", "prefill", 2, base)
    wait_idle(base)


def test_a_prefill_replica_serve_has_just_replaced_serves_the_next_request(slow_prefill_app, tiny_llama):
    """Decode reaches a new prefill replica at the address in its first KVHandle: no blackout
    while routers learn of it; the first request after the replacement moves its KV from it
    (through Serve handles, that send failed for a few seconds and decode recomputed)."""
    base = slow_prefill_app
    old = set(replicas("faults", "prefill"))
    for name in old:  # both: the next request can only go to a new replica
        kill(name)
    deadline = time.time() + 120
    while time.time() < deadline and not (set(replicas("faults", "prefill")) - old):
        time.sleep(0.1)
    new_ids = {n.rsplit("#", 1)[1] for n in set(replicas("faults", "prefill")) - old}
    assert new_ids, "Serve did not start a replacement prefill replica"
    prompt = random_prompts((60,), seed=87)[0]
    resp = complete(base, prompt, 12, return_timing=True)  # sent at once: waits for the new replica
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == expected_text(tiny_llama, prompt, 12)
    status = httpx.get(f"{base}/v1/cluster/status", timeout=30).json()
    # both replacements by now (the request may have gone to the second one to start)
    new_ids = {n.rsplit("#", 1)[1] for n in set(replicas("faults", "prefill")) - old}
    from_new = [p for p in status["pairs"] if p["prefill"] in new_ids]
    assert sum(p["transfers"] for p in from_new) == 1, status["pairs"]
    assert sum(p["transfer_failures"] + p["recomputed_prefills"] for p in from_new) == 0, status["pairs"]
    wait_replicas("faults", "prefill", 2, base)
    wait_idle(base)


def test_decode_replica_death_ends_the_stream_with_an_error(slow_prefill_app, tiny_llama):
    base = slow_prefill_app
    body = {
        "model": MODEL,
        "prompt": random_prompts((30,), seed=82)[0],
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:  # a hang fails here
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 5:
                kill(replicas("faults", "decode")[0])
    errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error"
    assert "[DONE]" not in events  # the stream ends at the error event
    wait_replicas("faults", "decode", 1, base)
    prompt = random_prompts((25,), seed=83)[0]
    assert complete(base, prompt, 8).json()["choices"][0]["text"] == expected_text(tiny_llama, prompt, 8)
    wait_idle(base)


def requests_status(base: str) -> dict:
    return httpx.get(f"{base}/v1/cluster/status", timeout=10).json()["requests"]


def wait_ended(base: str, before: dict, count: int, timeout_s: float = 30) -> dict:
    """The request figures once ``count`` more choices have ended (the ingress sees a
    disconnect a moment after the client closes)."""
    deadline = time.time() + timeout_s
    while True:
        now = requests_status(base)
        ended = sum(now[k] - before[k] for k in ("finished", "failed", "aborted"))
        if (ended >= count and now["active"] == 0) or time.time() > deadline:
            return now
        time.sleep(0.2)


def test_client_disconnect_aborts_and_frees_everything(slow_prefill_app):
    base = slow_prefill_app
    before = requests_status(base)
    body = {
        "model": MODEL,
        "prompt": random_prompts((40,), seed=84)[0],
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
        got = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got == 4:
                break  # leave mid-stream: the connection closes here
    # A client that leaves during the prefill (inside the 2 s delay), without streaming:
    with pytest.raises(httpx.TimeoutException):
        complete(base, random_prompts((45,), seed=87)[0], 1500, timeout=1.0, ignore_eos=True)
    after = wait_ended(base, before, 2)
    assert after["aborted"] == before["aborted"] + 2, (before, after)  # a disconnect is an abort,
    assert after["failed"] == before["failed"], (before, after)  # not a failure
    status = wait_idle(base, timeout_s=30)
    for pool in status["pools"].values():
        for replica in pool:
            assert replica["num_running"] == 0 and replica["num_waiting"] == 0 and replica["num_held"] == 0


def test_cache_salt_keeps_tenants_apart(slow_prefill_app):
    base = slow_prefill_app
    prompt = random_prompts((128,), seed=85)[0]
    complete(base, prompt + [1], 2, cache_salt="tenant-a")
    same_tenant = complete(base, prompt + [2], 2, cache_salt="tenant-a").json()
    other_tenant = complete(base, prompt + [3], 2, cache_salt="tenant-b").json()
    no_salt = complete(base, prompt + [4], 2).json()
    assert same_tenant["usage"]["prompt_tokens_details"]["cached_tokens"] >= 112
    assert other_tenant["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert no_salt["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_idle(base)


# ------------------------------------------------- app 2: stalls, leases, Redis
@pytest.fixture(scope="module")
def stall_app(serve_cluster, tiny_llama):
    """Its own redis-server (killed and restarted here); KV sends stall past the deadline."""
    redis = RedisServer()
    redis.start()
    base = deploy(
        serve_cluster,
        "stall",
        "/stall",
        app_args(tiny_llama, redis.url, transfer_timeout_s=1.0, lease_ttl_s=2.0, fault_injection={"send_stall_s": 3.0}),
    )
    yield base, redis
    from ray import serve

    wait_idle(base, timeout_s=60)
    serve.delete("stall")
    redis.stop()


def test_stalled_transfer_recomputes_and_expired_lease_frees(stall_app, tiny_llama):
    base, _ = stall_app
    before = httpx.get(f"{base}/v1/cluster/status").json()
    prompt = random_prompts((70,), seed=86)[0]
    resp = complete(base, prompt, 16)
    assert resp.json()["choices"][0]["text"] == expected_text(tiny_llama, prompt, 16)
    time.sleep(3.5)  # the stalled send then finds its lease expired
    after = wait_idle(base)
    decode_b, decode_a = before["pools"]["decode"][0], after["pools"]["decode"][0]
    prefill_a, prefill_b = after["pools"]["prefill"][0], before["pools"]["prefill"][0]
    assert decode_a["transfer_failures"] == decode_b["transfer_failures"] + 1
    assert decode_a["recomputed_prefills"] == decode_b["recomputed_prefills"] + 1
    assert prefill_a["leases_expired"] == prefill_b["leases_expired"] + 1
    assert prefill_a["num_held"] == 0


def test_redis_lost_and_back_under_traffic(stall_app, tiny_llama):
    base, redis = stall_app
    stop = threading.Event()
    outcomes: list[int] = []

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            # one block: nothing to transfer, so the stalled sends of this app stay out of the way
            outcomes.append(complete(base, [100 + i % 50] * 10, 4, timeout=60).status_code)
            i += 1

    worker = threading.Thread(target=traffic)
    worker.start()
    time.sleep(1.5)
    redis.kill()
    time.sleep(3)
    down = httpx.get(f"{base}/v1/cluster/status").json()["index"]
    assert down["healthy"] is False
    redis.restart()
    time.sleep(1)
    deadline = time.time() + 30
    while time.time() < deadline:
        index = httpx.get(f"{base}/v1/cluster/status").json()["index"]
        if index["healthy"] and index["live_workers"] == 2:
            break
        time.sleep(0.5)
    stop.set()
    worker.join(60)
    assert index["healthy"] and index["live_workers"] == 2  # both workers re-registered
    assert outcomes and all(code == 200 for code in outcomes), outcomes
    # cache-aware routing resumes: a prefix cached now is found through the index again
    from kvstore import IndexConfig, PrefixIndex
    from kvstore.hashing import hash_prompt_blocks
    from workers.engine.config import EngineConfig

    prompt = [7] * 40
    complete(base, prompt, 2)
    key = EngineConfig(model_dir=tiny_llama).resolved_model_key
    hashes = hash_prompt_blocks(prompt, 16, key)

    async def lookup():
        index = PrefixIndex(IndexConfig(redis_url=redis.url, model_key=key))
        await index.start()
        for _ in range(40):
            found = await index.longest_prefix(hashes, role="prefill")
            if found and max(found.values()) == 2:
                await index.close()
                return found
            await asyncio.sleep(0.25)
        await index.close()
        return found

    found = asyncio.run(lookup())
    assert found and max(found.values()) == 2
    wait_idle(base)


# ----------------------------------------------------------------- app 4: KV corrupted in flight
@pytest.fixture(scope="module")
def corrupt_app(serve_cluster, tiny_llama):
    """The prefill replica flips one byte of every KV message after checksumming it."""
    base = deploy(
        serve_cluster,
        "corrupt",
        "/corrupt",
        app_args(tiny_llama, serve_cluster.redis.url, fault_injection={"kv_corrupt_bytes": 1}),
    )
    yield base
    from ray import serve

    wait_idle(base, timeout_s=60)
    serve.delete("corrupt")


def test_kv_corrupted_in_flight_is_caught_counted_and_recomputed(corrupt_app, tiny_llama):
    """Every transfer arrives with one wrong byte: decode catches each by its checksum, recomputes
    the prompt, and the answers (plain and streamed) are the reference's; the status counts them
    and nothing stays held."""
    base = corrupt_app
    before = httpx.get(f"{base}/v1/cluster/status").json()["pools"]["decode"][0]
    prompts = random_prompts((40, 75), seed=88)
    assert complete(base, prompts[0], 12).json()["choices"][0]["text"] == expected_text(tiny_llama, prompts[0], 12)
    body = {"model": MODEL, "prompt": prompts[1], "max_tokens": 12, "temperature": 0, "stream": True}
    text = ""
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == expected_text(tiny_llama, prompts[1], 12)
    deadline = time.time() + 30
    while True:  # the status the ingress serves may lag a request behind: wait for the counts
        after = wait_idle(base)
        decode = after["pools"]["decode"][0]
        if decode["transfer_corrupt"] >= before["transfer_corrupt"] + 2 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert decode["transfer_corrupt"] == before["transfer_corrupt"] + 2
    assert decode["transfer_failures"] == before["transfer_failures"] + 2
    assert decode["recomputed_prefills"] == before["recomputed_prefills"] + 2
    assert after["pools"]["prefill"][0]["num_held"] == 0
