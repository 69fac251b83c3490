"""The head plan of a KV transfer between tensor-parallel groups of any sizes: every decode rank
receives exactly the heads it holds, once, from prefill ranks that hold them."""

from __future__ import annotations

import itertools

import pytest
import torch

from workers.transfer.tp_plan import heads_of_rank, plan_tp_transfer


@pytest.mark.parametrize(
    ("num_kv_heads", "prefill_tp", "decode_tp"),
    [
        (h, p, d)
        for h, p, d in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2, 4))
        if (h % p == 0 or p % h == 0) and (h % d == 0 or d % h == 0)
    ],
)
def test_each_decode_rank_gets_exactly_its_heads_from_holders(num_kv_heads, prefill_tp, decode_tp):
    plan = plan_tp_transfer(num_kv_heads, prefill_tp, decode_tp)
    for d in range(decode_tp):
        wanted = heads_of_rank(num_kv_heads, decode_tp, d)
        got = [h for s in plan.receives(d) for h in s.heads]
        assert sorted(got) == list(wanted)  # each head once, none missing
        for s in plan.receives(d):
            held = heads_of_rank(num_kv_heads, prefill_tp, s.prefill_rank)
            assert set(s.heads) <= set(held)
            assert [held[i] for i in s.src] == list(s.heads) and [wanted[i] for i in s.dst] == list(s.heads)
    assert plan.pairs == sorted({(s.prefill_rank, s.decode_rank) for s in plan.slices})


def test_equal_sizes_pair_rank_with_rank_and_mixed_sizes_fan_in_or_out():
    assert plan_tp_transfer(8, 2, 2).pairs == [(0, 0), (1, 1)]
    assert plan_tp_transfer(8, 1, 2).pairs == [(0, 0), (0, 1)]  # 1 -> 2: rank 0 sends each half
    two_to_one = plan_tp_transfer(8, 2, 1)
    assert two_to_one.pairs == [(0, 0), (1, 0)]
    assert [(s.src, s.dst) for s in two_to_one.receives(0)] == [(range(0, 4), range(0, 4)), (range(0, 4), range(4, 8))]


def test_replicated_heads_spread_over_their_holders():
    # 2 KV heads over 4 prefill ranks (each head on two of them) to 4 decode ranks likewise
    plan = plan_tp_transfer(2, 4, 4)
    assert plan.pairs == [(0, 0), (1, 1), (2, 2), (3, 3)]
    sends = [len(plan.sends(p)) for p in range(4)]
    assert sends == [1, 1, 1, 1]


def test_a_transfer_moves_the_head_slices_bit_for_bit():
    """Slicing a [2, blocks, rows, heads, dim] cache by the plan rebuilds each decode rank's cache."""
    heads, blocks, rows, dim = 4, 3, 17, 8  # 17 rows: a quantized block's scale row travels too
    full = torch.randn(2, blocks, rows, heads, dim)
    for p, d in [(1, 2), (2, 1), (2, 2), (4, 2), (2, 4)]:
        prefill = [full[:, :, :, list(heads_of_rank(heads, p, r))] for r in range(p)]
        plan = plan_tp_transfer(heads, p, d)
        for rank in range(d):
            mine = heads_of_rank(heads, d, rank)
            out = torch.empty(2, blocks, rows, len(mine), dim)
            for s in plan.receives(rank):
                out[:, :, :, s.dst.start : s.dst.stop] = prefill[s.prefill_rank][:, :, :, s.src.start : s.src.stop]
            assert torch.equal(out, full[:, :, :, list(mine)])


def test_sizes_the_heads_do_not_allow_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 and the model's 4 KV heads"):
        plan_tp_transfer(4, 3, 1)
    with pytest.raises(ValueError, match="rank 2 is outside a tensor-parallel group of 2"):
        heads_of_rank(4, 2, 2)
