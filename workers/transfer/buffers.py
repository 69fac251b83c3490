"""Gathering blocks of all layers into one contiguous buffer, and scattering it back.

The wire format of one transfer is a single tensor ``[num_layers, 2, n, block_size, heads, dim]``
holding the requested blocks in request order: row ``i`` of every layer is block ``ids[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.protocol import KVLayout


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
    _, _, block_size, heads, head_dim = first.shape
    return KVLayout(len(kv_caches), block_size, heads, head_dim, dtype_name(first.dtype))


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str,
                    unique: bool = False) -> None:
    """Reject empty lists, non-ints and ids outside ``[0, num_blocks)`` before any traffic."""
    if len(block_ids) == 0:
        raise ValueError(f"{what} is empty: a transfer moves at least one block")
    bad = [b for b in block_ids if not isinstance(b, int) or isinstance(b, bool)
           or not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what} has ids outside [0, {num_blocks}): {bad[:8]}")
    if unique and len(set(block_ids)) != len(block_ids):
        raise ValueError(f"{what} names a block twice; each destination block is written once")


def buffer_shape(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    return (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                  out: torch.Tensor) -> torch.Tensor:
    """Copy ``block_ids`` of every layer into ``out`` (one copy, no per-layer temporaries)."""
    index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        torch.index_select(cache, 1, index, out=out[layer])
    return out


def _as_wide_rows(blocks: torch.Tensor) -> torch.Tensor:
    """View ``[2, n, block_size, heads, dim]`` as ``[2, n, row]`` of the widest element that
    tiles a block exactly.

    ``index_copy_`` moves one element at a time; moving 16-byte elements instead of 2-byte ones
    makes the scatter up to 2x faster on CPU. Only bytes are copied, never converted, so the
    result is bit-exact whatever the KV dtype.
    """
    rows = blocks.view(blocks.shape[0], blocks.shape[1], -1)
    row_bytes = rows.shape[-1] * rows.element_size()
    offset_bytes = rows.storage_offset() * rows.element_size()
    for wide in (torch.complex128, torch.int64):
        if row_bytes % wide.itemsize == 0 and offset_bytes % wide.itemsize == 0:
            return rows.view(wide)
    return rows


def scatter_blocks(buf: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                   block_ids: Sequence[int]) -> None:
    """Write row ``i`` of every layer of ``buf`` into block ``block_ids[i]``.

    Needs contiguous cache layers (the engine allocates them so).
    """
    index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        _as_wide_rows(cache).index_copy_(1, index, _as_wide_rows(buf[layer]))


# ---------------------------------------------------------------- chunked (pipelined) transfers
#
# A transfer larger than ``chunk_bytes`` goes out as a few messages instead of one, so the gather
# of chunk i+1 overlaps the wire time of chunk i (and the scatter of chunk i the recv of chunk
# i+1). The bytes on the wire are those of the single-message format, cut into consecutive
# pieces: the buffer ``[num_layers, 2, n, ...]`` flattened is a run of "segments", one per
# (layer, k-or-v), each ``n`` rows of ``block_size * heads * dim`` elements. A chunk is either a
# row range of one segment (segments of ``chunk_bytes`` or more are cut into equal row ranges) or
# a run of whole segments (smaller segments are grouped up to ``chunk_bytes``). The plan depends
# only on the layout, the block count and ``chunk_bytes``, which both ranks agree on when the
# pair group is created, never on block ids; a transfer of at most ``chunk_bytes`` is one chunk,
# byte-for-byte the single-message format.

Segment = tuple[int, int, int, int]  # (layer, 0 for K / 1 for V, first row, end row)


def chunk_plan(layout: KVLayout, num_blocks: int, chunk_bytes: int) -> list[list[Segment]]:
    row_bytes = layout.bytes_per_block // (2 * layout.num_layers)
    segments = [(layer, kv) for layer in range(layout.num_layers) for kv in (0, 1)]
    seg_bytes = num_blocks * row_bytes
    if seg_bytes * len(segments) <= chunk_bytes:
        return [[(layer, kv, 0, num_blocks) for layer, kv in segments]]
    if seg_bytes >= chunk_bytes:
        pieces = -(-seg_bytes // chunk_bytes)
        bounds = [num_blocks * i // pieces for i in range(pieces + 1)]
        return [[(layer, kv, bounds[i], bounds[i + 1])] for layer, kv in segments
                for i in range(pieces)]
    per_chunk = chunk_bytes // seg_bytes
    return [[(layer, kv, 0, num_blocks) for layer, kv in segments[i:i + per_chunk]]
            for i in range(0, len(segments), per_chunk)]


def chunk_rows(chunk: Sequence[Segment]) -> int:
    return sum(end - first for _, _, first, end in chunk)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[n, block_size, heads, dim]`` as ``[n, row]`` of the widest element that tiles a row
    (see ``_as_wide_rows``): bytes are moved, never converted."""
    rows = t.reshape(t.shape[0], -1)
    row_bytes = rows.shape[-1] * rows.element_size()
    offset_bytes = rows.storage_offset() * rows.element_size()
    for wide in (torch.complex128, torch.int64):
        if row_bytes % wide.itemsize == 0 and offset_bytes % wide.itemsize == 0:
            return rows.view(wide)
    return rows


def _segment_views(kv_caches: Sequence[torch.Tensor], chunk: Sequence[Segment],
                   buf: torch.Tensor):
    """(cache rows ``[num_blocks, ...]`` of each segment, its slice of the flat byte ``buf``)."""
    block_shape = kv_caches[0].shape[2:]
    dtype = kv_caches[0].dtype
    offset = 0
    for layer, kv, first, end in chunk:
        rows = kv_caches[layer][kv]
        nbytes = (end - first) * rows[0].nbytes
        yield rows, buf[offset:offset + nbytes].view(dtype).view(end - first, *block_shape)
        offset += nbytes


def contiguous_run(ids: Sequence[int]) -> bool:
    """True when ``ids`` are ascending consecutive block ids (readable as one slice)."""
    return all(b - a == 1 for a, b in zip(ids, ids[1:]))


def chunk_source_view(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                      chunk: Sequence[Segment]) -> torch.Tensor | None:
    """The chunk as a view of the cache when it is one segment over consecutive block ids (no
    gather copy needed), else None."""
    if len(chunk) != 1:
        return None
    layer, kv, first, end = chunk[0]
    ids = block_ids[first:end]
    if not contiguous_run(ids):
        return None
    return kv_caches[layer][kv, ids[0]:ids[0] + len(ids)]


def gather_chunk(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                 chunk: Sequence[Segment], buf: torch.Tensor,
                 index: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the chunk's rows into the flat byte tensor ``buf`` (exactly the chunk's size)."""
    if index is None:
        index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for (rows, out), (_, _, first, end) in zip(_segment_views(kv_caches, chunk, buf), chunk):
        torch.index_select(_rows(rows), 0, index[first:end], out=_rows(out))
    return buf


def scatter_chunk(buf: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                  chunk: Sequence[Segment], index: torch.Tensor | None = None) -> None:
    """Write the chunk held in the flat byte tensor ``buf`` into ``block_ids`` of the caches."""
    if index is None:
        index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for (rows, src), (_, _, first, end) in zip(_segment_views(kv_caches, chunk, buf), chunk):
        _rows(rows).index_copy_(0, index[first:end], _rows(src))
