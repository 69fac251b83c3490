"""The product through its front door: real Ray Serve, a real redis-server, real HTTP through
the ingress with the `openai` client. One disaggregated app (2 prefill + 1 decode replicas) and
one colocated app, both on the tiny llama."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from ray import serve

from tests.integration.conftest import deploy, wait_idle
from tests.unit.engine_helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(600)
MODEL = "llama"
API_KEY = "test-key"  # the colocated app requires it; the disaggregated app has no keys


def app_args(model_dir: str, redis_url: str, **overrides) -> dict:
    args = {
        "model": model_dir,
        "served_model_name": MODEL,
        "redis_url": redis_url,
        "num_kv_blocks": 256,
        "device": "cpu",
        "transfer_timeout_s": 10.0,
        "lease_ttl_s": 10.0,
        "prefill": {"replicas": 2, "num_cpus": 0.5},
        "decode": {"replicas": 1, "num_cpus": 0.5},
        "colocated": {"replicas": 1, "num_cpus": 0.5},
    }
    return {**args, **overrides}


@pytest.fixture(scope="module")
def apps(serve_cluster, tiny_llama):
    redis_url = serve_cluster.redis.url
    disagg = deploy(serve_cluster, "pd", "/", app_args(tiny_llama, redis_url))
    colo = deploy(
        serve_cluster,
        "colo",
        "/colo",
        app_args(tiny_llama, redis_url, mode="colocated", api_keys=[API_KEY], max_request_bytes=4096),
    )
    yield {"pd": disagg, "colo": colo}
    for base in (disagg, colo):
        # every replica's blocks back to free once traffic stops
        wait_idle(base, headers={"Authorization": f"Bearer {API_KEY}"})
    for name in ("pd", "colo"):  # the session's cluster has CPUs for the next modules' apps
        serve.delete(name)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models_and_health(apps):
    models = client(apps["pd"]).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{apps['pd']}/health").json() == {"status": "ok"}


def test_completions_match_transformers_and_colocated(apps, tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts((5, 37, 150), seed=51)
    for prompt in prompts:
        expected_ids = hf_greedy(tiny_llama, tuple(prompt), 24)
        expected = tok.decode(expected_ids, skip_special_tokens=True)
        for base in (apps["pd"], apps["colo"]):
            out = client(base).completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
            assert out.choices[0].text == expected
            assert out.usage.completion_tokens == len(expected_ids)
            assert out.usage.prompt_tokens == len(prompt)


def test_streamed_equals_unstreamed_with_usage_chunk(apps):
    c = client(apps["pd"])
    whole = c.completions.create(model=MODEL, prompt="The river runs", max_tokens=20, temperature=0)
    stream = c.completions.create(
        model=MODEL,
        prompt="The river runs",
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text
    assert usage.completion_tokens == whole.usage.completion_tokens == 20
    assert finish == "length"


def test_chat_streamed_and_not_agree_across_modes(apps):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    texts = []
    for base in (apps["pd"], apps["colo"]):
        c = client(base)
        whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        assert whole.choices[0].message.role == "assistant"
        streamed = "".join(
            (ch.choices[0].delta.content or "")
            for ch in c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
            )
            if ch.choices
        )
        assert streamed == whole.choices[0].message.content
        texts.append(streamed)
    assert texts[0] == texts[1]


def test_n_choices_seeded_sampling_and_stop(apps):
    c = client(apps["pd"])
    out = c.completions.create(model=MODEL, prompt="Once", max_tokens=12, temperature=0.8, seed=7, n=3)
    again = c.completions.create(model=MODEL, prompt="Once", max_tokens=12, temperature=0.8, seed=7, n=3)
    assert [ch.text for ch in out.choices] == [ch.text for ch in again.choices]
    assert len({ch.text for ch in out.choices}) > 1
    colo = client(apps["colo"]).completions.create(
        model=MODEL, prompt="Once", max_tokens=12, temperature=0.8, seed=7, n=3
    )
    assert [ch.text for ch in colo.choices] == [ch.text for ch in out.choices]
    base = c.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=0).choices[0].text
    stop = base[5:8]
    cut = c.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == base[: base.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_shared_prefix_is_cached(apps):
    c = client(apps["pd"])
    prefix = random_prompts((160,), seed=52)[0]
    c.completions.create(model=MODEL, prompt=prefix + [11, 12], max_tokens=4, temperature=0)
    second = c.completions.create(model=MODEL, prompt=prefix + [21, 22, 23], max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 144


def test_requests_sharing_a_prefix_go_to_the_replica_holding_it(apps):
    base = apps["pd"]
    c = client(base)
    prefix = random_prompts((192,), seed=53)[0]  # 12 full blocks
    c.completions.create(model=MODEL, prompt=prefix + [5], max_tokens=2, temperature=0)
    time.sleep(0.5)  # the index publisher batches events off the hot path
    before = {r["worker_id"]: r for r in httpx.get(f"{base}/v1/cluster/status").json()["pools"]["prefill"]}
    assert len(before) == 2
    for i in range(6):
        # 40 new tokens: the decode replica holds 12 of 14 blocks, under the skip-prefill bar
        suffix = random_prompts((40,), seed=60 + i)[0]
        out = c.completions.create(model=MODEL, prompt=prefix + suffix, max_tokens=2, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens == 192
    after = {r["worker_id"]: r for r in httpx.get(f"{base}/v1/cluster/status").json()["pools"]["prefill"]}
    gained = {wid: after[wid]["requests"] - before[wid]["requests"] for wid in after}
    hits = {wid: after[wid]["cached_prompt_tokens"] - before[wid]["cached_prompt_tokens"] for wid in after}
    holder = max(gained, key=gained.get)
    assert gained[holder] == 6 and hits[holder] == 6 * 192
    assert sum(gained.values()) == 6


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": 5}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi"}, 400, "model"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": [5] * 3000}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, None),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(apps, body, status, param):
    resp = httpx.post(f"{apps['pd']}/v1/completions", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_malformed_json_and_wrong_types(apps):
    resp = httpx.post(
        f"{apps['pd']}/v1/completions", content=b"{not json", timeout=30, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    resp = httpx.post(f"{apps['pd']}/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


# Those that normal traffic moves; failure counters (transfer failures, recomputes, preemptions)
# are exported once they first count, and are checked by the reliability tests.
MOVING_METRICS = (
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
)


def scrape(url: str) -> dict[str, float]:
    """Sum of every sample per metric name (Ray prefixes names with ``ray_``)."""
    totals: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith("ray_pdserve_"):
            name = line.split("{")[0].split(" ")[0][len("ray_") :]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def test_status_and_metrics_move_with_traffic(apps, serve_cluster):
    base = apps["pd"]
    before = httpx.get(f"{base}/v1/cluster/status").json()
    c = client(base)
    prefix = random_prompts((96,), seed=70)[0]
    for i in range(3):
        suffix = random_prompts((40,), seed=71 + i)[0]
        c.completions.create(model=MODEL, prompt=prefix + suffix, max_tokens=8, temperature=0)
    after = httpx.get(f"{base}/v1/cluster/status").json()
    assert after["requests"]["finished"] == before["requests"]["finished"] + 3
    assert after["requests"]["cached_prompt_tokens"] >= before["requests"]["cached_prompt_tokens"] + 2 * 96
    decode_before = before["pools"]["decode"][0]
    decode_after = after["pools"]["decode"][0]
    assert decode_after["transfer_bytes"] > decode_before["transfer_bytes"]
    assert decode_after["transfers"] == decode_before["transfers"] + 3
    assert after["index"]["healthy"] and after["index"]["live_workers"] >= 3
    assert after["requests"]["ttft_s"]["p50"] is not None

    deadline = time.time() + 60
    totals: dict[str, float] = {}
    while time.time() < deadline:  # the metrics agent exports every few seconds
        totals = scrape(serve_cluster.metrics_url)
        if (
            all(f"{m}_count" in totals or m in totals for m in MOVING_METRICS)
            and totals.get("pdserve_kv_transfer_bytes_total", 0) > 0
        ):
            break
        time.sleep(2)
    missing = [m for m in MOVING_METRICS if f"{m}_count" not in totals and m not in totals]
    assert not missing, f"not exported: {missing}"
    assert totals["pdserve_time_to_first_token_seconds_count"] >= 3
    assert totals["pdserve_prefix_cache_hits_total"] > 0
    assert totals["pdserve_kv_transfer_bytes_total"] > 0


def test_concurrent_streams_share_one_output_channel_frame_per_step(apps, tiny_llama):
    """Four requests decoding together: their tokens reach the ingress over the output channel
    (workers/output_channel.py), several to a frame, and each is still exact."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts((11, 23, 37, 41), seed=80)
    expected = [tok.decode(hf_greedy(tiny_llama, tuple(p), 16), skip_special_tokens=True) for p in prompts]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for name in ("pd", "colo"):
        base = apps[name]
        before = httpx.get(f"{base}/v1/cluster/status", headers=auth).json()

        def text(prompt: list[int], base: str = base) -> str:
            out = client(base).completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
            return out.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(text, prompts))
        after = httpx.get(f"{base}/v1/cluster/status", headers=auth).json()
        channel, earlier = after["output_channel"], before["output_channel"]
        # decode's chunks came over the channel (disaggregated: all but prefill's first token)
        chunks = channel["chunks"] - earlier["chunks"]
        frames = channel["frames"] - earlier["frames"]
        assert chunks >= 4 * 15, (name, channel, earlier)
        assert frames < chunks, (name, channel, earlier)  # a step's chunks shared frames
        assert channel["dropped_chunks"] == earlier["dropped_chunks"]
        assert channel["listening"] == 0
        pool_name = "decode" if name == "pd" else "colocated"
        assert all(r["output_channel"]["fallbacks"] == 0 for r in after["pools"][pool_name])
        assert got == expected, name


def test_api_keys_and_body_limit(apps):
    base = apps["colo"]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
    wrong = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/cluster/status"):
        assert httpx.get(f"{base}{path}").status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{base}/v1/completions", json=body, headers=auth).status_code == 200
    big = httpx.post(f"{base}/v1/completions", json={**body, "prompt": "x" * 5000}, headers=auth)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
