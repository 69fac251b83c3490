"""A Serve replica spanning two tensor-parallel ranks, through the real system: Ray Serve reserves
a placement group of two bundles, the replica (rank 0) starts rank 1 as a Ray actor in the second
and the tiny llama is split over them. Greedy completions over HTTP equal transformers'; the rank
actors live while the replica serves, a killed rank fails the replica's health check (Serve
replaces it; requests meanwhile get an OpenAI-style error, never a hang), and deleting the
application leaves no rank actor."""

from __future__ import annotations

import httpx
import pytest
import ray
from ray import serve

from tests.integration.conftest import deploy, wait_for
from tests.unit.engine_helpers import hf_greedy, random_prompts
from workers.engine.tensor_parallel import RANK_ACTOR_PREFIX

pytestmark = pytest.mark.timeout(600)
MODEL = "llama"
APP = "tp"


def rank_actors() -> list[tuple[str, str]]:
    """(name, namespace) of every live tensor-parallel rank actor."""
    return [
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(RANK_ACTOR_PREFIX)
    ]


def complete(base: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def expected_text(model_dir: str, prompt: list[int], n: int) -> str:
    from transformers import AutoTokenizer

    ids = hf_greedy(model_dir, tuple(prompt), n)
    return AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def tp_app(serve_cluster, tiny_llama):
    args = {
        "model": tiny_llama,
        "served_model_name": MODEL,
        "mode": "colocated",
        "redis_url": serve_cluster.redis.url,
        "num_kv_blocks": 128,
        "device": "cpu",
        "colocated": {"replicas": 1, "num_cpus": 0.5, "tensor_parallel_size": 2},
    }
    base = deploy(serve_cluster, APP, "/tp", args)
    yield base
    serve.delete(APP)  # idempotent: the last test deleted it already


def test_greedy_completions_equal_transformers_over_two_ranks(tp_app, tiny_llama):
    assert len(rank_actors()) == 1  # rank 1 of the one replica
    for prompt in random_prompts((7, 45), seed=13):
        out = complete(tp_app, prompt, 16)
        assert out.status_code == 200, out.text
        body = out.json()
        assert body["choices"][0]["text"] == expected_text(tiny_llama, prompt, 16)
        assert body["usage"]["completion_tokens"] == len(hf_greedy(tiny_llama, tuple(prompt), 16))


def test_a_killed_rank_fails_the_replica_and_serve_replaces_it(tp_app, tiny_llama):
    [(name, namespace)] = rank_actors()
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    prompt = random_prompts((9,), seed=14)[0]
    expected = expected_text(tiny_llama, prompt, 8)
    # At once: the dead rank is found before the step (a clear error) or the replica was already
    # replaced (the answer). Either way bounded, and never a bare 500.
    out = complete(tp_app, prompt, 8)
    if out.status_code == 200:
        assert out.json()["choices"][0]["text"] == expected
    else:
        assert out.status_code >= 500 and out.json()["error"]["message"], out.text
    # The health check fails (TensorParallelError), Serve starts a new replica with a new rank 1.
    wait_for(lambda: [n for n, _ in rank_actors() if n != name] != [], 180, "a replacement replica's rank actor")
    wait_for(lambda: complete(tp_app, prompt, 8).status_code == 200, 120, "the replaced replica answering")
    out = complete(tp_app, prompt, 8)
    assert out.json()["choices"][0]["text"] == expected
    assert [n for n, _ in rank_actors()] != [name]


def test_deleting_the_app_stops_its_rank_actors(tp_app):
    assert rank_actors()
    serve.delete(APP)  # waits for the replica's shutdown: its engine closes and kills rank 1
    wait_for(lambda: not rank_actors(), 30, "every rank actor gone after the application was deleted")
