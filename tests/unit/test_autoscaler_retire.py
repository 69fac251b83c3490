"""The pd autoscaler's scale-down of decode (deploy/pools/autoscaler.py): it finds the decode
replicas Serve is stopping (the Serve REST API's replica states) and tells each, at its control
address, to hand its streams over, once each; a replica it cannot reach drains as before. Stand-ins
for the dashboard and the control client (the real ones run in tests/integration/test_migration.py
and the autoscaling benchmark)."""

from __future__ import annotations

import asyncio

import pytest

from deploy.pools import autoscaler as autoscaler_module
from deploy.pools.autoscaler import PDAutoscaler
from deploy.pools.autoscaling import PolicyConfig, PoolBounds


class FakeScaler:
    """Serve marks replicas STOPPING a little after the target changes: one per poll here."""

    def __init__(self, seen: list[set[str]]):
        self.seen = seen
        self.polls = 0

    async def stopping_replicas(self, app_name, deployment):
        assert (app_name, deployment) == ("app", "decode")
        self.polls += 1
        return self.seen[min(self.polls, len(self.seen)) - 1]


class FakeControl:
    def __init__(self, refuse=()):
        self.retired: list[str] = []
        self.refuse = set(refuse)

    async def retire(self, address, timeout_s):
        if address in self.refuse:
            raise ConnectionError(f"{address} unreachable")
        self.retired.append(address)
        return 3


class FakeReader:
    """Decode replicas r1..r4: (free, total) blocks each; r4 stays and has ``room`` free."""

    def __init__(self, control, held=(10, 10, 10), room=100):
        self.control = control
        self.pool = [
            {"worker_id": f"r{i + 1}", "healthy": True, "free_blocks": 100 - h, "total_blocks": 100}
            for i, h in enumerate(held)
        ] + [{"worker_id": "r4", "healthy": True, "free_blocks": room, "total_blocks": 100}]
        self.reads = 0

    async def addresses(self, deployment):
        return {"r1": "addr-r1", "r2": "addr-r2", "r3": "addr-r3", "r4": "addr-r4"}

    async def read(self, deployment):
        self.reads += 1
        return self.pool


class _Autoscaler(PDAutoscaler.func_or_class):  # the class Serve runs, built without __init__
    def __del__(self) -> None:  # Serve awaits the real one; nothing runs here
        pass


def autoscaler(seen, refuse=(), **reader) -> _Autoscaler:
    scaler = _Autoscaler.__new__(_Autoscaler)
    scaler.app_name = "app"
    scaler.scaler = FakeScaler(seen)
    scaler.pool_reader = FakeReader(FakeControl(refuse), **reader)
    scaler.config = PolicyConfig(4, PoolBounds(1, 3), PoolBounds(1, 3), kv_usage_target=0.8)
    return scaler


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(autoscaler_module, "RETIRE_POLL_S", 0.0)
    monkeypatch.setattr(autoscaler_module, "RETIRE_WATCH_S", 0.2)


def test_each_stopping_decode_replica_is_told_once_to_hand_over():
    a = autoscaler([set(), {"r2"}, {"r2", "r3"}])
    asyncio.run(a._retire_stopping(2))
    assert a.pool_reader.control.retired == ["addr-r2", "addr-r3"]
    assert a.scaler.polls == 3  # stops looking once both are told


def test_a_replica_that_does_not_answer_drains_and_the_others_are_still_told():
    a = autoscaler([{"r1", "r2"}], refuse={"addr-r1"})
    asyncio.run(a._retire_stopping(2))
    assert a.pool_reader.control.retired == ["addr-r2"]


def test_the_watch_ends_when_serve_stops_fewer_replicas_than_asked():
    a = autoscaler([{"r3"}])
    asyncio.run(a._retire_stopping(2))
    assert a.pool_reader.control.retired == ["addr-r3"]
    assert a.scaler.polls > 1  # looked again until the watch ended


def test_a_stopping_replica_is_told_only_once_the_others_can_hold_its_sequences():
    """The replicas that stay (r1, r4) have 10 + 50 free blocks of 100 each, 0 + 30 of them
    within the KV target (80 %): r2's 30 fit, then r3's 40 do not, and r3 keeps running its
    sequences until they fit or the drain time cuts them."""
    a = autoscaler([{"r2", "r3"}], held=(90, 30, 40), room=50)
    asyncio.run(a._retire_stopping(2))
    assert a.pool_reader.control.retired == ["addr-r2"]
    # the others' room grows as their sequences finish: r3 is told then
    a = autoscaler([{"r2", "r3"}], held=(90, 30, 40), room=50)

    async def finish_some():
        task = asyncio.create_task(a._retire_stopping(2))
        while a.pool_reader.reads < 3:
            await asyncio.sleep(0)
        a.pool_reader.pool[-1]["free_blocks"] = 90  # 90 - 20 kept - the 30 handed over: r3's 40 fit
        await task

    asyncio.run(finish_some())
    assert a.pool_reader.control.retired == ["addr-r2", "addr-r3"]


@pytest.mark.parametrize(("room", "told"), [(70, ["addr-r2"]), (100, ["addr-r2", "addr-r3"])])
def test_a_second_scale_down_during_a_watch_joins_it_and_the_room_is_counted_once(room, told):
    """r1 and r4 stay with 10 + ``room`` free blocks of 100 each: 0 + ``room`` - 20 within the KV
    target. The first scale-down hands r2's 30 over; the second, joining the same watch, finds
    r3's 40 fit only if the room left after r2's does (a second watch of its own counted the
    whole room again, and at ``room`` 70 told r3 where 20 was left)."""
    a = autoscaler([{"r2"}, {"r2"}, {"r2", "r3"}], held=(90, 30, 40), room=room)
    a._retiring = None

    async def two_scale_downs():
        a._watch_retiring(1)
        first = a._retiring
        while a.pool_reader.control.retired != ["addr-r2"]:
            await asyncio.sleep(0)
        a._watch_retiring(1)
        assert a._retiring is first  # joined, not a second watch
        await first

    asyncio.run(two_scale_downs())
    assert a.pool_reader.control.retired == told


def test_the_room_keeps_each_staying_replica_within_its_kv_target():
    from deploy.pools.autoscaler import room_to_hand_over

    pool = [
        {"worker_id": "a", "healthy": True, "free_blocks": 300, "total_blocks": 448},
        {"worker_id": "b", "healthy": True, "free_blocks": 50, "total_blocks": 448},  # past its target
        {"worker_id": "c", "healthy": False, "free_blocks": 448, "total_blocks": 448},  # not answering
        {"worker_id": "d", "healthy": True, "free_blocks": 448, "total_blocks": 448},  # leaving
    ]
    assert room_to_hand_over(pool, {"d"}, 0.8) == 300 - round(0.2 * 448)
    assert room_to_hand_over(pool, {"d"}, 1.0) == 350
