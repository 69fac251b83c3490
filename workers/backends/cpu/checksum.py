"""The KV transfer's gather and scatter on CPU with the blocks' checksums folded into the copy
(``csrc/kv_checksum.cpp``; the checksum's definition: ``workers/transfer/checksum.py``).

Each block's chunk is copied and summed while it is in cache, so the checksum costs a pass over
data already read, not a second pass over the buffer. Checked against the torch definition bit
for bit once per process (``build.py``'s self-checks); where it does not build or differs, the
torch gather/scatter and ``reference_sums`` run instead.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from workers.backends.cpu import build as loader

GATHER, SCATTER, SUM = 0, 1, 2
PARALLEL_BYTES = 4 << 20  # a transfer this large splits its copies over torch's thread count


def _threads(nbytes: int) -> int:
    return torch.get_num_threads() if nbytes >= PARALLEL_BYTES else 1


@functools.cache
def _kernel():
    return loader.kernel("kv_checksum")


def takes(kv_caches: Sequence[torch.Tensor], wire: torch.Tensor) -> bool:
    """Whether the kernel can copy between these cache layers (CPU, ``[2, blocks, rows, heads,
    dim]`` with heads and dim contiguous, all laid out alike: whole caches or one run of heads)
    and contiguous wire buffer ``wire``."""
    first = kv_caches[0]
    if first.device.type != "cpu" or not wire.is_contiguous() or first.dim() != 5:
        return False
    seg = first.shape[3] * first.shape[4] * first.element_size()
    if seg % 8 or first.stride(4) != 1 or first.stride(3) != first.shape[4]:
        return False
    return all(c.stride() == first.stride() and c.dtype == first.dtype for c in kv_caches)


def _call(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], wire: torch.Tensor, mode: int) -> torch.Tensor:
    first = kv_caches[0]
    size = first.element_size()
    n = wire.shape[2]
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    ptrs = torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64)
    sums = torch.empty(n, dtype=torch.int64)
    partial = torch.empty(len(kv_caches) * 2 * n, dtype=torch.int64)
    _kernel()(
        ptrs,
        ids,
        wire,
        sums,
        partial,
        len(kv_caches),
        n,
        first.stride(0) * size,
        first.stride(1) * size,
        first.stride(2) * size,
        first.shape[2],
        first.shape[3] * first.shape[4] * size,
        mode,
        _threads(wire.numel() * wire.element_size()),
    )
    return sums


def gather(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Copy ``block_ids`` of every layer into ``out`` (``[layers, 2, n, rows, heads, dim]``) and
    return their checksums; ids must be in range (``buffers.check_block_ids``)."""
    return _call(kv_caches, block_ids, out, GATHER)


def scatter(buf: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """Write ``buf`` into ``block_ids`` of every layer and return the checksums of ``buf``."""
    return _call(kv_caches, block_ids, buf, SCATTER)


def block_sums(buf: torch.Tensor) -> torch.Tensor:
    """The checksums of a contiguous wire buffer's blocks."""
    layers, _, n = buf.shape[:3]
    chunk = buf[0, 0, 0].numel() * buf.element_size() if n else 0
    sums = torch.empty(n, dtype=torch.int64)
    partial = torch.empty(layers * 2 * n, dtype=torch.int64)
    unused = torch.zeros(max(layers, n), dtype=torch.int64)  # no cache is read in this mode
    _kernel()(
        unused,
        unused,
        buf,
        sums,
        partial,
        layers,
        n,
        0,
        0,
        chunk,
        1,
        chunk,
        SUM,
        _threads(buf.numel() * buf.element_size()),
    )
    return sums


def _check() -> str | None:
    """Why the kernel differs from the torch gather, scatter and definition (None: it does not)."""
    from workers.transfer import checksum as definition
    from workers.transfer.buffers import gather_blocks

    gen = torch.Generator().manual_seed(0)
    for dtype, heads in ((torch.float32, range(0, 4)), (torch.bfloat16, range(1, 3)), (torch.int8, range(0, 4))):
        caches = [
            torch.randint(-100, 100, (2, 9, 16 + (dtype == torch.int8), 4, 64), generator=gen).to(dtype)
            for _ in range(3)
        ]
        views = [c[:, :, :, heads.start : heads.stop] for c in caches]
        ids = [7, 0, 3, 8]
        wire = torch.empty((3, 2, 4, *views[0].shape[2:]), dtype=dtype)
        sums = gather(views, ids, wire)
        expected = gather_blocks(views, ids, torch.empty_like(wire))
        if not torch.equal(wire.view(torch.uint8), expected.view(torch.uint8)):
            return f"its {dtype} gather differs from index_select"
        if not torch.equal(sums, definition.reference_sums(expected)):
            return f"its {dtype} checksums differ from the definition"
        if not torch.equal(block_sums(expected), sums):
            return f"its {dtype} sums of a buffer differ from those of its gather"
        targets = [c.clone() for c in caches]
        tviews = [c[:, :, :, heads.start : heads.stop] for c in targets]
        if not torch.equal(scatter(expected, tviews, [1, 2, 4, 5]), sums):
            return f"its {dtype} scatter's checksums differ"
        for c, t in zip(views, tviews, strict=True):
            if not torch.equal(t[:, [1, 2, 4, 5]].view(torch.uint8), c[:, ids].view(torch.uint8)):
                return f"its {dtype} scatter wrote other bytes"
    return None


@functools.cache
def usable() -> bool:
    """Whether the kernel builds here and agrees with the torch definition."""
    return loader.usable("kv_checksum")


loader.register(
    "kv_checksum",
    loader.SelfCheck("KV checksum", "the torch gather, scatter and checksum", lambda: _kernel(), lambda: _check()),
)
