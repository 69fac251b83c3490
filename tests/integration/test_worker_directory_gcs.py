"""The worker directory on a real GCS: an entry a replica-side registration writes in one process
is read in another (a Ray task), refreshed, and gone after the registration stops."""

from __future__ import annotations

import asyncio

import pytest

from deploy.pools import directory
from workers.protocol import TransferAddress

pytestmark = pytest.mark.timeout(300)


def test_an_entry_written_here_is_read_by_another_process_and_deleted_at_stop(serve_cluster, monkeypatch):
    import ray

    monkeypatch.setattr(directory, "REFRESH_S", 0.2)
    address = TransferAddress("10.0.0.9", 6001, "w-gcs", node_id="n9", control_port=6002, generation=3)

    @ray.remote(num_cpus=0)
    def read_elsewhere(app: str, deployment: str):
        from deploy.pools import directory as other_process_directory

        return asyncio.run(other_process_directory.entries(app, deployment))

    async def register() -> directory.Registration:
        registration = directory.Registration("gcs-test-app", "decode", address)
        registration.start()
        for _ in range(500):
            if registration.written >= 2:  # the first write and one refresh
                return registration
            await asyncio.sleep(0.01)
        raise AssertionError(f"only {registration.written} directory writes landed in 5 s")

    loop = asyncio.new_event_loop()
    try:
        registration = loop.run_until_complete(register())
        seen = ray.get(read_elsewhere.remote("gcs-test-app", "decode"), timeout=60)
        assert set(seen) == {"w-gcs"} and seen["w-gcs"].address == address
        assert ray.get(read_elsewhere.remote("gcs-test-app", "prefill"), timeout=60) == {}
        loop.run_until_complete(registration.stop())
        assert loop.run_until_complete(directory.lookup("gcs-test-app", "decode")) == {}
    finally:
        loop.close()
