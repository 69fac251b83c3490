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


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _settle_with(monkeypatch, splits: list[tuple[int, int]], quiet_s: float, timeout_s: float) -> tuple[bool, float]:
    import bench.autoscale as autoscale

    clock = _Clock()
    seen = iter(splits)
    last = [splits[-1]]

    def running(app: str) -> tuple[int, int]:
        last[0] = next(seen, last[0])  # past the list: the last split holds
        return last[0]

    monkeypatch.setattr(autoscale, "running_replicas", running)
    monkeypatch.setattr(autoscale.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(autoscale.time, "sleep", clock.sleep)
    return autoscale.settle((2, 2), quiet_s, timeout_s), clock.now


def test_a_start_is_clean_once_the_split_has_held_unchanged(monkeypatch):
    # 3:1 after the warm-up, back at 2:2, away again (the quiet restarts), then 2:2 for good
    splits = [(3, 1), (3, 1), (2, 2), (2, 2), (3, 1), (2, 2)]
    clean, waited = _settle_with(monkeypatch, splits, quiet_s=5.0, timeout_s=60.0)
    assert clean
    assert waited == 10.0  # 2:2 from the 6th sample (t=5 s), held 5 s


def test_a_start_that_never_settles_is_flagged(monkeypatch):
    clean, waited = _settle_with(monkeypatch, [(3, 1)], quiet_s=5.0, timeout_s=30.0)
    assert not clean and waited == 30.0
