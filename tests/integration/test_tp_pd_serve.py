"""Disaggregated serving with tensor-parallel pools of different sizes, through the real system:
Ray Serve reserves each replica's placement group (one bundle per rank), each replica starts its
worker ranks as Ray actors, and KV moves from the prefill ranks to the decode ranks that hold
the same heads, one gloo pair group per rank pair. Greedy completions through the ingress (the
openai client) equal transformers'; each decode rank received exactly its heads' share of every
block that moved; every replica ends with every block free."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import ray
from ray import serve
from transformers import AutoTokenizer

from tests.integration.conftest import deploy, wait_for, wait_idle
from tests.integration.test_tp_serve import rank_actors
from tests.unit.engine_helpers import hf_greedy, random_prompts
from workers.transfer.tp_plan import heads_of_rank

pytestmark = pytest.mark.timeout(600)
BLOCK = 16
KV_HEADS = 2  # the tiny llama's: tp 2 gives each rank one head


@pytest.fixture(scope="module", params=[(1, 2), (2, 1), (2, 2)], ids=["p1-d2", "p2-d1", "p2-d2"])
def app(request, serve_cluster, tiny_llama):
    prefill_tp, decode_tp = request.param
    name = f"tp-pd-{prefill_tp}-{decode_tp}"
    args = {
        "model": tiny_llama,
        "served_model_name": "m",
        "mode": "disaggregated",
        "redis_url": serve_cluster.redis.url,
        "num_kv_blocks": 96,
        "block_size": BLOCK,
        "device": "cpu",
        "transfer_timeout_s": 30.0,
        "prefill": {"replicas": 1, "num_cpus": 0.5, "tensor_parallel_size": prefill_tp},
        "decode": {"replicas": 1, "num_cpus": 0.5, "tensor_parallel_size": decode_tp},
    }
    base = deploy(serve_cluster, name, f"/{name}", args)
    yield base, prefill_tp, decode_tp
    serve.delete(name)


def test_greedy_output_equals_transformers_and_each_decode_rank_gets_its_heads(app, tiny_llama):
    base, prefill_tp, decode_tp = app
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    prompts = random_prompts((6, 33, 90, 17), seed=prefill_tp * 10 + decode_tp)
    for i, prompt in enumerate(prompts):
        want = tokenizer.decode(hf_greedy(tiny_llama, tuple(prompt), 12), skip_special_tokens=True)
        body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
        if i % 2:  # streamed and not: the same path behind the ingress
            text = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
        else:
            out = client.completions.create(**body)
            assert out.usage.completion_tokens == 12
            text = out.choices[0].text
        assert text == want

    status = wait_idle(base)  # every replica: free == total blocks
    (decode,) = status["pools"]["decode"]
    (prefill,) = status["pools"]["prefill"]
    # Every block of every prompt moved (they share none); each rank's bytes are its KV heads'
    # share of them, exactly.
    moved = sum(-(-len(p) // BLOCK) for p in prompts)
    moved_bytes = decode["transfer_bytes"]
    assert decode["transfers"] == len(prompts) and decode["recomputed_prefills"] == 0
    per_head = moved_bytes // (moved * KV_HEADS)
    assert per_head > 0 and per_head * moved * KV_HEADS == moved_bytes
    assert decode["transfer_rank_bytes"] == [
        moved * per_head * len(heads_of_rank(KV_HEADS, decode_tp, j)) for j in range(decode_tp)
    ]
    assert prefill["transfer_rank_bytes"] == [
        moved * per_head * len(heads_of_rank(KV_HEADS, prefill_tp, i)) for i in range(prefill_tp)
    ]
    assert prefill["transfer_bytes"] == moved_bytes


def test_a_rank_killed_mid_request_completes_or_errors_and_serve_replaces_its_replica(app, tiny_llama):
    """The mixed configurations kill the rank actor of their tensor-parallel pool (prefill ranks
    in p2-d1, decode ranks in p1-d2) while a stream is running; p2-d2 has both kinds, which the
    other two cover."""
    base, prefill_tp, decode_tp = app
    if prefill_tp == decode_tp:
        pytest.skip("p2-d2: a prefill and a decode rank kill are each covered by p2-d1 and p1-d2")
    [(name, namespace)] = rank_actors()  # the one tensor-parallel replica's rank 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = random_prompts((40,), seed=90)[0]
    want = tokenizer.decode(hf_greedy(tiny_llama, tuple(prompt), 160), skip_special_tokens=True)
    body = {"model": "m", "prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True, "stream": True}
    text, error = "", None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        killed = False
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                error = event["error"]
                break
            text += event["choices"][0]["text"]
            if not killed:
                ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
                killed = True
    # Prefill rank killed: the decode replica holds the KV already and finishes the stream.
    # Decode rank killed: its stream ends with an OpenAI-style error event, never a hang.
    outcome = f"an error event: {error['message']}" if error else "the stream completed"
    print(f"\np{prefill_tp}-d{decode_tp}, rank 1 killed mid-stream: {outcome}")
    if error is None:
        assert text == want
    else:
        assert decode_tp == 2 and error["message"], error

    # The dead rank fails its replica's health check; Serve starts a new one with a new rank 1.
    wait_for(lambda: [n for n, _ in rank_actors() if n != name] != [], 180, "a replacement replica's rank actor")
    short = random_prompts((21,), seed=91)[0]
    want = tokenizer.decode(hf_greedy(tiny_llama, tuple(short), 8), skip_special_tokens=True)
    one = {"model": "m", "prompt": short, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def answered() -> bool:
        return httpx.post(f"{base}/v1/completions", json=one, timeout=60).status_code == 200

    wait_for(answered, 120, "the replaced replica answering")
    out = httpx.post(f"{base}/v1/completions", json=one, timeout=60).json()
    assert out["choices"][0]["text"] == want
    wait_idle(base)  # the surviving replicas and the new one: every block free
