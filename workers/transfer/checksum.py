"""Checksums of transferred KV blocks: computed where the bytes are, verified on receipt.

**The checksum.** A transfer's wire buffer is ``[layers, 2, n, chunk]`` (``buffers.py``): block
``j``'s bytes are its ``2 * layers`` chunks. Read each chunk as little-endian 64-bit words and
number the words of block ``j`` across its chunks in (layer, plane) order: word ``i`` of chunk
``(l, p)`` is word ``(l * 2 + p) * words + i``. The block's checksum is

    sum over its words w at position k of  mix(w ^ k * GOLDEN)   (mod 2^64)
    mix(x) = y ^ (y >> 32),  y = x * MIX   (MIX odd)

Each term is a bijection of its word, so any change to one word changes the sum, and a word
moved to another position is caught as surely as a random one (its key differs). A sum is
order-free: the CPU kernel folds it into the gather or scatter copy it makes anyway (the chunk
is in cache), a GPU kernel sums tiles in parallel, and both agree with ``reference_sums`` bit
for bit. CRC32C or XXH3 would need a second pass over the buffer in word order; in
``bench/transfer.py`` that pass costs more than the goal allows (decision 0025).

**On the wire** the ``n`` checksums (int64) follow the blocks in the same message: one message,
no extra round trip, and a mismatch names the blocks.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from workers.backends.cuda import triton_available

logger = logging.getLogger(__name__)

GOLDEN = 0x9E3779B97F4A7C15
MIX = 0xBF58476D1CE4E5B9
SUM_BYTES = 8  # one int64 a block
_triton_failed: list[str] = []  # why the Triton checksum failed in this process, once


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def words_of(buf: torch.Tensor) -> torch.Tensor:
    """A wire buffer ``[layers, 2, n, ...]`` (contiguous) as int64 words ``[layers, 2, n, words]``;
    ValueError when a block's chunk is not a whole number of words."""
    layers, planes, n = buf.shape[:3]
    chunk = buf[0, 0, 0].numel() * buf.element_size() if n else 0
    if chunk % SUM_BYTES:
        raise ValueError(f"a KV chunk of {chunk} bytes is not a whole number of 8-byte words")
    return buf.contiguous().view(torch.uint8).view(layers, planes, n, chunk).view(torch.int64)


def reference_sums(buf: torch.Tensor) -> torch.Tensor:
    """The checksums of a wire buffer's blocks (int64 ``[n]``, on its device), in plain torch:
    the definition the kernels are checked against."""
    words = words_of(buf)
    layers, planes, n, per = words.shape
    pos = torch.arange(layers * planes * per, dtype=torch.int64, device=buf.device).view(layers, planes, 1, per)
    y = (words ^ (pos * _signed(GOLDEN))) * _signed(MIX)
    y = y ^ ((y >> 32) & 0xFFFFFFFF)  # a logical shift (int64's >> is arithmetic)
    return y.sum(dim=(0, 1, 3), dtype=torch.int64)


def block_sums(buf: torch.Tensor) -> torch.Tensor:
    """The checksums of a wire buffer's blocks, computed on its device (a kernel where one runs)."""
    buf = buf.contiguous()
    if buf.device.type == "cuda" and triton_available() and not _triton_failed:
        from workers.backends.cuda import triton_checksum

        try:
            return triton_checksum.block_sums(words_of(buf))
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile or launch here
            _triton_failed.append(str(exc))
            logger.warning("the Triton KV checksum failed (%s); the torch one runs", exc)
    if buf.device.type == "cpu" and _cpu_usable():
        from workers.backends.cpu import checksum as cpu

        return cpu.block_sums(buf)
    return reference_sums(buf)


def gather(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Copy ``block_ids`` of every layer into wire buffer ``out`` and return their checksums."""
    if out.device.type == "cpu" and _cpu_usable():
        from workers.backends.cpu import checksum as cpu

        if cpu.takes(kv_caches, out):
            return cpu.gather(kv_caches, block_ids, out)
    from workers.transfer.buffers import gather_blocks

    return block_sums(gather_blocks(kv_caches, block_ids, out))


def scatter(buf: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """Write wire buffer ``buf`` into ``block_ids`` of every layer and return the checksums of
    what arrived (computed before the write: the cache's copy is what was received)."""
    if buf.device.type == "cpu" and _cpu_usable():
        from workers.backends.cpu import checksum as cpu

        if cpu.takes(kv_caches, buf):
            return cpu.scatter(buf, kv_caches, block_ids)
    from workers.transfer.buffers import scatter_blocks

    sums = block_sums(buf)
    scatter_blocks(buf, kv_caches, block_ids)
    return sums


def mismatched(received: torch.Tensor, expected: torch.Tensor) -> list[int]:
    """Positions (in the transfer's block order) whose checksum differs."""
    return torch.nonzero(received != expected).flatten().tolist()


@functools.cache
def _cpu_usable() -> bool:
    from workers.backends.cpu import checksum as cpu

    return cpu.usable()
