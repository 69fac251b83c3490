"""bench/autoscale.py's request schedule: drawn up front, the same for every configuration."""

from __future__ import annotations

from bench.autoscale import schedule, workload


def test_every_configuration_gets_the_same_requests_at_the_same_times():
    phases = workload("shifting", 60.0, 1.5, 1.0)
    plan = schedule(phases, seed=0, vocab=1024)
    assert plan == schedule(phases, seed=0, vocab=1024)
    assert plan != schedule(phases, seed=1, vocab=1024)
    times = [t for t, *_ in plan]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 180.0
    by_phase = {name: [(t, len(p), n) for t, name_, p, n in plan if name_ == name] for name in {x[1] for x in plan}}
    assert all(0 <= t < 60 and (p, n) == (2048, 16) for t, p, n in by_phase["prompt-heavy"])
    assert all(60 <= t < 120 and (p, n) == (64, 512) for t, p, n in by_phase["output-heavy"])
    assert all(120 <= t < 180 for t, _, _ in by_phase["prompt-heavy again"])
    # Poisson arrivals at the phase's rate: 90 expected at 1.5/s over 60 s, 60 at 1.0/s
    assert 60 <= len(by_phase["prompt-heavy"]) <= 120 and 35 <= len(by_phase["output-heavy"]) <= 85
    assert all(10 <= tok < 1014 for _, _, prompt, _ in plan for tok in prompt)
    steady = schedule(workload("steady", 60.0, 1.5, 1.0), seed=0, vocab=1024)
    kinds = {(len(p), n) for _, _, p, n in steady}
    assert kinds == {(2048, 16), (64, 512)}
