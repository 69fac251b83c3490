"""LeaseTable with a fake clock: every lease ends exactly once, by claim, release or expiry."""

from __future__ import annotations

import threading

import pytest

from workers.transfer.lease import LeaseTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def released() -> list[tuple[str, str]]:
    return []


def test_claim_before_expiry_releases_once_as_claimed(clock, released):
    table = LeaseTable(clock)
    lease = table.grant("r1", 5.0, lambda rid, why: released.append((rid, why)))
    assert lease.expires_at == 105.0
    clock.now = 104.9
    assert table.claim("r1") is True
    assert released == [("r1", "claimed")]
    assert table.claim("r1") is False and table.release("r1") is False
    clock.now = 200.0
    assert table.sweep() == []
    assert released == [("r1", "claimed")] and len(table) == 0


def test_unclaimed_lease_expires_on_sweep_and_only_then(clock, released):
    table = LeaseTable(clock)
    table.grant("early", 1.0, lambda rid, why: released.append((rid, why)))
    table.grant("late", 10.0, lambda rid, why: released.append((rid, why)))
    clock.now = 100.99
    assert table.sweep() == []
    clock.now = 101.0
    assert table.sweep() == ["early"]
    assert released == [("early", "expired")]
    assert "late" in table and "early" not in table
    assert table.claim("early") is False


def test_claim_of_an_overdue_lease_ends_it_as_expired(clock, released):
    table = LeaseTable(clock)
    table.grant("r1", 2.0, lambda rid, why: released.append((rid, why)))
    clock.now = 103.0
    assert table.claim("r1") is False
    assert released == [("r1", "expired")]
    assert table.sweep() == []


def test_release_and_grant_drive_the_sweep(clock, released):
    table = LeaseTable(clock)
    table.grant("a", 1.0, lambda rid, why: released.append((rid, why)))
    table.grant("b", 1.0, lambda rid, why: released.append((rid, why)))
    assert table.release("b") is True
    clock.now = 102.0
    table.grant("c", 1.0, lambda rid, why: released.append((rid, why)))  # sweeps "a"
    assert released == [("b", "released"), ("a", "expired")]
    assert len(table) == 1


def test_regrant_after_release_uses_the_new_ttl(clock, released):
    table = LeaseTable(clock)
    table.grant("r1", 1.0, lambda rid, why: released.append((rid, why)))
    table.release("r1")
    table.grant("r1", 10.0, lambda rid, why: released.append((rid, why)))
    clock.now = 105.0  # past the first lease's expiry, the old heap entry must not fire
    assert table.sweep() == []
    assert released == [("r1", "released")]


def test_extend_moves_the_end_later_never_earlier(clock, released):
    table = LeaseTable(clock)
    table.grant("r1", 5.0, lambda rid, why: released.append((rid, why)))
    clock.now = 104.0
    assert table.extend("r1", 10.0) == 10.0  # now ends at 114
    assert table.extend("r1", 2.0) == 10.0  # shorter than what is left: unchanged
    clock.now = 110.0
    assert table.sweep() == [] and released == []  # the first expiry (105) went stale
    clock.now = 114.0
    assert table.sweep() == ["r1"] and released == [("r1", "expired")]
    assert table.extend("r1", 5.0) is None  # ended: cannot come back
    table.grant("r2", 1.0, lambda rid, why: released.append((rid, why)))
    clock.now = 115.5
    assert table.extend("r2", 5.0) is None  # overdue: the sweep ends it as expired
    with pytest.raises(ValueError, match="positive"):
        table.extend("r2", 0.0)


def test_bad_grants_are_rejected(clock):
    table = LeaseTable(clock)
    table.grant("r1", 1.0, lambda rid, why: None)
    with pytest.raises(ValueError, match="already holds a lease"):
        table.grant("r1", 1.0, lambda rid, why: None)
    with pytest.raises(ValueError, match="positive"):
        table.grant("r2", 0.0, lambda rid, why: None)


def test_a_raising_callback_does_not_stop_the_others(clock, released):
    table = LeaseTable(clock)

    def boom(rid: str, why: str) -> None:
        raise RuntimeError("boom")

    table.grant("bad", 1.0, boom)
    table.grant("good", 1.0, lambda rid, why: released.append((rid, why)))
    clock.now = 101.0
    assert sorted(table.sweep()) == ["bad", "good"]
    assert released == [("good", "expired")]


def test_concurrent_claims_and_sweeps_release_each_lease_exactly_once(clock):
    table = LeaseTable(clock)
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def count(rid: str, why: str) -> None:
        with lock:
            counts[rid] = counts.get(rid, 0) + 1

    ids = [f"r{i}" for i in range(2000)]
    for rid in ids:
        table.grant(rid, 1.0 if int(rid[1:]) % 2 else 50.0, count)
    clock.now = 110.0
    threads = [
        threading.Thread(target=lambda: [table.claim(r) for r in ids]),
        threading.Thread(target=table.sweep),
        threading.Thread(target=lambda: [table.release(r) for r in reversed(ids)]),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == {rid: 1 for rid in ids}
    assert len(table) == 0


def test_timer_thread_expires_leases_on_a_real_clock():
    released = threading.Event()
    table = LeaseTable()
    table.grant("r1", 0.05, lambda rid, why: released.set())
    table.start(interval_s=0.01)
    try:
        assert released.wait(2.0)
        assert "r1" not in table
    finally:
        table.close()
