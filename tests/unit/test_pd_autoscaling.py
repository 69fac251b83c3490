"""The pd autoscaling policy as a pure function (deploy/pools/autoscaling.py): budget, bounds,
hysteresis and a load that shifts between the pools; its signals from replica stats
(deploy/pools/autoscaling_signals.py); its arguments (deploy/args.py); its line in pdserve status."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from deploy.pools.autoscaling import (
    DecodeSignals,
    PolicyConfig,
    PolicyState,
    PoolBounds,
    PrefillSignals,
    ahead_need,
    decide,
    decode_need,
    describe,
    erlang_c,
    fill_budget,
    fit_budget,
    follow,
    held_need,
    inflow_need,
    kv_usage_ahead,
    late_share,
    move_limit,
    prefill_need,
    tpot_need,
    ttft_need,
)
from deploy.pools.autoscaling_signals import INFLOW_WINDOW_MIN_S, SignalReader
from deploy.pools.autoscaling_signals import RATE_SMOOTHING as A

B = 1 - A  # the previous smoothed rate's weight

CONFIG = PolicyConfig(
    max_total_replicas=4,
    prefill=PoolBounds(1, 3),
    decode=PoolBounds(1, 3),
    ttft_target_s=1.0,
    tpot_target_s=0.05,
    prefill_tokens_per_s=1000.0,
    upscale_delay_s=4.0,
    downscale_delay_s=20.0,
    cooldown_s=10.0,
)


def prefill(replicas=2, queued=0, rate=0.0, per_replica=1000.0, ready=None, held=0.0) -> PrefillSignals:
    return PrefillSignals(replicas, replicas if ready is None else ready, queued, rate, per_replica, held)


def decode(replicas=2, running=0, waiting=0, kv=0.0, tpot=None, ready=None) -> DecodeSignals:
    return DecodeSignals(replicas, replicas if ready is None else ready, running, waiting, kv, tpot)


def run(p, d, state: PolicyState | None = None, start=0.0, seconds=30, step=2.0):
    """Decide every ``step`` seconds on the same signals; the decisions and the last state."""
    decisions, t = [], start
    state = PolicyState() if state is None else state
    while t <= start + seconds:
        decision = decide(p, d, CONFIG, state, t)
        state = decision.state
        decisions.append(decision)
        t += step
    return decisions, state


# ------------------------------------------------------------------ needs
def test_prefill_need_drains_the_queue_within_half_the_ttft_target():
    # 1500 queued tokens at 1000 tok/s per replica, to drain in 0.5 s: 3 replicas
    assert prefill_need(prefill(queued=1500), CONFIG) == pytest.approx(3.0)
    # no queue but 1600 tok/s arriving, each replica to run at 80 %: 2 replicas
    assert prefill_need(prefill(rate=1600.0), CONFIG) == pytest.approx(2.0)
    # not measured yet: the prior per-replica rate
    assert prefill_need(prefill(queued=500, per_replica=None), CONFIG) == pytest.approx(1.0)
    # but never less than what the pool computes per replica: 2 replicas at 3000 tok/s run at
    # 100 % of 1500 each, not 150 % of the prior 1000
    assert prefill_need(prefill(rate=3000.0, per_replica=None), CONFIG) == pytest.approx(2.5)


def test_a_prefill_queue_behind_a_saturated_decode_pool_is_not_prefills_need():
    # prefill replicas holding most of their KV for prompts decode has not taken, while decode
    # sequences wait for blocks: only what prefill computes counts
    blocked = prefill(queued=30000, rate=400.0, held=0.7)
    assert prefill_need(blocked, CONFIG) == pytest.approx(60.0)
    assert prefill_need(blocked, CONFIG, decode_saturated=True) == pytest.approx(0.5)
    d = decode(replicas=1, running=90, waiting=10, kv=0.86, tpot=0.38)
    decision = decide(
        prefill(replicas=3, queued=30000, rate=400.0, held=0.7),
        d,
        CONFIG,
        PolicyState(pending=(1, 3), pending_since=0.0),
        20.0,
    )
    # decode far short (need 8.4 >= 1.5 x (1 + 2)): two replicas move in one change
    assert decision.decode_need == pytest.approx(8.44, abs=0.01)
    assert (decision.prefill, decision.decode, decision.changed) == (1, 3, True)
    # a prefill pool with its KV free is not waiting on decode: its own queue still counts
    free = prefill(queued=30000, rate=400.0, held=0.1)
    assert prefill_need(free, CONFIG, decode_saturated=True) == pytest.approx(60.0)


def test_decode_need_follows_tpot_kv_and_waiting_sequences():
    assert decode_need(decode(running=0), CONFIG) == 0.0
    assert decode_need(decode(running=8, tpot=0.1, kv=0.2), CONFIG) == pytest.approx(4.0)  # TPOT 2x its target
    assert decode_need(decode(running=8, tpot=0.01, kv=0.6), CONFIG) == pytest.approx(1.5)  # KV 0.6 / 0.8
    # 8 running and 8 waiting at TPOT on target: twice the replicas
    assert decode_need(decode(running=8, waiting=8, tpot=0.05), CONFIG) == pytest.approx(4.0)
    # nothing running, something waiting: at least one more replica
    assert follow(2, decode_need(decode(running=0, waiting=3), CONFIG), CONFIG.decode, CONFIG) == 3


def test_erlang_c_matches_its_closed_forms():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # one server: the chance it is busy
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # 2 a^2 / ((2 - a)(2 + a)) at a = 1
    assert erlang_c(2, 2.0) == 1.0 and erlang_c(3, 4.0) == 1.0  # overloaded: every arrival waits
    assert erlang_c(100, 80.0) < erlang_c(10, 8.0)  # the same utilization, more servers: less waiting


def test_prefill_is_sized_so_that_arrivals_wait_no_longer_than_the_ttft_allows():
    # the benchmark's prompt-heavy phase: 1.2 prompts/s of 2048 tokens at 1600 tokens/s (1.28 s
    # each), TTFT target 2 s. Keeping up at 80 % reads 1.92 replicas; but at 2 replicas 40 % of
    # equal prompts wait longer than the 0.72 s left to them, at 3 replicas 5 %
    service = 2048 / 1600
    config = replace(CONFIG, ttft_target_s=2.0)
    need = ttft_need(1.2, service, config, service_cv2=0.0)
    assert 2.0 < need <= 3.0 and follow(2, need, config.prefill, config) == 3
    p = replace(prefill(rate=1.2 * 2048, per_replica=1600.0), arrivals_per_s=1.2, mean_prompt_tokens=2048.0)
    assert 1.9 < 1.2 * 2048 / (1600 * 0.8) < 2.0  # the keep-up term alone
    assert prefill_need(replace(p, prompt_tokens_cv2=0.0), config) == pytest.approx(need)
    # lengths spread like an exponential wait twice as long: one more replica
    assert 3.0 < ttft_need(1.2, service, config, service_cv2=1.0) <= 4.0
    # a lighter load, a looser target, nothing arriving
    assert 0.0 < ttft_need(0.1, service, config, service_cv2=0.0) <= 1.0
    assert 1.0 < ttft_need(0.3, service, config, service_cv2=0.0) <= 2.0  # 1 replica: 19 % would wait too long
    assert 1.0 < ttft_need(1.2, service, replace(config, ttft_target_s=10.0), service_cv2=0.0) <= 2.0
    assert ttft_need(0.0, service, config) == 0.0
    # a prompt alone takes longer than the target: no count meets it, the load at 80 % it is
    assert ttft_need(1.2, 2.5, config) == pytest.approx(1.2 * 2.5 / 0.8)
    # with decode saturated and prefill holding its KV, only what prefill computes counts
    blocked = replace(p, held_kv_fraction=0.9, prompt_tokens_cv2=0.0)
    assert prefill_need(blocked, config, decode_saturated=True) == pytest.approx(1.2 * 2048 / (1600 * 0.8))


def test_the_ttft_need_falls_with_the_load_so_an_idle_pool_shrinks():
    """Fractional between whole counts: c - 1 < need <= c for the fewest c replicas that meet
    the target, rising with the arrivals, and vanishing with them. As a whole count, a trickle
    needed exactly 1 replica, and a pool of 2 kept its second replica (a test's idle prefill pool
    held it for minutes: arrivals read 5e-144/s, the prefill need 1.0)."""
    service = 2048 / 1600
    config = replace(CONFIG, ttft_target_s=2.0)
    loads = [0.001 * 1.2**k for k in range(40)]
    needs = [ttft_need(a, service, config, service_cv2=0.0) for a in loads]
    assert all(b > a for a, b in zip(needs, needs[1:])), needs
    whole = [
        next(c for c in range(1, 64) if late_share(c, a, service, config.ttft_target_s - service, 0.5) <= 0.1)
        for a in loads
    ]
    assert all(c - 1 < n <= c for c, n in zip(whole, needs)), list(zip(whole, needs))
    assert len(set(whole)) >= 3  # the loads span several whole counts
    trickle = ttft_need(5e-144, 320 / 10109, replace(config, ttft_target_s=0.05), service_cv2=0.0)
    assert 0.0 < trickle < 0.05
    assert follow(2, trickle, config.prefill, config) == 1
    idle = replace(prefill(replicas=2, per_replica=10109.0), arrivals_per_s=5e-144, mean_prompt_tokens=320.0)
    decisions, _ = run(idle, decode(replicas=1))
    assert [(d.prefill, d.decode) for d in decisions if d.changed] == [(1, 1)]


def _inflow(
    replicas=2, running=0, kv=0.0, tpot=None, rate=1.0, output=511.0, prompt=64.0, residency=0.05
) -> DecodeSignals:
    return replace(
        decode(replicas=replicas, running=running, kv=kv, tpot=tpot),
        inflow_seqs_per_s=rate,
        expected_output_tokens=output,
        inflow_prompt_tokens=prompt,
        blocks_per_replica=448,
        block_size=16,
        residency_tpot_s=residency,
    )


def test_decode_need_counts_what_prefill_hands_over_before_decode_holds_it():
    # an output-heavy phase begins: decode holds nothing now, but 1 sequence/s of 64 + 511 tokens
    # arrives. At decode's recent 50 ms a token each stays 25.55 s: 25.55 sequences resident,
    # each holding 64 + 255.5 tokens on average (21 blocks) of a replica's 448 at 80 %: 1.49 replicas
    d = _inflow()
    assert held_need(d, CONFIG) == 0.0
    expected = 1.0 * 511 * 0.05 * ((64 + 255.5) / 16 + 1) / (448 * 0.8)
    assert inflow_need(d, CONFIG) == pytest.approx(expected) and expected == pytest.approx(1.49, abs=0.01)
    assert decode_need(d, CONFIG) == pytest.approx(expected)
    assert follow(1, decode_need(d, CONFIG), CONFIG.decode, CONFIG) == 2  # one replica would not do
    # residency follows decode's measured TPOT, not the target: twice as slow, twice the need
    assert inflow_need(_inflow(residency=0.1), CONFIG) == pytest.approx(2 * expected)
    assert inflow_need(_inflow(residency=0.01), CONFIG) == pytest.approx(expected / 5)
    loose = replace(CONFIG, tpot_target_s=5.0)  # a loose target sizes nothing
    assert inflow_need(_inflow(), loose) == pytest.approx(expected)
    # the KV held 10 s from now: what runs now still holds then (no report of it: all of it)
    # plus the inflow that arrives meanwhile and stays (a stay is 511 x 50 ms = 25.55 s: 10 / 25.55
    # of its steady need); more than either alone
    busy = _inflow(running=40, kv=0.9, tpot=0.05)
    assert held_need(busy, CONFIG) == pytest.approx(2.25) and inflow_need(busy, CONFIG) < 2.25
    assert ahead_need(busy, CONFIG) == pytest.approx(2.25 + expected * 10 / 25.55)
    assert decode_need(busy, CONFIG) == pytest.approx(ahead_need(busy, CONFIG))
    # short stays (16 tokens, 0.8 s): all of the inflow's steady need is there in 10 s
    short = replace(busy, expected_output_tokens=16.0)
    assert ahead_need(short, CONFIG) == pytest.approx(2.25 + inflow_need(short, CONFIG))
    # nothing flows in: the KV ahead alone (below what is held now)
    assert ahead_need(replace(busy, inflow_seqs_per_s=0.0), CONFIG) == pytest.approx(2.25)
    # nothing handed over, nothing known about it, or decode never ran: no inflow need
    assert inflow_need(_inflow(rate=0.0), CONFIG) == 0.0
    assert inflow_need(replace(_inflow(), blocks_per_replica=0), CONFIG) == 0.0
    assert inflow_need(_inflow(residency=None), CONFIG) == 0.0


def test_inflow_need_of_a_mix_weighs_each_requests_prompt_by_its_own_output():
    # half 2048-token prompts with 16-token outputs, half 64-token prompts with 512: at 57 ms a
    # token the long prompts stay 0.9 s and the short ones 29 s. Resident blocks per request:
    # (2048 + 8 + 16) x 0.912 / 16 = 118 and (64 + 256 + 16) x 29.2 / 16 = 613: 1 request/s
    # holds 365 blocks, 1.02 replicas. The means (1056 and 264 tokens) would say 3.1
    tpot, mix = 0.057, [(2048, 16), (64, 512)]
    mean = lambda f: sum(f(p, o) for p, o in mix) / len(mix)  # noqa: E731
    independent = replace(_inflow(rate=1.0, output=mean(lambda p, o: o), prompt=mean(lambda p, o: p), residency=tpot))
    joint = replace(
        independent, inflow_prompt_x_output=mean(lambda p, o: p * o), inflow_output_sq=mean(lambda p, o: o * o)
    )
    blocks = mean(lambda p, o: (p + o / 2 + 16) * o * tpot / 16)
    assert inflow_need(joint, CONFIG) == pytest.approx(blocks / (448 * 0.8)) and 1.0 < inflow_need(joint, CONFIG) < 1.05
    assert inflow_need(independent, CONFIG) > 3.0
    # with one kind of request only, both are the same
    one = _inflow(rate=1.0, output=512.0, prompt=64.0, residency=tpot)
    assert inflow_need(replace(one, inflow_prompt_x_output=64 * 512.0, inflow_output_sq=512.0**2), CONFIG) == (
        pytest.approx(inflow_need(one, CONFIG))
    )


def test_inflow_need_counts_a_stays_overhead_which_short_outputs_are_mostly_made_of():
    # a prompt-heavy phase: 1.2 hand-overs/s of 2048-token prompts and 16 tokens each. At 33 ms a
    # token a sequence would stay 0.53 s (0.61 replicas); its measured stay is 2.5 s longer (the
    # pull, waits for a step), so 3.6 sequences of 129 blocks are resident: 1.3 replicas
    short = replace(_inflow(rate=1.2, output=16.0, prompt=2048.0, residency=0.033))
    blocks = (2048 + 8) / 16 + 1
    assert inflow_need(short, CONFIG) == pytest.approx(1.2 * 16 * 0.033 * blocks / (448 * 0.8))
    assert inflow_need(short, CONFIG) < 1.0
    longer = replace(short, residency_overhead_s=2.5)
    assert inflow_need(longer, CONFIG) == pytest.approx(1.2 * (16 * 0.033 + 2.5) * blocks / (448 * 0.8))
    assert follow(1, decode_need(longer, CONFIG), CONFIG.decode, CONFIG) == 2
    # for 511-token outputs the same overhead is a few percent
    base = _inflow()
    ratio = inflow_need(replace(base, residency_overhead_s=2.5), CONFIG) / inflow_need(base, CONFIG)
    assert ratio == pytest.approx(1 + 2.5 / (511 * 0.05))


# ------------------------------------------------------------------ dead band, bounds, budget
@pytest.mark.parametrize(
    "need, wanted",
    [
        (0.0, 1),
        (0.69, 1),
        (0.71, 2),
        (2.0, 2),
        (2.1, 2),
        (2.11, 3),
        (9.0, 3),
    ],
)
def test_follow_keeps_a_dead_band_and_the_bounds(need, wanted):
    # from 2: down once 1 replica would run at <= 70 % of its target (need <= 0.7), up past 2.1;
    # within [1, 3]
    assert follow(2, need, PoolBounds(1, 3), CONFIG) == wanted


def test_budget_goes_to_the_least_covered_need():
    assert fit_budget((3, 1), (2.5, 0.5), CONFIG) == (3, 1)  # fits: unchanged
    assert fit_budget((3, 3), (6.0, 2.0), CONFIG) == (3, 1)  # prefill's need is 3x decode's
    assert fit_budget((3, 3), (2.0, 6.0), CONFIG) == (1, 3)
    assert fit_budget((3, 3), (4.0, 4.0), CONFIG) == (2, 2)  # equal needs split evenly


def test_over_budget_a_pool_keeps_what_its_own_need_keeps_unless_the_other_is_short():
    # a benchmark run's round: prefill 10 % over its 2 replicas, decode at 0.9 of one. Before,
    # the least-covered rule gave prefill decode's second replica (3:1); 15 s later decode's
    # one replica was full with 7 sequences waiting
    assert fit_budget((3, 3), (2.19, 0.9), CONFIG) == (3, 1)  # no current counts: from the minimums
    assert fit_budget((3, 2), (2.19, 0.9), CONFIG, current=(2, 2)) == (2, 2)
    # decode would shrink alone (need 0.6 <= 70 % of 1): it keeps only 1, prefill takes the other
    assert fit_budget((3, 1), (2.19, 0.6), CONFIG, current=(2, 2)) == (3, 1)
    # a pool short by take_ratio (8.16 on 1 replica) takes from one that would keep its 3
    assert fit_budget((3, 3), (3.15, 8.16), CONFIG, current=(3, 1)) == (1, 3)
    # 1.4x short is not enough: each keeps its own
    assert fit_budget((3, 3), (3.15, 1.4), CONFIG, current=(3, 1)) == (3, 1)
    # a full budget, prefill short: decode's keep does not stop it
    decision = decide(
        prefill(replicas=2, queued=3000, rate=2000.0),
        decode(replicas=2, running=1, kv=0.9 * 0.8 / 2, tpot=0.01),
        CONFIG,
        PolicyState(pending=(3, 1), pending_since=0.0),
        20.0,
    )
    assert (decision.prefill, decision.decode, decision.changed) == (3, 1, True)  # need 6 on 2


def test_a_pool_far_short_takes_two_replicas_in_one_change():
    # a benchmark's third phase: prefill shrank to 1 in the output-heavy phase; 20k prompt tokens
    # queue (need 6.45 >= 1 + 2) while decode's 3 drain: prefill takes two at once
    def third_phase(queued: int, pending: tuple[int, int]):
        d = decode(replicas=3, running=3, kv=0.1, tpot=0.01)
        return decide(prefill(replicas=1, queued=queued, rate=1000.0), d, CONFIG, PolicyState(pending, 0.0), 20.0)

    far = third_phase(3225, (3, 1))
    assert far.prefill_need == pytest.approx(6.45) and (far.prefill, far.decode, far.changed) == (3, 1, True)
    # a need of 3 fills the count a double step gives (a benchmark's 4.49 moved one at 1.5 x 3)
    assert third_phase(1500, (3, 1)).prefill_need == pytest.approx(3.0)
    assert (third_phase(1500, (3, 1)).prefill, third_phase(1500, (3, 1)).decode) == (3, 1)
    # short of it (need 2.5 wants 3, as follow's tolerance allows): one replica per change
    near = third_phase(1250, (2, 2))
    assert near.prefill_need == pytest.approx(2.5) and (near.prefill, near.decode, near.changed) == (2, 2, True)
    assert move_limit((1, 3), (3, 1), (6.45, 0.3), CONFIG) == 2 and move_limit((1, 3), (3, 1), (2.5, 0.3), CONFIG) == 1
    assert move_limit((3, 1), (1, 3), (0.2, 6.0), CONFIG) == 2  # either pool


def test_a_decode_pool_at_nine_tenths_of_a_replica_keeps_its_second_through_a_prompt_heavy_phase():
    p = prefill(replicas=2, queued=0, rate=3510.0, per_replica=2000.0)  # need 2.19
    d = decode(replicas=2, running=1, kv=0.9 * 0.8 / 2, tpot=0.02)  # need 0.9
    decisions, _ = run(p, d, seconds=60)
    assert not any(x.changed for x in decisions)
    assert decisions[-1].prefill_need == pytest.approx(2.19, abs=0.01)


def test_left_over_budget_goes_to_a_pool_that_would_keep_it():
    # decode at 1.05 replicas' worth: not past its upper threshold (1.1), but a second replica
    # would run at 52 %, above the 70 % x 1 it needs to keep it; a third would not be kept
    assert fill_budget((1, 1), (0.08, 1.05), CONFIG) == (1, 2)
    assert fill_budget((1, 1), (0.0, 0.0), CONFIG) == (1, 1)  # idle: nothing to fill
    assert fill_budget((1, 1), (1.9, 1.6), CONFIG) == (2, 2)  # both keep one more: least covered first
    assert fill_budget((1, 1), (2.5, 2.5), CONFIG) == (2, 2)  # the budget bounds the fill
    assert fill_budget((1, 1), (9.0, 0.0), CONFIG) == (3, 1)  # and so does the pool's maximum


def test_a_shrinking_pool_hands_its_replicas_to_a_loaded_one_in_the_same_change():
    # An output-heavy phase begins: prefill (3 replicas) has nothing queued, decode (1 replica)
    # is busy but not past its upper threshold. Its KV usage spreads over its replicas.
    p = lambda n: prefill(replicas=n[0], queued=0, rate=62.0)  # noqa: E731
    d = lambda n: decode(replicas=n[1], running=22, kv=0.84 / n[1], tpot=0.03)  # noqa: E731

    def changes(config):
        counts, state, t, seen = (3, 1), PolicyState(), 0.0, []
        while t <= 60.0:
            decision = decide(p(counts), d(counts), config, state, t)
            state = decision.state
            if decision.changed:
                counts = (decision.prefill, decision.decode)
                seen.append((t, counts))
            t += 2.0
        return seen

    # decode's own need (1.05) does not call for a second replica: with the budget full prefill
    # keeps its replicas (held anyway) rather than move one to a pool that does not need it
    assert changes(CONFIG) == []
    # without the fill the budget lies unused
    assert changes(replace(CONFIG, fill_budget=False)) == [(20.0, (2, 1)), (42.0, (1, 1))]
    # a decode pool whose own need calls for more takes it after the upscale delay
    busy = lambda n: decode(replicas=n[1], running=22, kv=1.0 / n[1], tpot=0.03)  # noqa: E731
    state, t = PolicyState(), 0.0
    while not (decision := decide(p((3, 1)), busy((3, 1)), CONFIG, state, t)).changed:
        state, t = decision.state, t + 2.0
    assert (decision.prefill, decision.decode, t) == (2, 2, 4.0)


def test_a_full_budget_moves_one_replica_per_change():
    from deploy.pools.autoscaling import limit_move

    assert limit_move((3, 1), (1, 3), 1) == (2, 2)
    assert limit_move((1, 3), (3, 1), 1) == (2, 2)
    assert limit_move((3, 1), (1, 2), 1) == (2, 2)  # the freed replica and the taken one
    assert limit_move((2, 2), (1, 3), 1) == (1, 3)  # already one step
    assert limit_move((3, 1), (1, 3), 2) == (1, 3)
    # a pool that may give only one leaves the other only one to take, within the budget
    assert limit_move((3, 1), (1, 3), 1) == (2, 2) and sum(limit_move((3, 2), (1, 4), 1)) <= 5
    # unlimited (move_step 0): the policy moves the whole way at once
    d = decide(
        prefill(replicas=3, queued=30000, rate=400.0, held=0.7),
        decode(replicas=1, running=90, waiting=10, kv=0.86, tpot=0.38),
        replace(CONFIG, move_step=0),
        PolicyState(pending=(1, 3), pending_since=0.0),
        20.0,
    )
    assert (d.prefill, d.decode, d.changed) == (1, 3, True)


def test_decisions_never_exceed_the_budget_or_the_bounds():
    for queued in (0, 500, 3000, 30000):
        for running, tpot in ((0, None), (4, 0.02), (32, 0.5)):
            decisions, _ = run(prefill(queued=queued), decode(running=running, tpot=tpot, kv=0.5), seconds=60)
            for d in decisions:
                assert d.prefill + d.decode <= 4
                assert 1 <= d.prefill <= 3 and 1 <= d.decode <= 3


# ------------------------------------------------------------------ hysteresis
def test_a_change_waits_for_its_delay_then_applies_once():
    p, d = prefill(queued=2500), decode(running=1, tpot=0.01)  # prefill wants 3 (need 5), decode 1
    decisions, state = run(p, d, seconds=10)
    changed = [x for x in decisions if x.changed]
    assert [(x.prefill, x.decode) for x in changed] == [(3, 1)]
    assert changed[0] is decisions[2]  # t=4 s: the upscale delay after t=0
    assert decisions[0].held == "upscale delay (4 s)"
    assert state.last_change == 4.0


def test_shrinking_waits_for_the_longer_downscale_delay():
    decisions, _ = run(prefill(queued=0), decode(running=0), seconds=30)  # idle: both want 1
    first = next(x for x in decisions if x.changed)
    assert (first.prefill, first.decode) == (1, 1)
    assert decisions.index(first) == 10  # t=20 s


def test_no_change_while_the_last_one_lands_nor_within_the_cooldown():
    p = prefill(replicas=3, ready=2, queued=0)  # a replica of the last change still starting
    d = decode(replicas=1, running=30, tpot=0.2)
    state = PolicyState(last_change=0.0)
    held = decide(p, d, CONFIG, state, 30.0)
    assert not held.changed and held.held.startswith("the last change is still landing")
    landed = prefill(replicas=3, queued=0)
    assert decide(landed, d, CONFIG, PolicyState(last_change=25.0), 30.0).held.startswith("cooldown")
    # a change that never lands stops holding decisions after landing_timeout_s
    late = decide(p, d, CONFIG, PolicyState(last_change=0.0, pending=(1, 3), pending_since=100.0), 130.0)
    # decode's need of 4 on 1 replica fills the count a double step gives: (1, 3) in one change
    assert late.changed and (late.prefill, late.decode) == (1, 3)


def test_noise_inside_the_dead_band_never_changes_anything():
    state, t = PolicyState(), 0.0
    for i in range(200):  # need wobbles between 1.5 and 2.1 around a count of 2
        queued = 750 + (300 if i % 2 else 0)
        decision = decide(
            prefill(queued=queued), decode(running=4, tpot=0.05 * (1.5 + 0.6 * (i % 2)) / 2), CONFIG, state, t
        )
        assert not decision.changed and decision.held is None
        state, t = decision.state, t + 2.0


def test_a_flapping_proposal_restarts_its_delay():
    config = replace(CONFIG, look_back_s=0.0)  # each round's needs as they are
    state = decide(prefill(queued=2500), decode(running=1, tpot=0.01), config, PolicyState(), 0.0).state
    # at t=2 the queue is gone and the idle prefill pool would shrink instead: a new delay starts
    state = decide(prefill(queued=0), decode(running=1, tpot=0.01), config, state, 2.0).state
    assert state.pending == (1, 1) and state.pending_since == 2.0
    again = decide(prefill(queued=2500), decode(running=1, tpot=0.01), config, state, 4.0)
    assert not again.changed and again.state.pending_since == 4.0


def test_needs_are_the_median_over_the_look_back_so_that_lone_spikes_restart_no_delay():
    """A prompt-heavy phase as a benchmark run read it: prefill's need 3 on two rounds of three
    (2 on the third), decode's 0.4 between spikes of a burst waiting for blocks (2.4, 8, 4).
    Round by round, each spike flips the proposal and restarts the upscale delay: nothing moves.
    Over the look-back window the medians read 3 and 0.4, and prefill takes a decode replica."""
    queued = [1500, 1500, 1000]  # prefill's need 3, 3, 2 (drain term: queued / 500)
    tpot = [0.01, 0.06, 0.01, 0.2, 0.01, 0.1]  # decode's need 0.4, 2.4, 0.4, 8, 0.4, 4 (2 x tpot / 0.05)

    def moves(config: PolicyConfig) -> list[tuple[float, int, int]]:
        state, seen = PolicyState(), []
        for i in range(30):  # 60 s, a round every 2 s
            t = 2.0 * i
            decision = decide(prefill(queued=queued[i % 3]), decode(running=2, tpot=tpot[i % 6]), config, state, t)
            state = decision.state
            if decision.changed:
                seen.append((t, decision.prefill, decision.decode))
                break
        return seen

    assert moves(replace(CONFIG, look_back_s=0.0)) == []
    seen = moves(CONFIG)
    assert [(p, d) for _, p, d in seen] == [(3, 1)]
    assert seen[0][0] <= 20.0  # once three rounds fill the window's middle, then the 4 s delay


def test_the_look_back_keeps_only_its_window_and_follows_a_load_that_lasts():
    state, needs = PolicyState(), []
    for i in range(12):  # decode's need jumps from 0.4 to 4.0 at t=10 s and stays
        t = 2.0 * i
        decision = decide(prefill(), decode(running=2, tpot=0.01 if t < 10 else 0.1), CONFIG, state, t)
        state = decision.state
        needs.append(round(decision.decode_need, 2))
        assert all(t - r[0] < CONFIG.look_back_s for r in state.needs)
    assert needs[:5] == [0.4] * 5
    assert needs[5] == 0.4 and needs[6] == 0.4  # one and two high rounds of five or six: still the low
    assert needs[7] == 4.0  # three of five
    assert len(state.needs) == 5


# ------------------------------------------------------------------ a load that shifts
def test_shifting_load_moves_replicas_between_the_pools_and_back():
    prompt_heavy = (
        lambda n: prefill(replicas=n[0], queued=4000, rate=2000.0),
        lambda n: decode(replicas=n[1], running=4, tpot=0.01, kv=0.1),
    )
    output_heavy = (
        lambda n: prefill(replicas=n[0], queued=0, rate=100.0),
        lambda n: decode(replicas=n[1], running=48, tpot=0.12, kv=0.7),
    )
    counts, state, t, seen = (2, 2), PolicyState(), 0.0, []
    for phase in (prompt_heavy, output_heavy, prompt_heavy):
        for _ in range(30):  # 60 s per phase, a decision every 2 s
            decision = decide(phase[0](counts), phase[1](counts), CONFIG, state, t)
            state, t = decision.state, t + 2.0
            if decision.changed:
                counts = (decision.prefill, decision.decode)
                seen.append(counts)
        seen.append(("end of phase", counts))
    # decode's need of 2.4 at 1 replica moves one replica, then 4.8 at 2 the next; prefill's need of
    # 4 at 1 replica fills the count a double step gives: two in one change
    assert seen == [
        (3, 1),
        ("end of phase", (3, 1)),
        (2, 2),
        (1, 3),
        ("end of phase", (1, 3)),
        (3, 1),
        ("end of phase", (3, 1)),
    ]


# ------------------------------------------------------------------ the operator's line
def test_describe_names_the_change_and_its_signals():
    p, d = prefill(queued=2500, rate=1800.0), decode(running=3, waiting=0, kv=0.2, tpot=0.012)
    decision = decide(p, d, CONFIG, PolicyState(pending=(3, 1), pending_since=0.0), 10.0)
    assert decision.changed
    assert describe(decision, p, d, CONFIG) == (
        "prefill 2 -> 3, decode 2 -> 1 (budget 4) | prefill: 2500 queued prompt tokens, 1800 tok/s, "
        "1000 tok/s per replica, need 5.00 | decode: 3 running, 0 waiting, KV 20% (20% in 10 s), TPOT 12 ms "
        "(target 50 ms), need 0.50"
    )


# ------------------------------------------------------------------ signals from stats
def _replica(wid, **kw):
    base = {
        "worker_id": wid,
        "healthy": True,
        "requests": 0,
        "prompt_tokens": 0,
        "cached_prompt_tokens": 0,
        "generated_tokens": 0,
        "num_running": 0,
        "num_waiting": 0,
        "num_held": 0,
        "kv_usage": 0.0,
        "total_blocks": 100,
    }
    return {**base, **kw}


def test_signals_come_from_two_samples_of_the_replicas_stats():
    reader = SignalReader()
    p0 = [_replica("p1", requests=10, prompt_tokens=20000, num_waiting=2, num_running=1, num_held=1, total_blocks=500)]
    d0 = [_replica("d1", generated_tokens=1000, num_running=8, kv_usage=0.5)]
    first_p, first_d = reader.read(100.0, p0, d0, 1, 1)
    assert first_p.queued_prompt_tokens == 3 * 2000 and first_p.tokens_per_s_per_replica is None
    assert first_p.held_kv_fraction == pytest.approx(2000 / (500 * 16))  # one held 2000-token prompt
    assert first_d.tpot_s is None  # no interval yet
    p1 = [
        _replica(
            "p1",
            requests=14,
            prompt_tokens=28000,
            cached_prompt_tokens=0,
            num_waiting=1,
            num_running=1,
            num_held=2,
            total_blocks=500,
        )
    ]
    d1 = [_replica("d1", generated_tokens=1400, num_running=8, kv_usage=0.6), _replica("d2", healthy=False)]
    p, d = reader.read(102.0, p1, d1, 1, 2)
    assert p.tokens_per_s_per_replica == pytest.approx(4000.0)  # busy all along: 8000 tokens in 2 s
    assert p.prompt_tokens_per_s == pytest.approx(4000.0)
    assert p.queued_prompt_tokens == 2 * 2000 and p.held_kv_fraction == pytest.approx(0.5)
    assert d.tpot_s == pytest.approx(8 / 200.0)  # 8 running, 200 tokens/s
    assert (d.replicas, d.ready_replicas, d.running_seqs, d.kv_usage) == (2, 1, 8, 0.6)
    assert first_d.residency_tpot_s is None and d.residency_tpot_s == pytest.approx(8 / 200.0)
    # the running sequences end with no token counted (a stalled interval: its TPOT, the whole
    # 2 s, is the held need's), then nothing runs: the residency keeps the last flowing TPOT
    idle = [_replica("d1", generated_tokens=1400, num_running=0, kv_usage=0.0)]
    _, d2 = reader.read(104.0, p1, idle, 1, 1)
    assert d2.tpot_s == pytest.approx(2.0) and d2.residency_tpot_s == pytest.approx(8 / 200.0)
    _, d3 = reader.read(106.0, p1, idle, 1, 1)
    assert d3.tpot_s is None and d3.residency_tpot_s == pytest.approx(8 / 200.0)


def test_decode_inflow_comes_from_prefills_hand_overs_and_decodes_finished_sequences():
    reader = SignalReader(block_size=16)
    p = lambda t, n, asked: [  # noqa: E731
        _replica("p1", requests=n, prompt_tokens=64 * n, handed_over=n, handed_over_max_tokens=asked)
    ]
    d = lambda produced, asked: [  # noqa: E731
        _replica("d1", total_blocks=448, finished_output_tokens=produced, finished_max_tokens=asked)
    ]
    reader.read(0.0, p(0, 0, 0), d(0, 0), 1, 1)
    # 4 hand-overs in 2 s, each asking for 512 tokens; nothing finished yet: expect all 512
    _, first = reader.read(2.0, p(2, 4, 2048), d(0, 0), 1, 1)
    assert first.inflow_seqs_per_s == pytest.approx(A * 2.0)  # smoothed from 0
    assert first.expected_output_tokens == pytest.approx(512.0)
    assert (first.inflow_prompt_tokens, first.blocks_per_replica, first.block_size) == (64.0, 448, 16)
    # sequences finished having used a quarter of their max_tokens (a chat asking for the whole context)
    _, second = reader.read(4.0, p(4, 8, 4096), d(256, 1024), 1, 1)
    assert second.inflow_seqs_per_s == pytest.approx(A * 2.0 + B * (A * 2.0))
    assert second.expected_output_tokens == pytest.approx(128.0)
    # an interval with no hand-over: the inflow decays, its mean max_tokens stays
    _, third = reader.read(6.0, p(6, 8, 4096), d(256, 1024), 1, 1)
    assert third.expected_output_tokens == pytest.approx(128.0)
    assert third.inflow_seqs_per_s == pytest.approx(B * second.inflow_seqs_per_s)
    # a shift to 16-token requests moves max_tokens/s and hand-overs/s alike: the mean falls
    # gradually, so rate x max_tokens is the smoothed max_tokens/s (not a lagging rate x 16)
    _, fourth = reader.read(8.0, p(8, 12, 4096 + 64), d(256, 1024), 1, 1)
    rate = A * 2.0 + B * third.inflow_seqs_per_s
    tokens = A * 32.0 + B * (B * (A * 1024 + B * A * 1024))
    assert fourth.inflow_seqs_per_s == pytest.approx(rate)
    assert fourth.expected_output_tokens == pytest.approx(tokens / rate * 0.25)


# ------------------------------------------------------------------ arguments
def test_args_take_the_shorthand_and_check_budget_and_bounds(tmp_path):
    from deploy.args import PDServeArgs

    (tmp_path / "config.json").write_text("{}")
    base = {"model": str(tmp_path), "prefill": {"replicas": 2}, "decode": {"replicas": 2}}
    short = PDServeArgs.model_validate({**base, "autoscaling": "pd"})
    assert short.autoscaling_budget == 4 and short.autoscaling_bounds("prefill") == (1, 3)
    full = PDServeArgs.model_validate(
        {
            **base,
            "autoscaling": {"policy": "pd", "max_total_replicas": 6, "decode": {"min_replicas": 2, "max_replicas": 3}},
        }
    )
    assert full.autoscaling_bounds("prefill") == (1, 4) and full.autoscaling_bounds("decode") == (2, 3)
    with pytest.raises(ValidationError, match="exceeds autoscaling.max_total_replicas 3"):
        PDServeArgs.model_validate({**base, "autoscaling": {"max_total_replicas": 3}})
    with pytest.raises(ValidationError, match="the only policy is 'pd'"):
        PDServeArgs.model_validate({**base, "autoscaling": "queue"})
    with pytest.raises(ValidationError, match="remove decode.autoscaling_config"):
        PDServeArgs.model_validate({**base, "decode": {"autoscaling_config": {"max_replicas": 2}}, "autoscaling": "pd"})
    with pytest.raises(ValidationError, match="use mode disaggregated"):
        PDServeArgs.model_validate({**base, "mode": "colocated", "autoscaling": "pd"})


def test_status_table_shows_targets_signals_and_changes():
    from deploy.ops.status_table import _autoscaling_lines

    state = {
        "budget": 4,
        "bounds": {"prefill": [1, 3], "decode": [1, 3]},
        "targets": {"prefill": 3, "decode": 1},
        "ttft_target_s": 1.0,
        "tpot_target_s": 0.05,
        "error": None,
        "last": {
            "prefill": {"queued_prompt_tokens": 2500},
            "prefill_need": 2.5,
            "decode": {"running_seqs": 3, "waiting_seqs": 0, "kv_usage": 0.25, "tpot_s": 0.012},
            "decode_need": 0.7,
            "held": "cooldown (10 s after the last change)",
        },
        "decisions": [{"time": 90.0, "line": "prefill 2 -> 3, decode 2 -> 1 (budget 4) | ..."}],
    }
    assert _autoscaling_lines(state, 100.0) == [
        "autoscaling (pd): budget 4 replicas; prefill 3 (bounds 1..3), decode 1 (bounds 1..3); "
        "targets TTFT 1000 ms, TPOT 50 ms",
        "  now: prefill 2500 queued prompt tokens, need 2.50; decode 3 running, 0 waiting, KV 25%, TPOT 12 ms, "
        "need 0.70; waiting: cooldown (10 s after the last change)",
        "  10 s ago: prefill 2 -> 3, decode 2 -> 1 (budget 4) | ...",
    ]
    assert _autoscaling_lines(None, 100.0) == []


def _finished(gen, running, seqs, out, asked, held, setup=None) -> list[dict]:
    """A decode replica's stats: tokens generated, sequences running, and the finished ones'
    count, output tokens, max_tokens, seconds they held KV and (if counted) their setup seconds."""
    extra = {} if setup is None else {"finished_setup_s": setup}
    return [
        _replica(
            "d1",
            total_blocks=448,
            generated_tokens=gen,
            num_running=running,
            finished_seqs=seqs,
            finished_output_tokens=out,
            finished_max_tokens=asked,
            finished_resident_s=held,
            **extra,
        )
    ]


def test_the_overhead_of_a_stay_is_what_finished_sequences_held_beyond_tokens_x_tpot():
    reader = SignalReader(block_size=16)
    d = lambda gen, running, seqs, out, held: _finished(gen, running, seqs, out, 16 * seqs, held)  # noqa: E731
    p = [_replica("p1")]
    reader.read(0.0, p, d(0, 2, 0, 0, 0.0), 1, 1)
    # 2 running, 100 tokens in 2 s: 40 ms a token. 4 sequences of 16 tokens finished, having held
    # KV 12 s together: 0.64 s of tokens each, 2.36 s more
    _, first = reader.read(2.0, p, d(100, 2, 4, 64, 12.0), 1, 1)
    assert first.residency_tpot_s == pytest.approx(0.04)
    assert first.residency_overhead_s == pytest.approx((12.0 - 64 * 0.04) / 4)
    # the window sums what finished: 4 more with no overhead halve the mean
    _, second = reader.read(4.0, p, d(200, 2, 8, 128, 12.0 + 64 * 0.04), 1, 1)
    assert second.residency_overhead_s == pytest.approx((12.0 - 64 * 0.04) / 8)
    # a stay shorter than tokens x TPOT (the TPOT read high) is no negative overhead
    fast = SignalReader(block_size=16)
    fast.read(0.0, p, d(0, 2, 0, 0, 0.0), 1, 1)
    _, none = fast.read(2.0, p, d(100, 2, 4, 64, 1.0), 1, 1)
    assert none.residency_overhead_s == 0.0


def test_a_stays_overhead_is_its_setup_and_the_waits_between_steps_count_per_token():
    """From replicas that count each finished sequence's seconds before its first decoded token:
    that setup is the overhead of a stay, and the rest of the stay, per token, is the residency
    TPOT where longer than the engine's. 4 sequences of 512 tokens that held KV 120 s together,
    2 s of it setup, at an engine TPOT of 50 ms: 0.5 s a stay and 57.6 ms a token (the remainder
    alone read (120 - 2048 x 0.05) / 4 = 4.4 s a stay, which a 16-token output does not have)."""
    reader = SignalReader(block_size=16)
    d = lambda gen, seqs, out, held, setup: _finished(gen, 2, seqs, out, 512 * seqs, held, setup)  # noqa: E731
    p = [_replica("p1")]
    reader.read(0.0, p, d(0, 0, 0, 0.0, 0.0), 1, 1)
    _, got = reader.read(2.0, p, d(80, 4, 2048, 120.0, 2.0), 1, 1)  # 2 running, 40 tokens/s: 50 ms
    assert got.residency_overhead_s == pytest.approx(0.5)
    assert got.residency_tpot_s == pytest.approx(118.0 / 2048)
    # stays no longer than tokens x the engine's TPOT: its TPOT stands
    fast = SignalReader(block_size=16)
    fast.read(0.0, p, d(0, 0, 0, 0.0, 0.0), 1, 1)
    _, quick = fast.read(2.0, p, d(80, 4, 2048, 90.0, 2.0), 1, 1)
    assert quick.residency_tpot_s == pytest.approx(0.05) and quick.residency_overhead_s == pytest.approx(0.5)


def test_prefill_arrivals_count_requests_as_they_start_with_their_lengths_spread():
    reader = SignalReader(block_size=16)
    p = lambda n, tokens, sq: [  # noqa: E731
        _replica("p1", received=n, received_prompt_tokens=tokens, received_prompt_tokens_sq=sq)
    ]
    d = [_replica("d1")]
    first, _ = reader.read(0.0, p(0, 0, 0), d, 1, 1)
    assert first.arrivals_per_s == 0.0 and first.prompt_tokens_cv2 == 1.0
    # 2 s: 2 prompts of 2048 and 2 of 64 arrived (none finished: a saturated pool still reads them)
    second, _ = reader.read(2.0, p(4, 2 * 2048 + 2 * 64, 2 * 2048**2 + 2 * 64**2), d, 1, 1)
    assert second.arrivals_per_s == pytest.approx(A * 2.0)
    assert second.mean_prompt_tokens == pytest.approx(1056.0)
    assert second.prompt_tokens_cv2 == pytest.approx((2048**2 + 64**2) / 2 / 1056**2 - 1)
    # then 4 prompts of 64 tokens in 2 s: smoothed alike, the mean and the spread follow
    third, _ = reader.read(4.0, p(8, 2 * 2048 + 6 * 64, 2 * 2048**2 + 6 * 64**2), d, 1, 1)
    n, tokens, sq = A * 2.0 + B * (A * 2.0), A * 128 + B * (A * 2112), A * 8192 + B * (A * 4198400)
    assert third.arrivals_per_s == pytest.approx(n) and third.mean_prompt_tokens == pytest.approx(tokens / n)
    assert third.prompt_tokens_cv2 == pytest.approx(sq / n / (tokens / n) ** 2 - 1)


def test_decode_inflow_keeps_each_hand_overs_prompt_with_its_own_max_tokens():
    reader = SignalReader(block_size=16)
    p = lambda n, prompt, asked, pm, mm: [  # noqa: E731
        _replica(
            "p1",
            handed_over=n,
            handed_over_prompt_tokens=prompt,
            handed_over_max_tokens=asked,
            handed_over_prompt_x_max=pm,
            handed_over_max_sq=mm,
        )
    ]
    d = [_replica("d1", total_blocks=448)]
    reader.read(0.0, p(0, 0, 0, 0, 0), d, 1, 1)
    # one (2048, 16) and one (64, 512) handed over: E[p m] = (2048 x 16 + 64 x 512) / 2
    _, got = reader.read(2.0, p(2, 2112, 528, 2048 * 16 + 64 * 512, 16**2 + 512**2), d, 1, 1)
    assert got.inflow_prompt_tokens == pytest.approx(1056.0) and got.expected_output_tokens == pytest.approx(264.0)
    assert got.inflow_prompt_x_output == pytest.approx((2048 * 16 + 64 * 512) / 2)
    assert got.inflow_output_sq == pytest.approx((16**2 + 512**2) / 2)
    # a prefill that does not report them: no joint means, the independent estimate
    old = SignalReader(block_size=16)
    old.read(0.0, [_replica("p1", handed_over=0, handed_over_max_tokens=0)], d, 1, 1)
    _, legacy = old.read(2.0, [_replica("p1", handed_over=2, handed_over_max_tokens=528)], d, 1, 1)
    assert legacy.inflow_prompt_x_output is None and legacy.inflow_output_sq is None


def test_prefill_tokens_per_s_is_measured_over_the_models_busy_time():
    reader = SignalReader()
    p = lambda requests, busy_s, waiting: [  # noqa: E731
        _replica("p1", requests=requests, prompt_tokens=2048 * requests, busy_s=busy_s, num_waiting=waiting)
    ]
    d = [_replica("d1")]
    reader.read(0.0, p(0, 0.0, 0), d, 1, 1)
    # one 2048-token prompt in a 2 s interval, 1.28 s of model time: 1600 tokens/s, not 1024
    first, _ = reader.read(2.0, p(1, 1.28, 0), d, 1, 1)
    assert first.tokens_per_s_per_replica == pytest.approx(1600.0)
    # two in the next (2.56 s of model time, a step started before the read): still 1600
    second, _ = reader.read(4.0, p(3, 3.84, 1), d, 1, 1)
    assert second.tokens_per_s_per_replica == pytest.approx(1600.0)
    # an interval with too little model time to tell keeps the measure
    third, _ = reader.read(6.0, p(3, 4.0, 0), d, 1, 1)
    assert third.tokens_per_s_per_replica == pytest.approx(1600.0)


def test_prefill_tokens_per_s_counts_the_tokens_computed_in_that_busy_time():
    """A prompt counts when it finishes; its steps may have run in the read before. With the
    engine's own count of the tokens its steps computed, tokens and model time are the same
    steps' (a 2048-token prompt, 1.28 s of model time, split 0.68 s / 0.6 s across two reads)."""
    reader = SignalReader()

    def p(requests: int, busy_s: float, computed: int) -> list[dict]:
        return [
            _replica(
                "p1",
                requests=requests,
                prompt_tokens=2048 * requests,
                busy_s=busy_s,
                prefill_tokens_computed=computed,
                num_waiting=1,
            )
        ]

    d = [_replica("d1")]
    reader.read(0.0, p(0, 0.0, 0), d, 1, 1)
    first, _ = reader.read(2.0, p(0, 0.68, 1088), d, 1, 1)  # running, not finished
    assert first.tokens_per_s_per_replica == pytest.approx(1600.0)
    second, _ = reader.read(4.0, p(1, 1.28, 2048), d, 1, 1)  # finished: 2048 counted, 0.6 s busy
    assert second.tokens_per_s_per_replica == pytest.approx(1600.0)  # not 2048 / 0.6 = 3413


def test_decode_tpot_is_the_engines_step_seconds_per_token():
    """Short outputs run between two reads: the running counts at the reads (2 and 2) over 16
    tokens in 2 s would read 250 ms; the engine's steps took 54 ms per token they produced."""
    reader = SignalReader()
    p = [_replica("p1")]

    def d(tokens: int, row_s: float) -> list[dict]:
        return [_replica("d1", generated_tokens=tokens, num_running=2, decode_tokens=tokens, decode_token_s=row_s)]

    reader.read(0.0, p, d(0, 0.0), 1, 1)
    _, got = reader.read(2.0, p, d(16, 16 * 0.054), 1, 1)
    assert got.tpot_s == pytest.approx(0.054)
    assert got.residency_tpot_s == pytest.approx(0.054)
    # a replica without the engine's counters: the reads' running counts, as before
    old = SignalReader()
    legacy = lambda tokens: [_replica("d1", generated_tokens=tokens, num_running=2)]  # noqa: E731
    old.read(0.0, p, legacy(0), 1, 1)
    _, before = old.read(2.0, p, legacy(16), 1, 1)
    assert before.tpot_s == pytest.approx(0.25)


def test_decode_step_line_is_fitted_from_the_engines_step_sums():
    """Two replicas' steps, 30 ms + 4 ms a row, at 1 to 4 rows: the fit recovers the line; steps
    that all ran the same rows, or too few of them, give none."""
    reader = SignalReader()
    p = [_replica("p1")]

    def sums(rows_by_step: list[int]) -> dict:
        took = [0.030 + 0.004 * r for r in rows_by_step]
        return {
            "decode_steps": len(rows_by_step),
            "decode_tokens": sum(rows_by_step),
            "decode_step_s": sum(took),
            "decode_token_s": sum(t * r for t, r in zip(took, rows_by_step)),
            "decode_rows_sq": sum(r * r for r in rows_by_step),
        }

    def d(a: list[int], b: list[int]) -> list[dict]:
        return [_replica("d1", num_running=2, **sums(a)), _replica("d2", num_running=2, **sums(b))]

    reader.read(0.0, p, d([], []), 1, 2)
    _, got = reader.read(2.0, p, d([1, 2] * 10, [3, 4] * 10), 1, 2)
    assert got.step_fixed_s == pytest.approx(0.030) and got.step_per_row_s == pytest.approx(0.004)
    # equal rows say nothing of the slope
    flat = SignalReader()
    flat.read(0.0, p, d([], []), 1, 2)
    _, none = flat.read(2.0, p, d([2] * 20, [2] * 20), 1, 2)
    assert none.step_fixed_s is None and none.step_per_row_s is None
    few = SignalReader()
    few.read(0.0, p, d([], []), 1, 2)
    _, none = few.read(2.0, p, d([1, 2], [3, 4]), 1, 2)
    assert none.step_fixed_s is None
    # replicas that do not count steps: no fit
    assert SignalReader().read(0.0, p, [_replica("d1")], 1, 1)[1].step_per_row_s is None


def test_decode_tpot_need_keeps_a_steps_fixed_part_at_fewer_replicas():
    """A benchmark's prompt-heavy phase: 2 decode replicas ran 3 sequences at a TPOT of 58 ms
    (target 100) on a step of 50 ms + 4 ms a row. In proportion to the rows that read 1.16
    replicas, and kept both; by the step's line one replica runs all three at about 62 ms."""
    c = replace(CONFIG, tpot_target_s=0.1)
    s = decode(replicas=2, running=3, tpot=0.058)
    assert tpot_need(s, c) == pytest.approx(2 * 0.058 / c.tpot_target_s)  # no line: in proportion
    fitted = replace(s, step_fixed_s=0.050, step_per_row_s=0.004)
    reach = c.tpot_target_s / 0.058 * (0.050 + 0.004 * 1.5)
    assert tpot_need(fitted, c) == pytest.approx(0.004 * 3 / (reach - 0.050))
    assert tpot_need(fitted, c) < 0.3 and held_need(fitted, c) < 0.3
    # the line predicts the measured TPOT back at today's count: a need of exactly the replicas
    # at a TPOT of exactly the target
    at_target = replace(fitted, tpot_s=c.tpot_target_s)
    assert tpot_need(at_target, c) == pytest.approx(2.0)
    # a CPU's step (no fixed part) is the proportional rule; waiting sequences count as rows
    cpu = replace(s, waiting_seqs=3, step_fixed_s=0.0, step_per_row_s=0.02)
    assert tpot_need(cpu, c) == pytest.approx(2 * 0.58 * 6 / 3)
    # a fixed part that alone misses the target: no count meets it, the proportional need grows the pool
    slow = replace(s, tpot_s=0.2, step_fixed_s=0.15, step_per_row_s=0.01)
    assert tpot_need(slow, c) == pytest.approx(2 * 2.0) and follow(2, tpot_need(slow, c), CONFIG.decode, c) > 2
    # nothing runs: no TPOT need
    assert tpot_need(decode(replicas=2, waiting=2, tpot=0.05), c) == 0.0


def test_a_pool_not_read_adds_no_round_and_a_landing_accrues_no_delay():
    """A benchmark run read neither pool for 42 s: those rounds' zero needs, and a shrink proposal
    dated from the first of them, moved the pools to 1:1 on the first round that read them."""
    blind = decide(prefill(ready=0), decode(ready=0), CONFIG, PolicyState(last_change=0.0), 2.0)
    assert not blind.changed and blind.held == "no replica of the prefill and decode pool answered"
    assert blind.state.needs == () and blind.state.pending is None
    # a landing: the idle pools would shrink, but the proposal is not dated before they landed
    state = PolicyState(last_change=0.0)
    for t in (2.0, 10.0, 30.0, 40.0):
        decision = decide(prefill(ready=1), decode(), CONFIG, state, t)
        assert not decision.changed and decision.held.startswith("the last change is still landing")
        state = decision.state
    assert state.pending is None
    landed = decide(prefill(), decode(), CONFIG, state, 42.0)
    assert not landed.changed and landed.state.pending_since == 42.0  # the downscale delay starts here


def test_a_pool_none_of_whose_replicas_answer_is_named_with_a_reason():
    from deploy.pools.autoscaler import unread_pools

    pools = {
        "prefill": [{"worker_id": "p1", "healthy": False, "error": "the worker directory is not readable"}],
        "decode": [{"worker_id": "d1", "healthy": False, "error": "TimeoutError: "}, _replica("d2")],
        "colocated": [],
    }
    assert unread_pools(pools) == {"prefill": "the worker directory is not readable"}


# ------------------------------------------------------------ KV look-ahead
def _draining(left: tuple[tuple[int, int], ...], kv: float = 0.83, tpot: float = 0.03) -> DecodeSignals:
    """Two decode replicas of 100 blocks each, holding ``left``'s sequences."""
    return replace(decode(running=len(left), kv=kv, tpot=tpot), running_left=left, total_blocks=200)


def test_decode_kv_need_counts_only_what_running_sequences_will_still_hold():
    # 15 sequences with 200 tokens left (6 s at 30 ms: gone within the 10 s look-ahead), 10 blocks
    # each; one with 1000 left (30 s), 16 blocks: of 166 blocks held, 16 will still be
    ending, lasting = ((200, 10),) * 15, ((1000, 16),)
    s = _draining(ending + lasting)
    assert kv_usage_ahead(s, CONFIG) == pytest.approx(0.83 - 150 / 200)
    assert held_need(s, CONFIG) == pytest.approx(2 * max(0.08 / 0.8, 0.03 / 0.05))  # TPOT's pressure now leads
    # no look-ahead, no report, or no TPOT yet: the KV held now
    assert held_need(s, replace(CONFIG, kv_look_ahead_s=0)) == pytest.approx(2 * 0.83 / 0.8)
    assert held_need(replace(s, running_left=None), CONFIG) == pytest.approx(2 * 0.83 / 0.8)
    assert kv_usage_ahead(replace(s, tpot_s=None), CONFIG) == pytest.approx(0.83)
    # a slower TPOT keeps them longer: at 60 ms, 200 tokens take 12 s
    assert kv_usage_ahead(replace(s, tpot_s=0.06), CONFIG) == pytest.approx(0.83)
    # it never goes below nothing (blocks shared by two sequences count twice in their sum)
    assert kv_usage_ahead(_draining(((5, 200),), kv=0.5), CONFIG) == 0.0


def test_prompts_after_long_outputs_get_prefill_the_replica_decode_is_about_to_free():
    """A benchmark's third phase: prompt-heavy again, while decode drains the output-heavy
    phase's sequences (83 % of its KV, all ending within the look-ahead). Prefill wants a third
    replica; decode's held KV alone says it needs both of its own."""
    p = prefill(queued=1500)  # need 3: the queue drains in half the TTFT target
    draining = _draining(((200, 11),) * 15)
    assert prefill_need(p, CONFIG) == pytest.approx(3.0)

    def decisions(config: PolicyConfig) -> list:
        state, out = PolicyState(), []
        for t in range(0, 12, 2):
            d = decide(p, draining, config, state, float(t))
            state = d.state
            out.append(d)
        return out

    ahead = decisions(CONFIG)
    assert [(d.prefill, d.decode) for d in ahead if d.changed] == [(3, 1)]
    # decode's need is now its TPOT's (30 ms of 50, on 2 replicas), not the KV about to be freed
    assert next(d for d in ahead if d.changed).decode_need == pytest.approx(2 * 0.03 / 0.05)
    held = decisions(replace(CONFIG, kv_look_ahead_s=0))
    assert not any(d.changed for d in held) and held[-1].decode_need > 2.0


def test_signals_pool_the_replicas_running_sequences():
    reader = SignalReader()
    p = [_replica("p1")]
    d = [
        _replica("d1", num_running=2, running_left=[[10, 3], [400, 5]]),
        _replica("d2", num_running=1, running_left=[[7, 2]]),
    ]
    _, got = reader.read(0.0, p, d, 1, 2)
    assert got.running_left == ((10, 3), (400, 5), (7, 2)) and got.total_blocks == 200
    older = [d[0], _replica("d2", num_running=1)]  # a replica that does not report them
    _, partial = reader.read(2.0, p, older, 1, 2)
    assert partial.running_left is None


def test_a_replica_slow_to_answer_is_not_a_change_landing():
    """Serve's count of a pool's replicas says whether a change is landing, not the answers: a
    busy replica that missed its stats call's deadline restarted a proposal's delay."""
    from deploy.pools.autoscaling_signals import settled

    slow = {"worker_id": "p2", "healthy": False, "error": "ControlError: Stats missed its deadline"}
    starting = {"worker_id": "p3", "healthy": False, "error": "not registered (starting)", "starting": True}
    assert settled([_replica("p1"), slow], 2)
    assert not settled([_replica("p1"), starting], 2)  # a replica starting
    assert not settled([_replica("p1"), _replica("p2"), _replica("p3")], 2)  # one stopping
    # the idle pools would shrink after the downscale delay; a slow answer does not restart it
    state = PolicyState(last_change=0.0)
    for t in (12.0, 20.0, 33.0):
        decision = decide(replace(prefill(ready=1), settled=True), decode(), CONFIG, state, t)
        state = decision.state
    assert decision.changed and state.last_change == 33.0
    # a replica starting still holds decisions
    starting = replace(prefill(ready=1), settled=False)
    starting_pool = decide(starting, decode(), CONFIG, PolicyState(last_change=0.0), 40.0)
    assert not starting_pool.changed and starting_pool.held.startswith("the last change is still landing")


def test_a_rise_that_every_round_of_the_upscale_delay_read_moves_without_waiting_it_again():
    """Prompts return after an output-heavy phase: prefill's need jumps from 0.05 to 6. The median
    of the 10 s look-back follows only once the rise fills half the window, and then the upscale
    delay started: the move came 14.6 s into a benchmark's phase. A rise read in every round of the
    last upscale delay has held that long: it moves then. One high round does not."""
    from deploy.pools.autoscaling import held_rise

    assert held_rise(((0.0, 1.0, 1.0),), 3.0, 4.0) is None  # the rounds cover less than 4 s
    history = ((0.0, 0.1, 3.0), (2.0, 5.0, 3.0), (4.0, 7.0, 2.0), (6.0, 6.0, 2.5))
    assert held_rise(history, 6.0, 4.0) == (5.0, 2.0)  # rounds at 2, 4 and 6 s: each read at least this

    quiet, busy = prefill(replicas=1, rate=50.0), prefill(replicas=1, queued=6000, rate=1000.0)
    d = decode(replicas=3, running=6, kv=0.3, tpot=0.03)
    state, t = PolicyState(last_change=-100.0), 0.0
    for _ in range(6):  # an output-heavy phase: prefill at 1, decode at 3
        state = decide(quiet, d, CONFIG, state, t).state
        t += 2.0
    moves = []
    for _ in range(6):
        decision = decide(busy, d, CONFIG, state, t)
        state = decision.state
        moves.append((t, decision.changed, decision.prefill))
        t += 2.0
    # prompts from t = 12: rounds at 12, 14 and 16 s read the rise; it moves at 16 s, on 1 -> 3 (a double step)
    assert [m for m in moves if m[1]] == [(16.0, True, 3)]
    # one round's spike between quiet rounds moves nothing
    state, t = PolicyState(last_change=-100.0), 0.0
    for p in (quiet, quiet, quiet, busy, quiet, quiet, quiet):
        decision = decide(p, d, CONFIG, state, t)
        assert not decision.changed
        state, t = decision.state, t + 2.0


def test_decode_inflow_is_summed_over_a_stay_so_a_burst_does_not_read_as_the_rate():
    """Little's law: what is resident is what came over the last stay. 1 hand-over/s of 512
    tokens at 50 ms a token stays 25.6 s; a 2 s burst of 6 hand-overs reads 2.2/s smoothed, and
    (6 + 12 x 2) / 26 s over the stay's reads."""
    reader = SignalReader(block_size=16)

    def p(n: int) -> list[dict]:
        return [
            _replica(
                "p1",
                handed_over=n,
                handed_over_max_tokens=512 * n,
                handed_over_prompt_tokens=64 * n,
                handed_over_prompt_x_max=64 * 512 * n,
                handed_over_max_sq=512 * 512 * n,
            )
        ]

    def d(t: float) -> list[dict]:  # 2 running, 40 tokens/s: 50 ms a token
        return [_replica("d1", total_blocks=448, generated_tokens=round(40 * t), num_running=2)]

    n = 0
    for t in range(0, 42, 2):
        reader.read(float(t), p(n), d(t), 1, 1)
        n += 2
    _, steady = reader.read(42.0, p(n), d(42), 1, 1)
    assert reader.inflow_window() == pytest.approx(512 * 0.05)
    assert steady.inflow_seqs_per_s == pytest.approx(1.0)
    _, burst = reader.read(44.0, p(n + 6), d(44), 1, 1)
    assert reader.rate("handed_over") == pytest.approx(A * 3.0 + B * 1.0)
    assert burst.inflow_seqs_per_s == pytest.approx((6 + 12 * 2) / 26)
    assert burst.expected_output_tokens == pytest.approx(512.0)
    assert burst.inflow_prompt_x_output == pytest.approx(64 * 512) and burst.inflow_output_sq == pytest.approx(512**2)
    config = PolicyConfig(max_total_replicas=4, prefill=PoolBounds(1, 3), decode=PoolBounds(1, 3))
    assert inflow_need(burst, config) == pytest.approx(inflow_need(steady, config) * 30 / 26)


def test_decode_inflow_window_is_at_least_a_few_reads_and_mixes_what_came_in_it():
    """Short outputs stay under a second: the window is INFLOW_WINDOW_MIN_S. Hand-overs of two
    lengths within a window count each with its own max_tokens."""
    reader = SignalReader(block_size=16)

    def p(n: int, asked: int) -> list[dict]:
        return [_replica("p1", handed_over=n, handed_over_max_tokens=asked)]

    def d(t: float) -> list[dict]:
        return [_replica("d1", total_blocks=448, generated_tokens=round(40 * t), num_running=2)]

    reader.read(0.0, p(0, 0), d(0), 1, 1)
    for t in range(2, 12, 2):  # 4 hand-overs of 16 tokens in the first 2 s, then 2 every 2 s
        n = 4 + (t - 2)
        _, short = reader.read(float(t), p(n, 16 * n), d(t), 1, 1)
    assert reader.inflow_window() == INFLOW_WINDOW_MIN_S  # 16 x 50 ms: less than the least window
    assert short.inflow_seqs_per_s == pytest.approx(1.0)  # the last 6 s, not the first read's 2/s
    # two of 512 tokens: the window grows with the mean stay and takes in every read so far
    _, mixed = reader.read(12.0, p(14, 16 * 12 + 2 * 512), d(12), 1, 1)
    assert reader.inflow_window() > 12.0
    assert mixed.inflow_seqs_per_s == pytest.approx(14 / 12)
    assert mixed.expected_output_tokens == pytest.approx((16 * 12 + 2 * 512) / 14)


def test_a_shift_of_the_inflow_reads_the_smoothed_rates_not_the_stays_window():
    """A load starting from idle: 20 s of nothing, then 2 hand-overs/s of 512 tokens for 8 s.
    Over the 25.6 s window they read 16 / 26 s = 0.62/s; its newer half's rate is more than 2
    sigmas from the older's, so the inflow is the smoothed rate (1.95/s), which follows a shift."""
    reader = SignalReader(block_size=16)

    def p(n: int) -> list[dict]:
        return [_replica("p1", handed_over=n, handed_over_max_tokens=512 * n, handed_over_max_sq=512 * 512 * n)]

    def d(t: float) -> list[dict]:  # 2 running, 40 tokens/s: 50 ms a token
        return [_replica("d1", total_blocks=448, generated_tokens=round(40 * t), num_running=2)]

    for t in range(0, 22, 2):
        reader.read(float(t), p(0), d(t), 1, 1)
    for k, t in enumerate(range(22, 30, 2)):
        _, got = reader.read(float(t), p(4 * (k + 1)), d(t), 1, 1)
    window = reader.inflow_rate("handed_over", 512 * 0.05)
    assert window == pytest.approx(16 / 26)
    assert reader.inflow_shifted(512 * 0.05) and reader.inflow_window() is None
    assert got.inflow_seqs_per_s == pytest.approx(reader.rate("handed_over")) and got.inflow_seqs_per_s > 1.9
