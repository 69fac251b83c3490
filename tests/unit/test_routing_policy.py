"""The routing policies as pure functions: prefix preference, its load override, decode ranking,
and the cost model for prefixes held in slower tiers."""

import math
import random

from deploy.pools.routers import (
    TierCosts,
    demote_failing,
    least_loaded,
    power_of_two,
    rank_by_cost,
    rank_by_prefix,
    rank_for_decode,
)
from kvstore.record import PrefixMatch


def test_longest_prefix_wins_when_balanced():
    ranks, by_prefix = rank_by_prefix(
        ["a", "b", "c"],
        {"a": 1, "b": 9, "c": 0},
        {"a": 2, "b": 3, "c": 0},
        min_match_blocks=2,
        imbalance_threshold=4,
        rng=random.Random(0),
    )
    assert by_prefix and ranks[0] == ["b"]
    assert sorted(r for rank in ranks for r in rank) == ["a", "b", "c"]


def test_short_match_or_overload_falls_back_to_load():
    _, by_prefix = rank_by_prefix(["a", "b"], {"a": 1, "b": 0}, {}, 2, 4)
    assert not by_prefix
    ranks, by_prefix = rank_by_prefix(["a", "b"], {"a": 9, "b": 0}, {"a": 10, "b": 1}, 2, 4)
    assert not by_prefix and ranks == [["b"], ["a"]]  # the overloaded holder loses to the idle replica


def test_load_alone_goes_to_the_shortest_queue_with_ties_at_random():
    queues = {"a": 1, "b": 0, "c": 1, "d": 0}
    firsts = set()
    for seed in range(20):
        ranks = least_loaded(["a", "b", "c", "d"], queues, rng=random.Random(seed))
        assert all(len(rank) == 1 for rank in ranks)
        order = [rank[0] for rank in ranks]
        assert [queues[r] for r in order] == [0, 0, 1, 1]
        firsts.add(order[0])
    assert firsts == {"b", "d"}  # both idle replicas get first turns
    # the cache-aware fallback (a short match): never a busy replica while one is idle
    ranks, by_prefix = rank_by_prefix(["a", "b", "c"], {"a": 1}, {"a": 1, "b": 1, "c": 0}, 2, 4)
    assert not by_prefix and ranks[0] == ["c"]


def test_power_of_two_orders_the_pair_by_queue():
    ranks = power_of_two(["a", "b", "c", "d"], {"a": 5, "b": 1, "c": 3, "d": 0}, rng=random.Random(1))
    pair = ranks[0]
    assert len(pair) == 2 and {"a": 5, "b": 1, "c": 3, "d": 0}[pair[0]] <= {"a": 5, "b": 1, "c": 3, "d": 0}[pair[1]]
    assert sorted(pair + ranks[1]) == ["a", "b", "c", "d"]


def test_decode_prefers_prefix_holder_that_fits_then_free_blocks():
    ranks = rank_for_decode(["a", "b", "c"], {"a": 6}, {"a": 10, "b": 50, "c": 20}, blocks_needed=8)
    assert [r[0] for r in ranks] == ["a", "b", "c"]
    ranks = rank_for_decode(["a", "b"], {"a": 2}, {"a": 1, "b": 50}, blocks_needed=8)
    assert [r[0] for r in ranks] == ["b", "a"]  # a holds a prefix but has no room for the rest


def test_a_replica_whose_sends_fail_is_tried_last_even_with_the_prefix():
    ranks, by_prefix = rank_by_prefix(["a", "b", "c"], {"a": 9}, {"a": 0, "b": 0, "c": 0}, 2, 8, rng=random.Random(0))
    assert by_prefix and ranks[0] == ["a"]
    demoted = demote_failing(ranks, {"a"})
    assert demoted[-1] == ["a"] and "a" not in sum(demoted[:-1], [])
    assert sorted(sum(demoted, [])) == ["a", "b", "c"]  # nobody dropped


def test_nothing_is_demoted_when_none_or_every_replica_fails():
    ranks = [["a"], ["b", "c"]]
    assert demote_failing(ranks, set()) == ranks
    assert demote_failing(ranks, {"a", "b", "c"}) == ranks
    assert demote_failing(ranks, {"b"}) == [["a"], ["c"], ["b"]]


# Costs exact in binary, so that equal estimates are equal floats.
EXACT = TierCosts(prefill_block_s=0.25, host_block_s=0.0625, disk_block_s=0.125, queued_request_s=1.0)


def order(ranks):
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0] for rank in ranks]


def test_an_idle_replica_with_the_prefix_on_disk_beats_a_busy_one_with_it_on_device():
    matches = {"disk": PrefixMatch(100, disk=100), "device": PrefixMatch(100), "none": PrefixMatch(0)}
    queues = {"disk": 0, "device": 6, "none": 0}
    ranks, by_prefix = rank_by_cost(["device", "none", "disk"], matches, queues, 100)
    # defaults: disk 100 x 1 ms = 0.1 s; none recomputes 100 x 2 ms = 0.2 s; device waits 6 x 50 ms
    assert by_prefix and order(ranks) == ["disk", "none", "device"]


def test_equal_queues_prefer_device_then_host_then_disk_then_recompute():
    matches = {"a": PrefixMatch(10), "b": PrefixMatch(10, host=10), "c": PrefixMatch(10, disk=10)}
    for seed in range(5):
        ranks, by_prefix = rank_by_cost(["d", "c", "b", "a"], matches, {}, 10, rng=random.Random(seed))
        assert by_prefix and order(ranks) == ["a", "b", "c", "d"]


def test_a_match_counts_its_tiers_and_the_rest_is_recomputed():
    # a: 1 queued + 4 host + 4 disk + 2 missing = 1 + 0.25 + 0.5 + 0.5 s; b: 8 on device, 2 missing
    matches = {"a": PrefixMatch(8, host=4, disk=4), "b": PrefixMatch(8)}
    costs = {"a": EXACT, "b": EXACT}
    ranks, _ = rank_by_cost(["a", "b"], matches, {"a": 1, "b": 3}, 10, costs)
    assert order(ranks) == ["a", "b"]  # 2.25 s against 3.5 s
    ranks, _ = rank_by_cost(["a", "b"], matches, {"a": 1, "b": 1}, 10, costs)
    assert order(ranks) == ["b", "a"]  # 1.5 s against 2.25 s


def test_equal_estimates_go_to_the_shorter_queue_then_at_random():
    # a: 1 queued request, the whole 4-block prefix on device (1 s); b: idle, recomputes 4 blocks (1 s)
    costs = {"a": EXACT, "b": EXACT, "c": EXACT}
    ranks, by_prefix = rank_by_cost(["a", "b"], {"a": PrefixMatch(4)}, {"a": 1, "b": 0}, 4, costs)
    assert not by_prefix and order(ranks) == ["b", "a"]
    firsts = set()
    for seed in range(20):
        ranks, _ = rank_by_cost(["a", "b", "c"], {}, {"a": 1}, 4, costs, rng=random.Random(seed))
        assert order(ranks)[2] == "a"
        firsts.add(order(ranks)[0])
    assert firsts == {"b", "c"}


def test_cost_ranking_keeps_the_min_match_and_imbalance_guards():
    # A 1-block host match is below min_match_blocks: no credit, so a and b tie and split at random.
    firsts = set()
    for seed in range(20):
        ranks, by_prefix = rank_by_cost(
            ["a", "b"], {"a": PrefixMatch(1, host=1)}, {}, 8, min_match_blocks=2, rng=random.Random(seed)
        )
        assert not by_prefix
        firsts.add(order(ranks)[0])
    assert firsts == {"a", "b"}
    # A long device prefix on a replica 10 requests behind: without the guard it still wins
    # (10 x 50 ms < 1000 x 2 ms); with an imbalance threshold of 8 it earns no credit.
    matches, queues = {"hot": PrefixMatch(1000)}, {"hot": 10, "idle": 0}
    ranks, by_prefix = rank_by_cost(["hot", "idle"], matches, queues, 1000)
    assert by_prefix and order(ranks) == ["hot", "idle"]
    ranks, by_prefix = rank_by_cost(["hot", "idle"], matches, queues, 1000, imbalance_threshold=8)
    assert not by_prefix and order(ranks) == ["idle", "hot"]


def test_a_replica_publishing_a_slow_disk_loses_its_disk_prefix_to_recompute():
    matches = {"a": PrefixMatch(100, disk=100)}
    slow_disk = TierCosts.from_routing_stats({"disk_load_block_s": 0.01})
    ranks, by_prefix = rank_by_cost(["a", "b"], matches, {}, 100, {"a": slow_disk})
    assert not by_prefix and order(ranks) == ["b", "a"]  # 1 s to load against 0.2 s to recompute


def test_tier_costs_read_from_routing_stats_tolerate_absent_and_unusable_values():
    assert TierCosts.from_routing_stats({}) == TierCosts()
    stats = {
        "prefill_block_s": "0.004",
        "host_load_block_s": 0.0001,
        "disk_load_block_s": -1,
        "queued_request_s": math.nan,
        "num_running": 3,
    }
    assert TierCosts.from_routing_stats(stats) == TierCosts(prefill_block_s=0.004, host_block_s=0.0001)
    assert TierCosts.from_routing_stats({"queued_request_s": None, "prefill_block_s": "slow"}, EXACT) == EXACT
    assert TierCosts.from_routing_stats({"host_load_block_s": 0}, EXACT) == TierCosts(0.25, 0.0, 0.125, 1.0)
