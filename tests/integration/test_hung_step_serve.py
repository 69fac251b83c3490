"""A decode step that never returns (standing in for a hung CUDA kernel or NCCL collective),
through the real system (1 prefill + 2 decode replicas, tiny llama): the replica's health check
reports the step once it has run ``step_timeout_s``, Serve replaces the replica, and the stream
that was on it resumes on the other decode replica; the client gets the undisturbed answer.

The hang is fault_injection ``step_hang_s``: the first decode replica to run a step hangs for
that long, once per application (deploy/pools/servers.py, ``_claim_step_hang``); the replica
the stream moves to and Serve's replacement run normally."""

from __future__ import annotations

import time

import pytest
import ray
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get

from deploy.pools.directory import NAMESPACE
from deploy.pools.servers import step_hang_key
from tests.integration.conftest import deploy, wait_for, wait_idle
from tests.integration.test_faults import MODEL, app_args, expected_text, replicas, wait_replicas
from tests.integration.test_migration import status, streamed
from tests.unit.engine_helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(600)
APP = "hung"
STEP_TIMEOUT_S = 3.0
# Far longer than detection (step_timeout_s + three failed checks 5 s apart) plus the pool's
# drain (15 s): a stream that only finished because the step came back would take this long.
HANG_S = 90.0
NEW_TOKENS = 24


def replica_ids(deployment: str) -> set[str]:
    return {name.rsplit("#", 1)[1] for name in replicas(APP, deployment)}


@pytest.fixture(scope="module")
def hung_step_app(serve_cluster, tiny_llama):
    assert ray.is_initialized()
    _internal_kv_del(step_hang_key(APP), namespace=NAMESPACE)  # the hang is claimed once per app
    base = deploy(
        serve_cluster,
        APP,
        "/hung",
        app_args(
            tiny_llama,
            serve_cluster.redis.url,
            decode={"replicas": 2, "num_cpus": 0.5},
            step_timeout_s=STEP_TIMEOUT_S,
            fault_injection={"step_hang_s": HANG_S},
        ),
    )
    yield base
    from ray import serve

    try:
        wait_idle(base, timeout_s=60)
    finally:
        serve.delete(APP)
        _internal_kv_del(step_hang_key(APP), namespace=NAMESPACE)


def test_a_hung_decode_step_fails_health_and_the_stream_resumes_elsewhere(hung_step_app, tiny_llama):
    base = hung_step_app
    prompt = random_prompts((30,), seed=95)[0]
    assert len(hf_greedy(tiny_llama, tuple(prompt), NEW_TOKENS)) > 2  # decode steps run: one can hang
    decode_before = replica_ids("decode")
    assert len(decode_before) == 2
    migrations = status(base)["routing"]["migrations"]
    payload = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    text, events, usage = streamed(base, payload)
    took = time.monotonic() - started

    hung = _internal_kv_get(step_hang_key(APP), namespace=NAMESPACE)
    assert hung is not None, "no decode replica claimed the step hang"
    hung_id = hung.decode()
    assert hung_id in decode_before
    # The stream went on on the other replica long before the hung step could have returned.
    assert took < HANG_S - 20, f"the stream took {took:.0f}s: the hung replica was not replaced"
    assert text == expected_text(tiny_llama, prompt, NEW_TOKENS)
    assert len({e["id"] for e in events}) == 1  # one response throughout
    assert usage is not None and usage["prompt_tokens"] == len(prompt)
    assert status(base)["routing"]["migrations"] == migrations + 1

    # Serve stopped the unhealthy replica (nobody killed it) and started one in its place.
    wait_for(lambda: hung_id not in replica_ids("decode"), 60, "the hung replica was not stopped")
    wait_replicas(APP, "decode", 2, base)
    decode_after = replica_ids("decode")
    assert hung_id not in decode_after
    assert decode_before - {hung_id} <= decode_after  # the other one is untouched
    assert len(decode_after - decode_before) == 1
    wait_idle(base)
