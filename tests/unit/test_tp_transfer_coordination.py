"""The pure parts of transfers between tensor-parallel replicas (workers/transfer/tp_transfer.py):
pair epochs (reused while a pair lives, new after it failed or its prefill replica restarted),
a rank's pairs running at once (every pair tried even when one fails), and the ops and reports
that cross the rank store as JSON."""

from __future__ import annotations

from workers.protocol import KVHandle, KVLayout, PairTransfer, TransferAddress, TransferRequest, decode, encode
from workers.transfer.tp_transfer import (
    PairEpochs,
    RankOp,
    RankPair,
    RankReport,
    model_layout,
    rank_worker_id,
    run_pairs,
)


def test_a_pair_keeps_its_epoch_until_it_fails_or_its_peer_restarts():
    epochs = PairEpochs()
    first = epochs.get("p", 7, 0, 1)
    assert epochs.get("p", 7, 0, 1) == first  # the live group is reused
    other = epochs.get("p", 7, 1, 1)
    assert other != first  # each pair its own group
    epochs.spoil("p", 0, 1)
    after_failure = epochs.get("p", 7, 0, 1)
    assert after_failure > first and epochs.get("p", 7, 1, 1) == other  # only the failed pair moves on
    restarted = epochs.get("p", 8, 1, 1)  # a new generation: the peer's end of every group is gone
    assert restarted > after_failure
    epochs.forget("p")
    assert epochs.get("p", 8, 1, 1) > restarted


def pair(peer_rank: int) -> RankPair:
    return RankPair(peer_rank, f"w/r{peer_rank}", 5, "gloo", 0, 1)


def test_a_rank_runs_its_pairs_at_once_and_a_failed_one_does_not_stop_the_others():
    import threading

    started: list[int] = []
    all_in = threading.Barrier(4, timeout=10)  # passes only if all four pairs run at the same time

    def move(p: RankPair, deadline: float) -> tuple[int, bool]:
        started.append(p.peer_rank)
        all_in.wait()
        if p.peer_rank == 1:
            raise TimeoutError("deadline passed")
        return 100 * (p.peer_rank + 1), p.peer_rank == 2

    report = run_pairs([pair(3), pair(1), pair(0), pair(2)], move, deadline=0.0)
    assert sorted(started) == [0, 1, 2, 3]
    assert not report.ok and report.failed_peers == (1,) and "deadline passed" in report.error
    assert report.num_bytes == 100 + 300 + 400 and report.created
    clean = run_pairs([pair(0)], lambda p, d: (8, False), deadline=0.0)
    assert clean == RankReport(True, 8, False)


def test_ops_reports_and_requests_cross_as_json():
    address = TransferAddress("10.0.0.2", 4100, rank_worker_id("prefill-a", 1), "node", generation=9)
    op = RankOp("recv", {1: (RankPair(1, address.worker_id, 5, "gloo", 0, 1, address),)}, "req", 3, (4, 5), 2.5)
    back = decode(RankOp, encode(op))
    assert back == op and list(back.pairs) == [1]  # JSON's string keys come back as ranks
    report = RankReport(True, address=address)
    assert decode(RankReport, encode(report)) == report
    layout = KVLayout(2, 16, 1, 8, "float32")
    whole = model_layout(layout, 2)
    assert whole.num_kv_heads == 2 and whole.bytes_per_block == 2 * layout.bytes_per_block
    request = TransferRequest("req", "decode-a", 5, (1, 2), whole, "gloo", 3, (PairTransfer(1, 0, 5, "gloo", 0, 1),))
    assert decode(TransferRequest, encode(request)) == request
    handle = KVHandle("req", "prefill-a", address, (1, 2), 20, whole, 0.0, 2, (address, address))
    assert decode(KVHandle, encode(handle)) == handle


def test_a_tensor_parallel_handle_names_every_rank():
    import pytest

    address = TransferAddress("h", 1, "p/r0")
    layout = KVLayout(2, 16, 2, 8, "float32")
    with pytest.raises(ValueError, match="names 1 rank addresses; it needs one per rank"):
        KVHandle("req", "p", address, (1,), 5, layout, 0.0, 2, (address,))
    with pytest.raises(ValueError, match="pair heads"):
        PairTransfer(0, 0, 1, "gloo", 1, 1)


def test_a_pair_of_different_models_or_block_sizes_is_refused_before_any_traffic():
    import pytest
    import torch

    from workers.transfer import TransferConfig
    from workers.transfer.tp_transfer import TPPuller

    # This decode replica: TP 2 over a model of 2 KV heads, so one head per rank, blocks of 16.
    puller = TPPuller("decode-a", TransferConfig(), torch.device("cpu"), 2, 2, None, None)
    kv = [torch.zeros(2, 8, 16, 1, 8) for _ in range(2)]
    address = TransferAddress("127.0.0.1", 1, "prefill-a")

    def handle(layout: KVLayout) -> KVHandle:
        return KVHandle("req", "prefill-a", address, (1, 2), 20, layout, 1e12)

    def refused():
        raise AssertionError("no Send may go out for a refused pair")

    for layout, field in (
        (KVLayout(2, 32, 2, 8, "float32"), "block_size"),
        (KVLayout(2, 16, 4, 8, "float32"), "num_kv_heads"),
    ):
        with pytest.raises(ValueError, match=f"{field} .* on decode but .* on prefill"):
            puller.pull(handle(layout), kv, [3, 4], lambda r: refused(), src_block_ids=[1, 2], timeout_s=1.0)
    puller.close()
