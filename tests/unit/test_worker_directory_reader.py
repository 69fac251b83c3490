"""A status reader keeps its handle to the worker directory through a slow answer and drops it
only when the directory's actor is dead. The directory is a named actor that lives as long as
its creator's handle: a creator that dropped its handle on a timeout killed it (a benchmark run's
autoscaler read no replica for 60 s while 23 directories were made and killed in turn)."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions

from deploy.ops import cluster_status
from deploy.ops.cluster_status import PoolReader
from deploy.pools import directory as worker_directory


class _Method:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.calls = 0

    def remote(self, deployment: str):
        self.calls += 1
        return self.answer(deployment)


class _Directory:
    """Stands in for the actor handle: ``lookup.remote`` gives an awaitable, as Ray's does."""

    def __init__(self, answer) -> None:
        self.lookup = _Method(answer)


class _Control:
    async def stats(self, address, timeout_s):
        return {"worker_id": address, "kv_usage": 0.5}


def _reader(monkeypatch, directory) -> PoolReader:
    monkeypatch.setattr(cluster_status, "replica_ids", lambda app, deployment: ["r1"])
    monkeypatch.setattr(worker_directory, "CALL_TIMEOUT_S", 0.05)
    return PoolReader("app", directory, _Control())


def test_a_slow_directory_is_kept(monkeypatch):
    async def slow(deployment):
        await asyncio.sleep(10)

    directory = _Directory(slow)
    reader = _reader(monkeypatch, directory)
    rows = asyncio.run(reader.read("decode"))
    assert rows == [{"worker_id": "r1", "healthy": False, "error": "the worker directory is not readable"}]
    assert reader.directory is directory  # kept: dropping the creator's handle would kill it


def test_a_dead_directory_is_dropped_and_made_again(monkeypatch):
    async def dead(deployment):
        raise ray.exceptions.ActorDiedError()

    async def live(deployment):
        return {"r1": "addr-1"}

    reader = _reader(monkeypatch, _Directory(dead))
    asyncio.run(reader.read("decode"))
    assert reader.directory is None
    remade = _Directory(live)
    monkeypatch.setattr(worker_directory, "get_or_create", lambda app: remade)
    rows = asyncio.run(reader.read("decode"))
    assert reader.directory is remade
    assert rows == [{"healthy": True, "worker_id": "addr-1", "kv_usage": 0.5}]


def test_lookup_raises_only_for_a_dead_actor(monkeypatch):
    monkeypatch.setattr(worker_directory, "CALL_TIMEOUT_S", 0.05)

    async def broken(deployment):
        raise RuntimeError("connection reset")

    assert asyncio.run(worker_directory.lookup(_Directory(broken), "decode")) is None
    assert asyncio.run(worker_directory.lookup(None, "decode")) is None

    async def dead(deployment):
        raise ray.exceptions.ActorDiedError()

    with pytest.raises(worker_directory.DirectoryGone):
        asyncio.run(worker_directory.lookup(_Directory(dead), "decode"))
