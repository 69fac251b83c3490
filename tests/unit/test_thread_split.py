"""`pdserve up`'s default engine threads: the machine's cores split among the engine replicas."""

from __future__ import annotations

import argparse
import os

from deploy.ops.cli import _threads_per_replica


def _args(**kw) -> argparse.Namespace:
    base = dict(
        threads_per_replica=None,
        ray_address=None,
        gpus_per_replica=0.0,
        mode="disaggregated",
        prefill=1,
        decode=1,
        colocated=1,
    )
    return argparse.Namespace(**{**base, **kw})


def test_local_cpu_cluster_splits_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert _threads_per_replica(_args()) == 4
    assert _threads_per_replica(_args(prefill=2, decode=1)) == 2
    assert _threads_per_replica(_args(mode="colocated")) == 8
    assert _threads_per_replica(_args(mode="colocated", colocated=16)) == 1  # at least one each


def test_explicit_threads_and_remote_or_gpu_clusters_are_left_alone():
    assert _threads_per_replica(_args(threads_per_replica=3)) == 3
    assert _threads_per_replica(_args(ray_address="10.0.0.1:6379")) is None  # replicas' own num_cpus
    assert _threads_per_replica(_args(gpus_per_replica=1.0)) is None
