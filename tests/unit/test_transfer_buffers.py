"""Gather/scatter by block id, input validation, and transport selection (single process)."""

from __future__ import annotations

import pytest
import torch

from workers.protocol import KVLayout, TransferAddress
from workers.transfer import Transport, gather_blocks, layout_of, scatter_blocks
from workers.transfer.buffers import buffer_shape, check_block_ids
from workers.transfer.client import transfer_tag
from workers.transfer.device import resolve_transport

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=2, dtype="float32")


def caches(num_blocks: int, offset: float = 0.0) -> list[torch.Tensor]:
    numel = 2 * num_blocks * 4 * 2 * 2
    return [
        torch.arange(numel, dtype=torch.float32).view(2, num_blocks, 4, 2, 2) + 1000 * layer + offset
        for layer in range(3)
    ]


def test_gather_then_scatter_moves_exactly_the_named_blocks():
    src, dst = caches(8), caches(8, offset=0.5)
    untouched = [c.clone() for c in dst]
    buf = torch.empty(buffer_shape(LAYOUT, 3))
    gather_blocks(src, [6, 0, 3], buf)
    assert torch.equal(buf[1, :, 0], src[1][:, 6])
    scatter_blocks(buf, dst, [1, 7, 2])
    for layer in range(3):
        for s, d in [(6, 1), (0, 7), (3, 2)]:
            assert torch.equal(dst[layer][:, d], src[layer][:, s])
        for other in [0, 3, 4, 5, 6]:
            assert torch.equal(dst[layer][:, other], untouched[layer][:, other])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize(
    "dtype,dims", [(torch.bfloat16, (1, 1, 3)), (torch.float16, (2, 1, 2)), (torch.float32, (16, 2, 8))]
)
def test_scatter_is_bit_exact_for_any_row_width(dtype, dims):
    # rows of 6, 8 and 1024 bytes: the byte-wide fallback, int64 and complex128 views
    src = [torch.randn(2, 6, *dims).to(dtype) for _ in range(2)]
    src[0][0, 4].view(-1)[0] = float("nan")
    dst = [torch.zeros(2, 6, *dims, dtype=dtype) for _ in range(2)]
    buf = torch.empty(2, 2, 3, *dims, dtype=dtype)
    gather_blocks(src, [4, 1, 5], buf)
    scatter_blocks(buf, dst, [0, 3, 2])
    for s, d in zip(src, dst):
        assert torch.equal(bits(d[:, [0, 3, 2]]), bits(s[:, [4, 1, 5]]))  # NaN included
        assert not d[:, [1, 4, 5]].any()


def test_layout_of_reads_the_engine_cache_and_rejects_mixed_layers():
    assert layout_of(caches(8)) == LAYOUT
    mixed = caches(8)
    mixed[2] = mixed[2].to(torch.bfloat16)
    with pytest.raises(ValueError, match="layer 2"):
        layout_of(mixed)
    with pytest.raises(ValueError, match="expected"):
        layout_of([torch.zeros(8, 4, 2, 2)])


def test_block_id_checks_name_the_problem():
    check_block_ids([0, 7], 8, "dst_block_ids", unique=True)
    with pytest.raises(ValueError, match=r"outside \[0, 8\): \[8, -1\]"):
        check_block_ids([1, 8, -1], 8, "src_block_ids")
    with pytest.raises(ValueError, match="twice"):
        check_block_ids([1, 1], 8, "dst_block_ids", unique=True)
    with pytest.raises(ValueError, match="empty"):
        check_block_ids([], 8, "dst_block_ids")


def addr(node: str, device_type: str = "cuda", index: int = 0, uuid: str = "") -> TransferAddress:
    return TransferAddress("h", 1, "w", node, device_type, index, uuid)


def test_transport_selection():
    cpu = addr("n1", "cpu")
    assert resolve_transport(Transport.AUTO, cpu, cpu) is Transport.GLOO
    assert resolve_transport(Transport.OBJECT_STORE, cpu, cpu) is Transport.OBJECT_STORE
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_transport(Transport.NCCL, cpu, cpu)
    with pytest.raises(ValueError, match="same kind of device"):
        resolve_transport(Transport.AUTO, cpu, addr("n1"))
    same = addr("n1", uuid="GPU-a"), addr("n1", index=1, uuid="GPU-a")
    assert resolve_transport(Transport.AUTO, *same) is Transport.GLOO_STAGED
    with pytest.raises(ValueError, match="refused by NCCL"):
        resolve_transport(Transport.NCCL, *same)
    assert resolve_transport(Transport.GLOO, addr("n1"), addr("n2")) is Transport.GLOO_STAGED


def test_transfer_tag_is_a_stable_non_negative_int32():
    assert transfer_tag("req-1") == transfer_tag("req-1")
    assert 0 <= transfer_tag("req-1") < 2**31
    assert transfer_tag("req-1") != transfer_tag("req-2")
