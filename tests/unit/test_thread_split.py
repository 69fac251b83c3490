"""`pdserve up`'s default engine threads: the machine's cores, less one for the serving path from
3 cores on, split among the engine replicas."""

from __future__ import annotations

import argparse
import os

from deploy.ops.cli import _prefill_threads_per_replica, _threads_per_replica


def _args(**kw) -> argparse.Namespace:
    base = dict(
        threads_per_replica=None,
        prefill_threads=None,
        ray_address=None,
        gpus_per_replica=0.0,
        mode="disaggregated",
        prefill=1,
        decode=1,
        colocated=1,
        tp=1,
        autoscaling=None,
        max_replicas=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_local_cpu_cluster_splits_the_cores_but_one(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert _threads_per_replica(_args()) == 3  # 7 engine cores over 2 replicas
    assert _threads_per_replica(_args(prefill=2, decode=1)) == 2
    assert _threads_per_replica(_args(mode="colocated")) == 7
    assert _threads_per_replica(_args(mode="colocated", colocated=16)) == 1  # at least one each


def test_two_cores_or_fewer_keep_none_back(monkeypatch):
    # on 2 cores a kept core is half the machine: the engine decodes on both (BENCHMARKS.md)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert _threads_per_replica(_args(mode="colocated")) == 2  # this VM: the engine on both cores
    assert _threads_per_replica(_args()) == 1  # prefill and decode: one core each
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert _threads_per_replica(_args(mode="colocated")) == 1  # one core: nothing to keep back
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert _threads_per_replica(_args(mode="colocated")) == 2  # from 3 cores: one kept


def test_explicit_threads_and_remote_or_gpu_clusters_are_left_alone():
    assert _threads_per_replica(_args(threads_per_replica=3)) == 3
    assert _threads_per_replica(_args(ray_address="10.0.0.1:6379")) is None  # replicas' own num_cpus
    assert _threads_per_replica(_args(gpus_per_replica=1.0)) is None


def test_tensor_parallel_ranks_count_as_engines(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert _threads_per_replica(_args(mode="colocated", tp=2)) == 3  # per rank, 7 engine cores
    assert _threads_per_replica(_args(mode="colocated", colocated=2, tp=2)) == 1
    assert _threads_per_replica(_args(mode="colocated", colocated=3, tp=4)) == 1  # at least one each


def test_up_tp_sets_every_pool_and_prefill_and_decode_may_differ(tiny_llama):
    import pytest

    from deploy.ops.cli import build_parser, up_app_args

    def app_args(*flags: str):
        args = build_parser().parse_args(["up", "--model", tiny_llama, "--threads-per-replica", "1", *flags])
        return up_app_args(args, tiny_llama, None)

    assert app_args("--mode", "colocated", "--tp", "2").colocated.tensor_parallel_size == 2
    assert app_args().colocated.tensor_parallel_size == 1
    both = app_args("--tp", "2")
    assert (both.prefill.tensor_parallel_size, both.decode.tensor_parallel_size) == (2, 2)
    mixed = app_args("--prefill-tp", "2", "--decode-tp", "1")
    assert (mixed.prefill.tensor_parallel_size, mixed.decode.tensor_parallel_size) == (2, 1)
    only_decode = app_args("--decode-tp", "2")
    assert (only_decode.prefill.tensor_parallel_size, only_decode.decode.tensor_parallel_size) == (1, 2)
    with pytest.raises(ValueError, match="use --tp in colocated mode"):
        app_args("--mode", "colocated", "--prefill-tp", "2")


def test_prefill_and_decode_ranks_split_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    # 1 prefill replica x 2 ranks + 1 decode replica x 1 rank = 3 ranks on 7 engine cores
    assert _threads_per_replica(_args(prefill=1, decode=1, tp=1, prefill_tp=2, decode_tp=None)) == 2
    assert _threads_per_replica(_args(prefill=1, decode=2, tp=2)) == 1  # 2 + 4 ranks


def test_steps_that_compute_prompts_take_the_serving_core_too(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert _prefill_threads_per_replica(_args(mode="colocated")) is None  # no core kept: every step on 2
    assert _prefill_threads_per_replica(_args()) is None  # 1 + 1 engines: one core each either way
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert _prefill_threads_per_replica(_args(mode="colocated")) == 3  # decode 2, prompts 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert _prefill_threads_per_replica(_args()) == 4  # 8 cores over 2 replicas; decode steps 3
    assert _prefill_threads_per_replica(_args(mode="colocated", colocated=3)) is None  # 8 // 3 == 7 // 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert _prefill_threads_per_replica(_args(mode="colocated")) is None


def test_prefill_threads_as_given_or_left_to_the_pool():
    assert _prefill_threads_per_replica(_args(prefill_threads=3)) == 3
    assert _prefill_threads_per_replica(_args(threads_per_replica=2)) is None  # every step on those 2
    assert _prefill_threads_per_replica(_args(ray_address="10.0.0.1:6379")) is None
    assert _prefill_threads_per_replica(_args(gpus_per_replica=1.0)) is None


def test_small_batch_threads_only_as_given(tiny_llama, monkeypatch):
    """No default: fewer threads for small decode steps helped on one 2-core VM and hurt on another
    (docs/decisions/0011-small-batch-threads-off-by-default.md)."""
    from deploy.ops.cli import build_parser, up_app_args

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)

    def colocated(*flags: str):
        args = build_parser().parse_args(["up", "--model", tiny_llama, "--mode", "colocated", *flags])
        return up_app_args(args, tiny_llama, None).colocated

    default = colocated()
    assert (default.num_threads, default.small_batch_threads, default.small_batch_max_seqs) == (2, None, 4)
    given = colocated("--small-batch-threads", "1", "--small-batch-max-seqs", "2")
    assert (given.num_threads, given.small_batch_threads, given.small_batch_max_seqs) == (2, 1, 2)
