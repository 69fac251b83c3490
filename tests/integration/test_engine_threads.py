"""A replica's engine runs torch with the threads its pool grants, not Ray's OMP_NUM_THREADS=1
(the session's Ray sets OMP_NUM_THREADS=1 for every worker, as Ray does for num_cpus <= 1)."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import deploy

pytestmark = pytest.mark.timeout(300)


def test_actor_threads_follow_the_pool_not_ray(serve_cluster):
    import ray

    @ray.remote
    class Replica:  # a fresh process per actor, like a Serve replica
        def threads(self, pool: dict) -> tuple[int, int, str | None]:
            import os

            import torch

            from deploy.args import PoolArgs
            from deploy.pools.servers import set_engine_threads

            before = torch.get_num_threads()
            return before, set_engine_threads(PoolArgs(**pool)), os.environ.get("OMP_NUM_THREADS")

    cases = [
        ({"num_cpus": 0.5}, 1),
        ({"num_cpus": 2}, 2),
        ({"num_cpus": 3.5}, 3),
        ({"num_cpus": 0.5, "num_threads": 2}, 2),
    ]
    for pool, expected in cases:
        actor = Replica.options(num_cpus=pool["num_cpus"]).remote()
        before, after, omp = ray.get(actor.threads.remote(pool))
        ray.kill(actor)
        assert omp == "1" and before == 1, (pool, before, omp)  # what Ray alone would give
        assert after == expected, pool


def test_replica_reports_the_threads_it_was_granted(serve_cluster, tiny_llama):
    args = {
        "model": tiny_llama,
        "served_model_name": "llama",
        "num_kv_blocks": 64,
        "device": "cpu",
        "mode": "colocated",
        "colocated": {
            "replicas": 1,
            "num_cpus": 0.5,
            "num_threads": 2,
            "prefill_threads": 3,
            "small_batch_threads": 1,
            "small_batch_max_seqs": 2,
        },
        "attention_backend": "auto",  # the paged kernel compiles on the start-up thread, runs on the loop's
    }
    base = deploy(serve_cluster, "threads", "/threads", args)
    body = {"model": "llama", "prompt": "threads", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    completion = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4
    status = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()
    (replica,) = status["pools"]["colocated"]
    assert replica["torch_threads"] == 2
    assert replica["prefill_threads"] == 3
    assert (replica["small_batch_threads"], replica["small_batch_max_seqs"]) == (1, 2)
    from ray import serve

    serve.delete("threads")
