"""The transferred blocks' checksum (workers/transfer/checksum.py): its implementations agree with
the torch definition bit for bit (the CPU kernel fused into gather and scatter, the Triton kernel
under its interpreter here and on CUDA where there is one), and it catches what it promises to:
every changed word, words moved, one block's bytes in another's place."""

from __future__ import annotations

import random

import pytest
import torch

from workers.backends.cpu import checksum as cpu
from workers.backends.cuda import triton_checksum
from workers.protocol import KVLayout
from workers.transfer import checksum
from workers.transfer.buffers import gather_blocks, scatter_blocks
from workers.transfer.pair import Wire, checksums_fit

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)


def caches(dtype: torch.dtype, layers: int = 3, blocks: int = 12, rows: int = 16, heads: int = 4, dim: int = 64):
    gen = torch.Generator().manual_seed(1)
    shape = (2, blocks, rows, heads, dim)
    if dtype.is_floating_point and dtype.itemsize > 1:
        return [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    return [torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype) for _ in range(layers)]


def wire_of(kv: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    return gather_blocks(kv, ids, torch.empty((len(kv), 2, len(ids), *kv[0].shape[2:]), dtype=kv[0].dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cpu_kernel_gathers_scatters_and_sums_as_the_definition(dtype):
    assert cpu.usable()
    kv = caches(dtype, rows=17 if dtype.itemsize == 1 else 16)  # quantized: a scale row per block
    for heads in (range(0, 4), range(1, 3)):  # whole caches, and a tensor-parallel peer's heads
        views = [c[:, :, :, heads.start : heads.stop] for c in kv]
        ids = [11, 0, 5, 5, 2]
        expected = wire_of(views, ids)
        out = torch.empty_like(expected)
        sums = checksum.gather(views, ids, out)
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(sums, checksum.reference_sums(expected))
        assert torch.equal(cpu.block_sums(expected), sums)
        targets = [torch.zeros_like(c) for c in kv]
        tviews = [t[:, :, :, heads.start : heads.stop] for t in targets]
        received = checksum.scatter(expected[:, :, :4].contiguous(), tviews, [3, 7, 8, 1])
        assert torch.equal(received, sums[:4])
        for source, target in zip(views, tviews, strict=True):
            assert torch.equal(target[:, [3, 7, 8, 1]].view(torch.uint8), source[:, ids[:4]].view(torch.uint8))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int8), ids=str)
def test_the_triton_kernel_sums_as_the_definition(dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (tests/conftest.py)
    kv = caches(dtype, layers=2, blocks=6, heads=2, dim=32)
    buf = wire_of(kv, [5, 1, 0])
    words = checksum.words_of(buf.to(device))
    assert torch.equal(triton_checksum.block_sums(words).cpu(), checksum.reference_sums(buf))
    big = torch.randint(-(2**62), 2**62, (2, 2, 3, 3000), dtype=torch.int64)  # tiles with a ragged last one
    assert torch.equal(triton_checksum.block_sums(big.to(device)).cpu(), checksum.reference_sums(big))


def test_every_changed_byte_changes_its_blocks_checksum_and_no_other():
    kv = caches(torch.bfloat16, layers=2, blocks=6)
    buf = wire_of(kv, [0, 1, 2, 3])
    clean = checksum.block_sums(buf)
    raw = buf.view(torch.uint8).view(2, 2, 4, -1)
    chunk = raw.shape[-1]
    rng = random.Random(3)
    for _ in range(300):
        layer, plane, block, offset = rng.randrange(2), rng.randrange(2), rng.randrange(4), rng.randrange(chunk)
        bit = 1 << rng.randrange(8)
        raw[layer, plane, block, offset] ^= bit
        after = checksum.block_sums(buf)
        raw[layer, plane, block, offset] ^= bit
        assert checksum.mismatched(after, clean) == [block]
    assert torch.equal(checksum.block_sums(buf), clean)


def test_moved_words_and_a_block_in_anothers_place_are_caught():
    kv = caches(torch.float32, layers=2, blocks=6)
    buf = wire_of(kv, [0, 1, 2])
    clean = checksum.block_sums(buf)
    words = buf.view(torch.int64).view(2, 2, 3, -1)
    swapped = words.clone()
    swapped[0, 0, 1, [4, 9]] = words[0, 0, 1, [9, 4]]  # two words of one chunk trade places
    assert checksum.mismatched(checksum.block_sums(swapped.view(torch.float32).view(buf.shape)), clean) == [1]
    planes = words.clone()
    planes[1, :, 2] = words[1, [1, 0], 2]  # a layer's K and V chunks trade places
    assert checksum.mismatched(checksum.block_sums(planes.view(torch.float32).view(buf.shape)), clean) == [2]
    stale = words.clone()
    stale[:, :, 0] = words[:, :, 2]  # block 2's bytes where block 0's belong
    assert checksum.mismatched(checksum.block_sums(stale.view(torch.float32).view(buf.shape)), clean) == [0]


def test_the_wire_carries_the_blocks_then_one_checksum_each():
    layout = KVLayout(num_layers=3, block_size=16, num_kv_heads=4, head_dim=64, dtype="float16")
    assert checksums_fit(layout)
    assert not checksums_fit(KVLayout(num_layers=1, block_size=1, num_kv_heads=1, head_dim=3, dtype="float16"))
    kv = caches(torch.float16)
    wire = Wire.empty(layout, 2, torch.float16, True, "cpu")
    wire.fill(kv, [4, 9])
    assert wire.raw.numel() == 2 * layout.bytes_per_block + 16
    assert wire.sums is not None and torch.equal(wire.sums, checksum.reference_sums(wire_of(kv, [4, 9])))
    targets = [torch.zeros_like(c) for c in kv]
    assert torch.equal(wire.drain(targets, [0, 1]), wire.sums)
    plain = Wire.empty(layout, 2, torch.float16, False, "cpu")
    plain.fill(kv, [4, 9])
    assert plain.sums is None and plain.raw.numel() == 2 * layout.bytes_per_block
    assert plain.drain(targets, [2, 3]) is None
    scatter_blocks(plain.data, targets, [2, 3])
    assert torch.equal(targets[0][:, 2], kv[0][:, 4])
