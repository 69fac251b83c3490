"""KV transfer between two processes with CUDA KV caches: NCCL across two GPUs, gloo staged
through pinned host memory when both ranks share one GPU (NCCL refuses that). Same exact-bytes,
stall and kill checks as tests/integration/test_transfer.py."""

from __future__ import annotations

import pytest
import torch

from tests.integration.transfer_peers import (
    LAYOUTS,
    NUM_BLOCKS,
    await_address,
    block_digest,
    make_handle,
    make_kv_caches,
    relay_pull,
    start_peer,
)
from workers import protocol

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


# (prefill's GPU, decode's GPU, transport AUTO must pick). Each peer sees only its own GPU, as
# Ray runs replicas (CUDA_VISIBLE_DEVICES set to it, the engine on cuda:0).
CASES = {
    "nccl_two_gpus": ("0", "1", "nccl"),
    "gloo_staged_one_gpu": ("0", "0", "gloo_staged"),
}


@pytest.fixture(params=list(CASES))
def gpu_peers(request):
    prefill_gpu, decode_gpu, transport = CASES[request.param]
    if max(int(prefill_gpu), int(decode_gpu)) >= torch.cuda.device_count():
        pytest.skip(f"{request.param} needs {max(int(prefill_gpu), int(decode_gpu)) + 1} GPUs")
    prefill = start_peer("prefill", f"gpu-prefill-{request.param}", 1, device="cuda:0", visible=prefill_gpu)
    decode = start_peer("decode", f"gpu-decode-{request.param}", 2, device="cuda:0", visible=decode_gpu)
    doomed = start_peer("prefill", f"gpu-doomed-{request.param}", 4, device="cuda:0", visible=prefill_gpu)
    # flips one byte of each message on the device after the Triton kernel checksummed it
    corrupting = start_peer(
        "prefill", f"gpu-corrupt-{request.param}", 6, {"fault_corrupt_bytes": 1}, device="cuda:0", visible=prefill_gpu
    )
    for peer in (prefill, doomed, corrupting):
        await_address(peer, timeout_s=120)
    yield prefill, decode, doomed, corrupting, transport
    for peer in (decode, prefill, doomed, corrupting):
        peer.stop()


def check_exact(outcome, sender, seed, src, dst, transport, dtype="float32") -> protocol.TransferStats:
    kind, result = outcome
    assert kind == "pulled", result
    assert sender is not None and sender[0] == "sent", sender
    assert result["digest"] == block_digest(make_kv_caches(LAYOUTS[dtype], NUM_BLOCKS, seed), src)
    assert result["others_untouched"] and result["num_free"] == NUM_BLOCKS
    stats = protocol.decode(protocol.TransferStats, result["stats"])
    assert stats.transport == transport
    return stats


def test_gpu_transfer_exact_then_survives_stall_kill_and_corruption(gpu_peers):
    prefill, decode, doomed, corrupting, transport = gpu_peers
    sets = [
        (list(range(10, 42)), list(range(500, 532))),
        ([3, 77, 5, 900, 42, 1099, 0], [1000, 2, 640, 11, 12, 300, 7]),
        ([17], [1099]),
        (list(range(1000)), list(range(1099, 99, -1))),
    ]
    for i, (src, dst) in enumerate(sets):
        outcome, sender = relay_pull(prefill, decode, make_handle(prefill, f"g{i}", src), dst, timeout_s=60)
        check_exact(outcome, sender, 1, src, dst, transport)
    src, dst = [9, 1, 700, 33], [4, 1098, 250, 60]
    outcome, sender = relay_pull(prefill, decode, make_handle(prefill, "g-bf16", src, "bfloat16"), dst, timeout_s=60)
    live_epoch = check_exact(outcome, sender, 1, src, dst, transport, "bfloat16").epoch

    timeout_s = 2.0
    (kind, result), sender = relay_pull(
        prefill, decode, make_handle(prefill, "g-stall", src), dst, timeout_s=timeout_s, stall_s=timeout_s + 1.0
    )
    assert kind == "pull_failed", result
    assert result["num_free"] == NUM_BLOCKS  # failed (only the deadline can fail it), and freed
    outcome, sender = relay_pull(prefill, decode, make_handle(prefill, "g-after-stall", src), dst, timeout_s=60)
    assert check_exact(outcome, sender, 1, src, dst, transport).epoch > live_epoch

    (kind, result), _ = relay_pull(
        doomed,
        decode,
        make_handle(doomed, "g-doomed", src),
        dst,
        timeout_s=timeout_s,
        prefill_cmd="connect_then_die",
        wait_sender=False,
    )
    assert kind == "pull_failed", result
    assert result["freed"] == dst
    outcome, sender = relay_pull(prefill, decode, make_handle(prefill, "g-after-kill", src), dst, timeout_s=60)
    check_exact(outcome, sender, 1, src, dst, transport)

    for dtype in ("float32", "bfloat16", "int8"):  # every corrupted message caught on the device
        (kind, result), _ = relay_pull(
            corrupting, decode, make_handle(corrupting, f"g-corrupt-{dtype}", src, dtype), dst, timeout_s=60
        )
        assert kind == "pull_failed" and len(result["corrupt_blocks"]) == 1, result
        assert result["num_free"] == NUM_BLOCKS
    outcome, sender = relay_pull(prefill, decode, make_handle(prefill, "g-after-corrupt", src), dst, timeout_s=60)
    check_exact(outcome, sender, 1, src, dst, transport)
