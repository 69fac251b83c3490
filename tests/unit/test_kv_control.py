"""The KV control channel (``workers/transfer/control.py``): a real gRPC server and client in
one process, on the loopback address."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from workers.protocol import KVLayout, TransferAddress, TransferRequest
from workers.transfer.control import ControlClient, ControlError, ControlHandlers, ControlServer, PeerRestarted, Refused

LAYOUT = KVLayout(2, 16, 2, 8, "float32")


def transfer(rid: str) -> TransferRequest:
    return TransferRequest(rid, "decode-0", 1, (3, 4), LAYOUT, "gloo", 7)


class FakePrefill:
    """What a prefill worker does with the calls: a table of leases."""

    def __init__(self) -> None:
        self.leases = {"held": 5.0}
        self.sent: list[str] = []

    async def send(self, request: TransferRequest) -> None:
        if self.leases.pop(request.request_id, None) is None:
            raise Refused(f"no live lease for {request.request_id}")
        self.sent.append(request.request_id)

    async def release(self, request_id: str) -> bool:
        return self.leases.pop(request_id, None) is not None

    async def extend(self, request_id: str, ttl_s: float) -> float:
        if request_id not in self.leases:
            raise Refused(f"no live lease for {request_id}")
        self.leases[request_id] = max(self.leases[request_id], ttl_s)
        return self.leases[request_id]

    async def stats(self) -> dict:
        return {"worker_id": "prefill-0", "num_held": len(self.leases)}


@pytest.fixture
async def served():
    fake = FakePrefill()
    server = ControlServer("prefill-0", "127.0.0.1", ControlHandlers(fake.send, fake.release, fake.extend, fake.stats))
    await server.start()
    address = server.address_of(TransferAddress("127.0.0.1", 1, "prefill-0"))
    client = ControlClient("decode-0")
    yield fake, server, address, client
    await client.close()
    await server.stop()


async def test_send_release_extend_and_stats(served):
    fake, server, address, client = served
    assert address.control_port == server.port and address.generation == server.generation
    await client.send(address, transfer("held"), timeout_s=5)
    assert fake.sent == ["held"]
    fake.leases.update(a=1.0, b=1.0)
    assert await client.extend(address, "a", 9.0, timeout_s=5) == 9.0
    assert await client.release(address, "b", timeout_s=5) is True
    assert await client.release(address, "b", timeout_s=5) is False  # already ended: not an error
    assert await client.stats(address, timeout_s=5) == {"worker_id": "prefill-0", "num_held": 1}
    reply = await client.hello(address, timeout_s=5)
    assert reply.ok and reply.worker_id == "prefill-0"


async def test_a_refused_call_says_why(served):
    fake, _, address, client = served
    with pytest.raises(ControlError, match="refused by prefill-0: no live lease for gone") as info:
        await client.send(address, transfer("gone"), timeout_s=5)
    assert info.value.refused and info.value.request_id == "gone" and info.value.peer_id == "prefill-0"
    with pytest.raises(ControlError, match="ttl_s must be positive"):
        await client.extend(address, "held", 0.0, timeout_s=5)
    assert fake.sent == []


async def test_a_handler_bug_is_answered_not_hung(served):
    fake, server, address, client = served

    async def broken(request):
        raise KeyError("oops")

    server.handlers.send = broken
    with pytest.raises(ControlError, match="KeyError") as info:
        await client.send(address, transfer("held"), timeout_s=5)
    assert info.value.refused and fake.leases == {"held": 5.0}


async def test_a_worker_without_lease_calls_refuses_them():
    server = ControlServer("decode-1", "127.0.0.1", ControlHandlers())
    await server.start()
    address = server.address_of(TransferAddress("127.0.0.1", 0, "decode-1"))
    client = ControlClient()
    try:
        with pytest.raises(ControlError, match="takes no send calls"):
            await client.send(address, transfer("x"), timeout_s=5)
        assert (await client.hello(address, timeout_s=5)).worker_id == "decode-1"
    finally:
        await client.close()
        await server.stop()


async def test_a_restarted_peer_is_told_apart_by_its_generation(served):
    _, server, address, client = served
    stale = dataclasses.replace(address, generation=address.generation ^ 1)  # a KVHandle from before a restart
    with pytest.raises(PeerRestarted, match="restarted"):
        await client.send(stale, transfer("held"), timeout_s=5)


async def test_a_dead_peer_fails_the_call_by_its_deadline(served):
    _, server, address, client = served
    assert (await client.hello(address, timeout_s=5)).ok  # a live connection first
    await server.stop()
    with pytest.raises(ControlError, match="Send to prefill-0 at 127.0.0.1") as info:
        await asyncio.wait_for(client.send(address, transfer("held"), timeout_s=0.5), timeout=30)
    assert not info.value.refused


async def test_an_address_without_a_control_port_fails_at_once():
    with pytest.raises(ControlError, match="advertises no control port"):
        await ControlClient().send(TransferAddress("127.0.0.1", 5, "old-prefill"), transfer("x"), timeout_s=5)
