"""The worker directory's entries in the GCS's KV store, with a stand-in for the GCS client (the
real one is exercised by every integration test that reads the cluster status, and by
``test_worker_directory_gcs.py``): what a replica writes and deletes, what a status reader
makes of them, and which entries it removes."""

from __future__ import annotations

import asyncio
import time

import pytest

from deploy.ops import cluster_status
from deploy.ops.cluster_status import PoolReader
from deploy.pools import directory
from workers.protocol import TransferAddress


class _FakeGcs:
    """The four async KV calls the directory makes, on a dict; ``fail`` makes each raise."""

    def __init__(self) -> None:
        self.kv: dict[tuple[bytes, bytes], bytes] = {}
        self.fail: Exception | None = None
        self.calls: list[str] = []

    def _check(self, name: str) -> None:
        self.calls.append(name)
        if self.fail is not None:
            raise self.fail

    async def async_internal_kv_put(self, key, value, overwrite, namespace, timeout=None):
        self._check("put")
        self.kv[(namespace, key)] = value
        return 1

    async def async_internal_kv_del(self, key, del_by_prefix, namespace, timeout=None):
        self._check("del")
        return 1 if self.kv.pop((namespace, key), None) is not None else 0

    async def async_internal_kv_keys(self, prefix, namespace, timeout=None):
        self._check("keys")
        return [k for (ns, k) in self.kv if ns == namespace and k.startswith(prefix)]

    async def async_internal_kv_multi_get(self, keys, namespace, timeout=None):
        self._check("multi_get")
        return {k: self.kv[(namespace, k)] for k in keys if (namespace, k) in self.kv}


@pytest.fixture
def gcs(monkeypatch) -> _FakeGcs:
    fake = _FakeGcs()
    monkeypatch.setattr(directory, "_gcs", lambda: fake)
    return fake


class _Control:
    async def stats(self, address, timeout_s):
        return {"worker_id": address.worker_id, "kv_usage": 0.5}


def _address(worker_id: str, port: int = 5000) -> TransferAddress:
    return TransferAddress("10.0.0.1", port, worker_id, node_id="n1", control_port=port + 1, generation=7)


def _put(gcs: _FakeGcs, deployment: str, address: TransferAddress, written_at: float) -> None:
    gcs.kv[(directory.NAMESPACE, directory.entry_key("app", deployment, address.worker_id))] = directory.encode(
        address, written_at
    )


def test_an_entry_reads_back_as_written_and_a_foreign_value_is_skipped():
    address = _address("r1")
    assert directory.decode(directory.encode(address, 123.5)) == directory.Entry(address, 123.5)
    assert directory.decode(b"not json") is None
    assert directory.decode(b'{"address": {"host": "h"}, "written_at": 1}') is None  # fields missing


def test_keys_of_one_deployment_do_not_match_another_whose_name_extends_it(gcs):
    _put(gcs, "decode", _address("r1"), time.time())
    _put(gcs, "decode2", _address("r2"), time.time())
    _put(gcs, "prefill", _address("r3"), time.time())
    found = asyncio.run(directory.lookup("app", "decode"))
    assert found == {"r1": _address("r1")}
    assert asyncio.run(directory.lookup("other-app", "decode")) == {}


def test_the_reader_joins_serves_list_with_the_entries_and_deletes_only_stale_orphans(gcs, monkeypatch):
    now = time.time()
    _put(gcs, "decode", _address("r1"), now - 1000)  # live (Serve lists it): kept however old
    _put(gcs, "decode", _address("dead-old"), now - directory.STALE_S - 5)  # orphan, stale: deleted
    _put(gcs, "decode", _address("dead-new"), now - 1)  # orphan, fresh: kept for now
    monkeypatch.setattr(cluster_status, "replica_ids", lambda app, deployment: ["r1", "r2"])
    rows = asyncio.run(PoolReader("app", _Control()).read("decode"))
    assert rows == [
        {"healthy": True, "worker_id": "r1", "kv_usage": 0.5},
        {
            "worker_id": "r2",
            "healthy": False,
            "error": "not registered in the worker directory yet (starting)",
            "starting": True,
        },
    ]
    left = asyncio.run(directory.entries("app", "decode"))
    assert left is not None and sorted(left) == ["dead-new", "r1"]


def test_a_gcs_that_does_not_answer_reads_as_not_readable_not_as_no_replicas(gcs, monkeypatch):
    _put(gcs, "decode", _address("r1"), time.time())
    gcs.fail = TimeoutError("GCS deadline")
    assert asyncio.run(directory.entries("app", "decode")) is None
    monkeypatch.setattr(cluster_status, "replica_ids", lambda app, deployment: ["r1"])
    reader = PoolReader("app", _Control())
    rows = asyncio.run(reader.read("decode"))
    assert rows == [{"worker_id": "r1", "healthy": False, "error": "the worker directory is not readable"}]
    assert asyncio.run(reader.addresses("decode")) == {}
    gcs.fail = None
    assert asyncio.run(reader.addresses("decode")) == {"r1": _address("r1")}


def test_a_registration_retries_until_the_gcs_takes_it_then_refreshes_and_deletes_at_stop(gcs, monkeypatch):
    monkeypatch.setattr(directory, "FIRST_REGISTRATION_RETRY_S", 0.01)
    monkeypatch.setattr(directory, "REFRESH_S", 0.05)
    address = _address("r1")

    async def scenario() -> tuple[int, int, dict | None, dict | None]:
        gcs.fail = ConnectionError("GCS restarting")
        registration = directory.Registration("app", "decode", address)
        registration.start()
        for _ in range(500):  # until three tries failed (a count, not a time: CI may be loaded)
            if gcs.calls.count("put") >= 3:
                break
            await asyncio.sleep(0.01)
        failed_writes = gcs.calls.count("put")
        assert registration.written == 0 and failed_writes >= 3  # retried quickly, none landed
        gcs.fail = None
        for _ in range(200):
            if registration.written >= 2:  # the first write and a refresh
                break
            await asyncio.sleep(0.01)
        while_up = await directory.lookup("app", "decode")
        await registration.stop()
        return failed_writes, registration.written, while_up, await directory.lookup("app", "decode")

    failed, written, while_up, after_stop = asyncio.run(scenario())
    assert written >= 2
    assert while_up == {"r1": address}
    assert after_stop == {}
    last_put = max(i for i, call in enumerate(gcs.calls) if call == "put")
    assert last_put < gcs.calls.index("del")  # the refresh task ended before the delete


def test_outside_ray_the_directory_says_why():
    from ray.experimental import internal_kv

    if internal_kv.internal_kv_get_gcs_client() is not None:
        pytest.skip("this process is connected to Ray")
    with pytest.raises(RuntimeError, match="not connected to Ray"):
        directory._gcs()
    assert asyncio.run(directory.entries("app", "decode")) is None
