"""The KV transfer's block checksums on the GPU, as one Triton kernel (the definition:
``workers/transfer/checksum.py``).

The wire buffer is read as int64 words ``[layers * 2 * n, words]``; program ``(c, t)`` sums tile
``t`` of chunk ``c`` (its words' mixed values, mod 2^64) into ``partials[c, t]``, and torch adds a
block's partials over its chunks and tiles. Staying on the device means no copy to the host and
no synchronisation: the sender writes the checksums after the blocks in the wire buffer, the
receiver compares them there. ``TRITON_INTERPRET=1`` runs it on CPU tensors (numpy), which is how
the tests check it here.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from workers.backends.cuda import triton_available
from workers.transfer.checksum import GOLDEN, MIX

BLOCK = 1024  # words a program sums


available = triton_available  # asked before the kernels are built


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_tiles(
        words_ptr, partials_ptr, n, per, tiles, BLOCK: tl.constexpr, GOLDEN: tl.constexpr, MIX: tl.constexpr
    ):
        c = tl.program_id(0)
        t = tl.program_id(1)
        offs = t * BLOCK + tl.arange(0, BLOCK)
        live = offs < per
        w = tl.load(words_ptr + c.to(tl.int64) * per + offs, mask=live, other=0).to(tl.uint64, bitcast=True)
        pos = ((c // n).to(tl.int64) * per + offs).to(tl.uint64, bitcast=True)
        y = (w ^ (pos * GOLDEN)) * MIX
        y = y ^ (y >> 32)
        y = tl.where(live, y, 0)
        tl.store(partials_ptr + c.to(tl.int64) * tiles + t, tl.sum(y, axis=0).to(tl.int64, bitcast=True))

    return chunk_tiles


def block_sums(words: torch.Tensor) -> torch.Tensor:
    """The checksums (int64 ``[n]``) of wire words ``[layers, 2, n, per]`` (contiguous)."""
    layers, planes, n, per = words.shape
    tiles = -(-per // BLOCK)
    partials = torch.empty((layers * planes * n, tiles), dtype=torch.int64, device=words.device)
    if partials.numel():
        _kernel()[(layers * planes * n, tiles)](words, partials, n, per, tiles, BLOCK=BLOCK, GOLDEN=GOLDEN, MIX=MIX)
    return partials.view(layers * planes, n, tiles).sum(dim=(0, 2), dtype=torch.int64)
