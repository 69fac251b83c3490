"""`bench/idle.py`'s arithmetic: each process's and thread's CPU and each process's wake-ups over the
window, busiest first."""

from __future__ import annotations

from bench.idle import format_window, window


def test_window_takes_differences_drops_processes_not_seen_twice_and_sorts():
    before = {
        1: ("ray::ProxyActor", "http", 10.0, {"ray::ProxyActor": 6.0, "client.poll0": 4.0}, 1000),
        2: ("gcs_server", "other", 5.0, {"gcs_server": 5.0}, 500),
        3: ("gone", "other", 1.0, {"gone": 1.0}, 7),
    }
    after = {
        1: ("ray::ProxyActor", "http", 10.3, {"ray::ProxyActor": 6.2, "client.poll0": 4.1}, 4000),
        2: ("gcs_server", "other", 5.6, {"gcs_server": 5.5, "new": 0.1}, 500 + 30 * 55),
        4: ("started", "other", 2.0, {"started": 2.0}, 9),  # not alive at the first read: left out
    }
    rows = window(before, after)
    assert [r.pid for r in rows] == [2, 1]
    assert abs(rows[0].seconds - 0.6) < 1e-9 and abs(rows[1].seconds - 0.3) < 1e-9
    assert [name for name, _ in rows[0].threads] == ["gcs_server", "new"]
    assert [name for name, _ in rows[1].threads] == ["ray::ProxyActor", "client.poll0"]
    assert rows[0].wakes == 30 * 55 and rows[1].wakes == 3000

    table = format_window(rows, 30.0, threads=1)
    assert "| 2.00 | 55 | other | gcs_server (2) | gcs_server 1.67 |" in table
    assert "| 1.00 | 100 | http | ray::ProxyActor (1) |" in table
    assert "**3.00** | 155 |" in table and "http 1.00, other 2.00" in table


def test_voluntary_switches_of_this_process_grow_when_a_thread_sleeps():
    import os
    import time

    from bench.idle import voluntary_switches

    before = voluntary_switches(os.getpid())
    for _ in range(3):
        time.sleep(0.01)
    assert voluntary_switches(os.getpid()) >= before + 3
    assert voluntary_switches(2**22 + 12345) == 0  # no such process
