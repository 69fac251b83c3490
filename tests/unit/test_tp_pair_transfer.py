"""KV transfer between tensor-parallel groups over real gloo pair groups: prefill ranks and decode
ranks (threads of this process, each pair its own 2-rank process group, as between workers) move a
request's blocks by the head plan, and every decode rank ends up with exactly its heads of those
blocks, bit for bit, having received exactly their bytes."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from cluster.local import find_free_port
from workers.protocol import KVLayout
from workers.transfer.config import Transport
from workers.transfer.pair import DECODE_RANK, PREFILL_RANK, PairGroup
from workers.transfer.tp_plan import heads_of_rank, plan_tp_transfer

HEADS, LAYERS, BLOCKS, DIM = 4, 2, 10, 8


def rank_cache(full: list[torch.Tensor], heads: range) -> list[torch.Tensor]:
    return [layer[:, :, :, heads.start : heads.stop].contiguous() for layer in full]


def run_transfer(full, dtype, rows, prefill_tp, decode_tp, src_blocks, dst_blocks):
    plan = plan_tp_transfer(HEADS, prefill_tp, decode_tp)
    block_size = rows - 1 if dtype == torch.int8 else rows
    prefill = [rank_cache(full, heads_of_rank(HEADS, prefill_tp, r)) for r in range(prefill_tp)]
    decode = [
        [torch.zeros_like(c) for c in rank_cache(full, heads_of_rank(HEADS, decode_tp, r))] for r in range(decode_tp)
    ]
    name = str(dtype).removeprefix("torch.")
    layouts = {
        (side, r): KVLayout(LAYERS, block_size, len(heads_of_rank(HEADS, tp, r)), DIM, name)
        for side, tp in (("p", prefill_tp), ("d", decode_tp))
        for r in range(tp)
    }
    port = find_free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    deadline = time.monotonic() + 60
    received = [0] * decode_tp
    errors: list[BaseException] = []

    def side(rank: int, pair: tuple[int, int]) -> None:
        p, d = pair
        try:
            group = PairGroup.create(
                store_host="127.0.0.1",
                store_port=port,
                bind_host="127.0.0.1",
                peer_id=f"peer-{p}-{d}",
                decode_worker_id=f"decode-{d}-from-{p}",
                epoch=1,
                rank=rank,
                transport=Transport.GLOO,
                device=torch.device("cpu"),
                deadline=deadline,
                buffer_cache_bytes=1 << 20,
            )
            try:
                for s in plan.slices:
                    if (s.prefill_rank, s.decode_rank) != pair:
                        continue
                    tag = s.dst.start  # one message per slice, in plan order on both sides
                    if rank == PREFILL_RANK:
                        group.send(prefill[p], src_blocks, layouts["p", p], tag, deadline, heads=s.src)
                    else:
                        n = group.recv(decode[d], dst_blocks, layouts["d", d], tag, deadline, heads=s.dst)
                        received[d] += n
            finally:
                group.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread below
            errors.append(exc)

    threads = [
        threading.Thread(target=side, args=(rank, pair)) for pair in plan.pairs for rank in (PREFILL_RANK, DECODE_RANK)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    del master
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return decode, received


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_each_decode_rank_receives_exactly_its_head_slice(prefill_tp, decode_tp, dtype):
    rows = 4 + (1 if dtype == torch.int8 else 0)  # an int8 block carries its scale row
    gen = torch.Generator().manual_seed(prefill_tp * 10 + decode_tp)
    full = [(torch.randint(-100, 100, (2, BLOCKS, rows, HEADS, DIM), generator=gen)).to(dtype) for _ in range(LAYERS)]
    src_blocks, dst_blocks = [7, 2, 5], [0, 9, 3]
    decode, received = run_transfer(full, dtype, rows, prefill_tp, decode_tp, src_blocks, dst_blocks)
    element = torch.empty((), dtype=dtype).element_size()
    for rank in range(decode_tp):
        mine = heads_of_rank(HEADS, decode_tp, rank)
        expect = rank_cache(full, mine)
        assert received[rank] == LAYERS * 2 * len(src_blocks) * rows * len(mine) * DIM * element
        for layer in range(LAYERS):
            assert torch.equal(decode[rank][layer][:, dst_blocks], expect[layer][:, src_blocks])
            untouched = [b for b in range(BLOCKS) if b not in dst_blocks]
            assert not decode[rank][layer][:, untouched].any()
