"""The routing policies as pure functions: prefix preference, its load override, decode ranking."""

import random

from deploy.pools.routers import demote_failing, least_loaded, power_of_two, rank_by_prefix, rank_for_decode


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
