"""KV transfer between real processes (spawned, gloo on CPU): exact bytes, re-pairing, failures.

The test process plays the control plane (Ray calls in production): it relays the decode peer's
TransferRequest to the prefill peer, which sends while the decode peer receives.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.integration.transfer_peers import (
    LAYOUTS,
    NUM_BLOCKS,
    await_address,
    block_digest,
    make_handle,
    make_kv_caches,
    relay_connect,
    relay_pull,
    start_peer,
)
from workers.protocol import TransferStats, decode

PREFILL_SEED = 1


def expected_digest(seed: int, src: list[int], dtype: str = "float32") -> str:
    return block_digest(make_kv_caches(LAYOUTS[dtype], NUM_BLOCKS, seed), src)


@pytest.fixture(scope="module")
def cluster():
    """Every peer the module needs, started at once (each spends seconds importing torch)."""
    seeds = {"prefill-a": PREFILL_SEED, "decode-b": 2, "decode-c": 3, "prefill-d": 4, "prefill-e": 5, "prefill-f": 6}
    configs = {"prefill-f": {"fault_corrupt_bytes": 1}}  # flips one byte of each message it sends
    started = {name: start_peer(name.split("-")[0], name, seed, configs.get(name)) for name, seed in seeds.items()}
    for name, peer in started.items():
        if name.startswith("prefill"):
            await_address(peer)
    yield started
    for peer in started.values():
        peer.request_stop()
    for peer in started.values():
        peer.stop()


@pytest.fixture
def peers(cluster):
    return cluster["prefill-a"], cluster["decode-b"]


def assert_exact_pull(
    outcome, sender, seed: int, src: list[int], dst: list[int], dtype: str = "float32"
) -> TransferStats:
    kind, result = outcome
    assert kind == "pulled", result
    assert sender is not None and sender[0] == "sent", sender
    assert result["digest"] == expected_digest(seed, src, dtype)
    assert result["others_untouched"]
    assert result["num_free"] == NUM_BLOCKS
    stats = decode(TransferStats, result["stats"])
    assert stats.num_blocks == len(src)
    assert stats.num_bytes == len(src) * LAYOUTS[dtype].bytes_per_block
    return stats


BLOCK_SETS = {
    "contiguous": (list(range(10, 42)), list(range(500, 532))),
    "scattered": ([3, 77, 5, 900, 42, 1099, 0], [1000, 2, 640, 11, 12, 300, 7]),
    "one_block": ([17], [1099]),
    "thousand_blocks": (list(range(1000)), random.Random(0).sample(range(NUM_BLOCKS), 1000)),
}


def test_blocks_arrive_byte_for_byte_over_one_pair_group(peers):
    prefill, decode = peers
    epochs = []
    for name, (src, dst) in BLOCK_SETS.items():
        handle = make_handle(prefill, f"req-{name}", src)
        outcome, sender = relay_pull(prefill, decode, handle, dst)
        epochs.append(assert_exact_pull(outcome, sender, PREFILL_SEED, src, dst).epoch)
    assert len(set(epochs)) == 1  # the pair group made by the first transfer is reused


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "float8_e4m3fn"])
def test_other_kv_dtypes_arrive_byte_for_byte(peers, dtype):
    prefill, decode = peers
    src, dst = [9, 1, 700, 33], [4, 1098, 250, 60]
    handle = make_handle(prefill, f"req-{dtype}", src, dtype=dtype)
    outcome, sender = relay_pull(prefill, decode, handle, dst)
    stats = assert_exact_pull(outcome, sender, PREFILL_SEED, src, dst, dtype=dtype)
    if dtype != "bfloat16":  # quantized: scales travel in the block, a bit over half of bf16's bytes
        assert stats.num_bytes == 17 * len(src) * LAYOUTS["bfloat16"].bytes_per_block // 32


def test_layout_mismatch_is_rejected_before_any_traffic(peers):
    prefill, decode = peers
    handle = make_handle(prefill, "req-mismatch", [1, 2], dtype="float32")
    wrong = dataclasses.replace(handle, layout=dataclasses.replace(handle.layout, block_size=32))
    kind, result = relay_pull(prefill, decode, wrong, [5, 6])[0]
    assert kind == "rejected", result  # raised before the request reaches the prefill side
    assert "block_size 16 on decode but 32 on prefill" in result["error"]


def test_second_decode_worker_pairs_with_running_prefill(peers, cluster):
    prefill, first_decode = peers
    second = cluster["decode-c"]
    decode_epoch, prefill_epoch = relay_connect(prefill, second)  # eager pairing
    assert decode_epoch == prefill_epoch
    src, dst = [8, 9, 10, 400], [0, 1, 2, 3]
    outcome, sender = relay_pull(prefill, second, make_handle(prefill, "req-c1", src), dst)
    stats = assert_exact_pull(outcome, sender, PREFILL_SEED, src, dst)
    assert not stats.created_pair and stats.epoch == decode_epoch
    outcome, sender = relay_pull(prefill, first_decode, make_handle(prefill, "req-b2", src), dst)
    assert not assert_exact_pull(outcome, sender, PREFILL_SEED, src, dst).created_pair


def test_stalled_sender_fails_within_deadline_then_pair_is_recreated(peers):
    prefill, decode = peers
    src, dst = list(range(64)), list(range(200, 264))
    ok, sender = relay_pull(prefill, decode, make_handle(prefill, "req-before-stall", src), dst)
    live_epoch = assert_exact_pull(ok, sender, PREFILL_SEED, src, dst).epoch

    timeout_s = 1.0
    (kind, result), sender = relay_pull(
        prefill, decode, make_handle(prefill, "req-stall", src), dst, timeout_s=timeout_s, stall_s=timeout_s + 0.5
    )
    # The sender sends once its stall ends: only the deadline can make this pull fail (no wall-clock
    # assertion: a loaded machine must not fail a correct build; pytest's timeout catches a hang).
    assert kind == "pull_failed", result
    assert result["freed"] == dst and result["num_free"] == NUM_BLOCKS
    assert sender[0] == "send_failed"  # its group was torn down under it; it is dropped too

    ok, sender = relay_pull(prefill, decode, make_handle(prefill, "req-after-stall", src), dst)
    stats = assert_exact_pull(ok, sender, PREFILL_SEED, src, dst)
    assert stats.created_pair and stats.epoch > live_epoch


def test_killed_sender_fails_within_deadline_and_a_new_prefill_works(peers, cluster):
    _, decode = peers
    doomed, replacement = cluster["prefill-d"], cluster["prefill-e"]
    src, dst = list(range(100, 300)), list(range(0, 200))
    timeout_s = 3.0
    (kind, result), _ = relay_pull(
        doomed,
        decode,
        make_handle(doomed, "req-doomed", src),
        dst,
        timeout_s=timeout_s,
        prefill_cmd="connect_then_die",
        wait_sender=False,
    )
    assert kind == "pull_failed", result
    assert result["freed"] == dst and result["num_free"] == NUM_BLOCKS
    doomed.process.join(10)
    assert doomed.process.exitcode == -9

    outcome, sender = relay_pull(replacement, decode, make_handle(replacement, "req-replacement", src), dst)
    assert assert_exact_pull(outcome, sender, 5, src, dst).created_pair


def test_a_byte_corrupted_in_flight_is_caught_every_time_and_the_pair_goes_on(peers, cluster):
    """The sender flips one random byte of each message after checksumming it: every pull fails
    as corrupt, naming the one block hit, and frees its blocks; a clean sender's pull that follows
    over the same decode worker is exact."""
    _, decode = peers
    corrupting = cluster["prefill-f"]
    rng = random.Random(7)
    for i in range(24):
        dtype = ("float32", "bfloat16", "int8", "float8_e4m3fn")[i % 4]
        src = rng.sample(range(NUM_BLOCKS), rng.choice((1, 3, 40)))
        dst = rng.sample(range(NUM_BLOCKS), len(src))
        (kind, result), sender = relay_pull(
            corrupting, decode, make_handle(corrupting, f"req-bad-{i}", src, dtype), dst
        )
        assert kind == "pull_failed", result
        assert len(result["corrupt_blocks"]) == 1 and 0 <= result["corrupt_blocks"][0] < len(src), result
        assert result["freed"] == dst and result["num_free"] == NUM_BLOCKS
    prefill = cluster["prefill-a"]
    src, dst = [12, 3, 900], [5, 6, 7]
    outcome, sender = relay_pull(prefill, decode, make_handle(prefill, "req-clean", src), dst)
    assert_exact_pull(outcome, sender, PREFILL_SEED, src, dst)


def test_object_store_fallback_moves_exact_bytes():
    ray = pytest.importorskip("ray")
    from tests.integration.transfer_peers import ObjectStorePrefill, Peer
    from workers.transfer import KVTransferClient, TransferConfig

    started = not ray.is_initialized()  # the Serve tests' session cluster may already be up
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        prefill = ray.remote(ObjectStorePrefill).remote("prefill-ray", PREFILL_SEED)
        address = ray.get(prefill.address.remote(), timeout=120)
        src, dst = [5, 0, 64, 1000, 33], [7, 8, 9, 10, 1099]
        kv = make_kv_caches(LAYOUTS["float32"], NUM_BLOCKS, seed=6)
        others = sorted(set(range(NUM_BLOCKS)) - set(dst))
        before = block_digest(kv, others)
        client = KVTransferClient("decode-ray", TransferConfig(transport="object_store"))
        handle = make_handle(Peer("prefill-ray", None, None, address), "req-ray", src)
        stats = client.pull(handle, kv, dst, lambda req: prefill.send.remote(req), timeout_s=60)
        assert stats.transport == "object_store"
        assert block_digest(kv, dst) == expected_digest(PREFILL_SEED, src)
        assert block_digest(kv, others) == before
    finally:
        if started:
            ray.shutdown()
