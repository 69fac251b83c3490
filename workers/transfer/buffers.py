"""Gathering blocks of all layers into one contiguous buffer, and scattering it back.

The wire format of one transfer is a single tensor ``[num_layers, 2, n, rows, heads, dim]``
holding the requested blocks in request order: row ``i`` of every layer is block ``ids[i]``.
``rows`` is the block size, plus a scale row for quantized caches (``KVLayout.rows_per_block``):
a quantized block travels with its scales.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from workers.layers.kv_cache import as_wide_rows
from workers.protocol import QUANTIZED_DTYPES, SCALE_ROWS, KVLayout


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(kv_caches: Sequence[torch.Tensor]) -> KVLayout:
    """The layout of an engine's KV cache, checking every layer agrees."""
    if not kv_caches:
        raise ValueError("kv_caches is empty: pass one tensor per layer")
    first = kv_caches[0]
    if first.dim() != 5 or first.shape[0] != 2:
        raise ValueError(
            f"KV cache layer 0 has shape {tuple(first.shape)}; expected "
            "[2, num_blocks, block_size, num_kv_heads, head_dim]"
        )
    for i, layer in enumerate(kv_caches):
        if layer.shape != first.shape or layer.dtype != first.dtype or layer.device != first.device:
            raise ValueError(
                f"KV cache layer {i} is {tuple(layer.shape)} {layer.dtype} on {layer.device} but "
                f"layer 0 is {tuple(first.shape)} {first.dtype} on {first.device}"
            )
        if not layer.is_contiguous():
            raise ValueError(f"KV cache layer {i} is not contiguous; allocate each layer in one piece")
    _, _, rows, heads, head_dim = first.shape
    dtype = dtype_name(first.dtype)
    block_size = rows - SCALE_ROWS if dtype in QUANTIZED_DTYPES else rows
    return KVLayout(len(kv_caches), block_size, heads, head_dim, dtype)


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str, unique: bool = False) -> None:
    """Reject empty lists, non-ints and ids outside ``[0, num_blocks)`` before any traffic."""
    if len(block_ids) == 0:
        raise ValueError(f"{what} is empty: a transfer moves at least one block")
    bad = [b for b in block_ids if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what} has ids outside [0, {num_blocks}): {bad[:8]}")
    if unique and len(set(block_ids)) != len(block_ids):
        raise ValueError(f"{what} names a block twice; each destination block is written once")


def buffer_shape(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    return (layout.num_layers, 2, num_blocks, layout.rows_per_block, layout.num_kv_heads, layout.head_dim)


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Copy ``block_ids`` of every layer into ``out`` (one copy, no per-layer temporaries)."""
    index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        torch.index_select(cache, 1, index, out=out[layer])
    return out


def scatter_blocks(buf: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
    """Write row ``i`` of every layer of ``buf`` into block ``block_ids[i]``.

    Contiguous cache layers (the engine allocates them so) are written as wide rows; a head slice
    of them (``head_slice``) element by element.
    """
    index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        if cache.is_contiguous():
            as_wide_rows(cache).index_copy_(1, index, as_wide_rows(buf[layer]))
        else:
            cache.index_copy_(1, index, buf[layer])


def head_slice(
    kv_caches: Sequence[torch.Tensor], layout: KVLayout, heads: range | None
) -> tuple[Sequence[torch.Tensor], KVLayout]:
    """Views of KV heads ``heads`` (local indices) of every layer, and the layout a transfer of
    only those heads has on the wire (``workers/transfer/tp_plan.py`` names them); all heads when
    ``heads`` is None. A quantized block's scale rows are rows of the same heads: they come along."""
    if heads is None or (heads.start == 0 and heads.stop == layout.num_kv_heads):
        return kv_caches, layout
    if heads.step != 1 or not 0 <= heads.start < heads.stop <= layout.num_kv_heads:
        raise ValueError(f"heads {heads} is not a run of the cache's {layout.num_kv_heads} KV heads")
    views = [cache[:, :, :, heads.start : heads.stop] for cache in kv_caches]
    return views, dataclasses.replace(layout, num_kv_heads=len(heads))
