"""The KV-pressure rebalancing policy (deploy/pools/rebalance.py) on constructed cases, and one
look of the rebalancer over a fake worker and index."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from deploy.pools.rebalance import LocalKV, PeerKV, Rebalancer, choose_move


def test_no_move_while_each_running_sequence_has_a_free_block():
    assert choose_move(LocalKV(4, 4, ("r", 10)), [PeerKV("b", 100, 0)]) is None


def test_a_replica_short_of_blocks_moves_its_preemption_candidate_to_the_roomiest_peer():
    local = LocalKV(2, 4, ("r", 10))
    peers = [PeerKV("b", 30, 5), PeerKV("c", 40, 1), PeerKV("d", 12, 0)]
    assert choose_move(local, peers) == ("r", "c")


def test_no_peer_with_room_for_the_candidate_and_its_own_sequences_means_no_move():
    local = LocalKV(0, 3, ("r", 10))
    assert choose_move(local, [PeerKV("b", 12, 2)]) is None  # 12 - 10 - 3 < 0
    assert choose_move(local, [PeerKV("b", 13, 2)]) == ("r", "b")
    assert choose_move(local, []) is None


def test_a_lone_sequence_or_no_candidate_is_never_moved():
    assert choose_move(LocalKV(0, 1, ("r", 10)), [PeerKV("b", 100, 0)]) is None
    assert choose_move(LocalKV(0, 3, None), [PeerKV("b", 100, 0)]) is None


class FakeLoop:
    def __init__(self, local: LocalKV) -> None:
        self.local = local

    async def call(self, fn):
        return self.local


class FakeWorker:
    def __init__(self, local: LocalKV, leases: int = 0) -> None:
        self.loop = FakeLoop(local)
        self.source = SimpleNamespace(num_leases=leases)
        self.retiring = False
        self.moved: list[str] = []

    async def move(self, request_id: str) -> list[str]:
        self.moved.append(request_id)
        return [request_id]


class FakeIndex:
    async def live_workers(self, role=None):
        record = lambda wid, free, running: SimpleNamespace(worker_id=wid, free_blocks=free, num_running=running)  # noqa: E731
        return {"a": record("a", 0, 4), "b": record("b", 50, 1)}


def test_the_rebalancer_moves_once_and_waits_for_the_pull_before_the_next():
    worker = FakeWorker(LocalKV(1, 4, ("r", 8)))
    rebalancer = Rebalancer(worker, FakeIndex(), "a")
    assert asyncio.run(rebalancer.check()) == "r"
    assert worker.moved == ["r"] and rebalancer.moves == 1
    worker.source.num_leases = 1  # the moved stream's blocks are not pulled yet
    assert asyncio.run(rebalancer.check()) is None
    assert worker.moved == ["r"]


def test_only_a_short_step_wakes_the_rebalancer():
    """The step observer wakes it when free blocks run short; otherwise it never runs (an idle
    replica costs nothing)."""

    async def scenario() -> list[str]:
        worker = FakeWorker(LocalKV(1, 4, ("r", 8)))
        rebalancer = Rebalancer(worker, FakeIndex(), "a")
        rebalancer.start()
        try:
            rebalancer.on_step(free_blocks=50, num_running=4)  # plenty of room
            rebalancer.on_step(free_blocks=0, num_running=1)  # one sequence: nothing to gain
            await asyncio.sleep(0.05)
            assert worker.moved == []
            rebalancer.on_step(free_blocks=1, num_running=4)
            for _ in range(100):
                if worker.moved:
                    break
                await asyncio.sleep(0.01)
            return worker.moved
        finally:
            await rebalancer.stop()

    assert asyncio.run(scenario()) == ["r"]
