"""Attention over the paged KV cache.

A step's tokens are laid out decodes first (one query token each), then prefill chunks. Each
layer writes its new K/V into the cache through the step's ``KVWritePlan`` (its slots, and for a
quantized cache its blocks) and then attends:

- decodes, batched: the block tables are gathered into a padded ``[B, H, L, D]`` view and one
  ``scaled_dot_product_attention`` call runs with a key-length mask;
- each prefill chunk on its own: a fresh prompt (nothing cached before it) attends to its own
  K/V with ``is_causal``, exactly like a plain forward; a chunk after cached or earlier-computed
  tokens gathers its context from the cache and uses a causal mask offset by that context
  (a backend may run both through its own kernel instead, which reads the cache in place:
  ``PagedAttention._prompt_kernel``).

With a sliding window (Mistral-style ``sliding_window``), a query at position ``p`` sees keys at
``p - window < k <= p``; only blocks holding such keys are gathered (blocks wholly before every
query's window have been freed by the block manager).

K/V go through ``PagedKVCache``, which quantizes on write and dequantizes on gather for an
int8/fp8 cache. A quantized cache stores V rotated (``PagedKVCache.rotation``): attention over
gathered values runs in the rotated basis and its output is rotated back once
(``unrotate_values``), which is exact up to rounding since the rotation is orthonormal. Backends
subclass ``PagedAttention`` for kernels that read the cache in place (the CPU backend's C++
kernels, the CUDA backend's Triton and flash-attn ones).

``attention_backend="flex"`` (``FlexPagedAttention``, full-precision caches only) gathers
nothing: decodes and chunks after cached context run ``flex_attention`` over the physical
cache itself, viewed as ``[1, H, num_blocks * block_size, D]``, with a ``BlockMask`` built from
the block tables (torch's paged-attention pattern, ``torch.nn.attention.experimental.
_paged_attention``, but built directly on physical blocks): each query-block row lists the
physical blocks it reads, blocks every query of the row sees whole as "full" (no mask_mod),
the rest (a sequence's last block, the first block of a sliding window, a chunk's own blocks)
as partial, where ``mask_mod`` maps a physical key index to its logical position through
``block_pos`` (the logical position of each physical block's first row: one map per call, since
a block two sequences share is a prefix block at the same position in both) and applies the
causal and window tests. GQA goes through ``enable_gqa``. Fresh
prompts keep SDPA with ``is_causal`` (they read no cache). An int8/fp8 cache keeps the gather
path (it dequantizes only the blocks a step reads).

``flex_attention`` runs compiled (one ``torch.compile`` graph per model, block size and window,
compiled at start-up by ``warm_up_flex``): batch, query length, query-block rows and the
cache's block count are marked dynamic; shapes are padded to at least 2 on each of them so
that dynamo's 0/1 specialisation never makes a second graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from workers.backends.base import Ops
from workers.backends.cpu.options import PAGED_MIN_KEYS
from workers.layers.kv_cache import KVWritePlan, PagedKVCache

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import FlexKernelOptions


REFERENCE_OPS = Ops()


@dataclass(slots=True)
class PrefillSpan:
    start: int  # first row of this chunk in the step's token layout
    num_tokens: int
    context_len: int  # tokens of this sequence in the cache after this step (cached + chunk)
    block_table: torch.Tensor | None  # None for a fresh prompt (no gather needed)
    first_key_pos: int = 0  # position of the first token of ``block_table``'s first block

    @property
    def fresh(self) -> bool:
        return self.context_len == self.num_tokens


@dataclass(slots=True)
class AttentionMetadata:
    write: KVWritePlan | None  # where the step's K/V go; None: run without a cache
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] (padded with block 0)
    decode_context_lens: torch.Tensor | None = None  # [B]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size]; the gather path makes it
    prefills: list[PrefillSpan] = field(default_factory=list)
    sliding_window: int | None = None  # a key is seen by queries less than this many positions on
    decode_first_pos: torch.Tensor | None = None  # [B] position of each decode table's first key


def attention_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[..., Q, K]`` bool: causal, and within ``window`` (keys at ``q - window < k <= q``)."""
    diff = query_pos[..., :, None] - key_pos[..., None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def decode_mask(
    tables: torch.Tensor, context_lens: torch.Tensor, first_pos: torch.Tensor, block_size: int, window: int | None
) -> torch.Tensor:
    """``[B, 1, 1, max_blocks * block_size]`` bool: the keys of gathered padded tables that each
    decode's query sees. Padding blocks sit past the query position, so the causal test masks them."""
    key_pos = first_pos[:, None] + torch.arange(tables.shape[1] * block_size, device=tables.device)  # [B, L]
    return attention_mask(context_lens[:, None] - 1, key_pos, window)[:, None]


class PagedAttention:
    """Attention for one step; the model calls ``forward`` once per layer. This class is the
    specification (the reference backend's attention): it gathers the blocks a step reads and
    runs SDPA. Backends subclass it and override ``_decode`` and ``_prompt_kernel``."""

    def __init__(self, kv: PagedKVCache | None, meta: AttentionMetadata, scale: float, ops: Ops | None = None):
        self.kv = kv
        self.meta = meta
        self.scale = scale
        self.ops = ops or REFERENCE_OPS  # the backend's: writes K/V into the cache
        self._context_masks: dict[int, torch.Tensor] = {}  # by span start: built once a step, used by every layer

    @property
    def cache(self) -> PagedKVCache:
        """The KV cache, which a step that writes K/V, decodes or extends a cached prefix needs
        (only a step of fresh prompts runs without one)."""
        if self.kv is None:
            raise ValueError("this step reads or writes the KV cache but its attention has none")
        return self.kv

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (already rotated). Returns [T, Hq, D]."""
        meta = self.meta
        if meta.write is not None:
            self.cache.write(layer, meta.write, k, v, self.ops)

        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(layer, q[: meta.num_decodes])
        window = meta.sliding_window
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.num_tokens)
            if self._prompt_kernel(layer, span, q, k, v, out):
                continue
            qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if span.fresh:
                ks = k[rows].transpose(0, 1).unsqueeze(0)
                vs = v[rows].transpose(0, 1).unsqueeze(0)
                if window is None or span.num_tokens <= window:
                    o = F.scaled_dot_product_attention(
                        qs, ks, vs, is_causal=span.num_tokens > 1, scale=self.scale, enable_gqa=True
                    )
                else:
                    pos = torch.arange(span.num_tokens, device=q.device)
                    o = F.scaled_dot_product_attention(
                        qs,
                        ks,
                        vs,
                        attn_mask=attention_mask(pos, pos, window),
                        scale=self.scale,
                        enable_gqa=True,
                    )
            else:
                o = self._context_chunk(layer, span, qs)
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out

    def _prompt_kernel(
        self, layer: int, span: PrefillSpan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> bool:
        """A backend's own kernel for ``span``'s rows of q (written into ``out``); False where it
        has none for this step (SDPA runs, as here)."""
        return False

    def _context_chunk(self, layer: int, span: PrefillSpan, qs: torch.Tensor) -> torch.Tensor:
        """A chunk after cached tokens: qs [1, Hq, n, D] -> [1, Hq, n, D]."""
        if span.block_table is None:
            raise ValueError("a chunk after cached tokens needs its block table")
        kv = self.cache.gather(layer, span.block_table, rotated_values=True)  # [2, n_blocks * bs, Hkv, D]
        length = span.context_len - span.first_key_pos
        ks = kv[0, :length].transpose(0, 1).unsqueeze(0)
        vs = kv[1, :length].transpose(0, 1).unsqueeze(0)
        mask = self._context_masks.get(span.start)
        if mask is None:
            # additive, in q's dtype: what SDPA makes of a bool mask on every call (the same bits)
            query_pos = torch.arange(span.context_len - span.num_tokens, span.context_len, device=qs.device)
            key_pos = torch.arange(span.first_key_pos, span.context_len, device=qs.device)
            allowed = attention_mask(query_pos, key_pos, self.meta.sliding_window)
            mask = torch.zeros(allowed.shape, dtype=qs.dtype, device=qs.device).masked_fill_(~allowed, float("-inf"))
            self._context_masks[span.start] = mask
        return self.cache.unrotate_values(
            F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True)
        )

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta, cache = self.meta, self.cache
        tables, lens, firsts = meta.decode_block_tables, meta.decode_context_lens, meta.decode_first_pos
        if tables is None or lens is None or firsts is None:
            raise ValueError("a step with decodes needs their block tables, context and first positions")
        if meta.decode_mask is None:  # built on the first layer, shared by the rest
            meta.decode_mask = decode_mask(tables, lens, firsts, cache.block_size, meta.sliding_window)
        kv = cache.gather(layer, tables, rotated_values=True).transpose(2, 3)  # [2, B, Hkv, L, D]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kv[0], kv[1], attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
        )
        return cache.unrotate_values(o.squeeze(2))


# ---------------------------------------------------------------------------------- paged backend
ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "paged")
_MIN = 2  # batch, query length and rows are padded to this: dynamo specialises sizes 0 and 1


def _paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    first_pos: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """One query per row over its blocks, written as elementwise products and reductions so
    that inductor fuses the block-table indexing into the loops: K and V are read from the
    cache where they lie, once, and no gathered copy exists. q ``[B, Hq, D]``; k/v_cache
    ``[N, bs, Hkv, D]``; tables ``[B, M]`` (padding blocks sit past the row's last key);
    first_pos/context_lens ``[B]``. Returns ``[B, Hq, D]``; sums in fp32."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    m, g = tables.shape[1], hq // hkv
    k = k_cache[tables].permute(0, 3, 1, 2, 4).unsqueeze(2)  # [B, Hkv, 1, M, bs, D]
    v = v_cache[tables].permute(0, 3, 1, 2, 4).unsqueeze(2)
    qs = (q.float() * scale).view(b, hkv, g, 1, 1, d)
    scores = (qs * k.float()).sum(-1)  # [B, Hkv, G, M, bs]
    key_pos = first_pos.view(b, 1, 1, 1, 1) + torch.arange(m * bs, device=q.device).view(1, 1, 1, m, bs)
    diff = (context_lens - 1).view(b, 1, 1, 1, 1) - key_pos
    seen = diff >= 0
    if window is not None:
        seen = seen & (diff < window)
    scores = scores.masked_fill(~seen, float("-inf"))
    probs = torch.softmax(scores.view(b, hkv, g, m * bs), -1).view(b, hkv, g, m, bs, 1)
    # where, not a product with a zero probability: an unwritten slot may hold anything
    out = torch.where(seen.unsqueeze(-1), probs * v.float(), 0.0).sum((3, 4))  # [B, Hkv, G, D]
    return out.to(q.dtype).view(b, hq, d)


# Batch and blocks per row vary between calls (q, tables, first_pos, context_lens), and the
# cache's block count between engines (one graph serves every cache of a model shape); block
# size and head sizes stay static.
_PAGED_DYNAMIC_DIMS = ((0,), (0,), (0,), (0, 1), (0,), (0,))


def mark_dims(args: tuple[torch.Tensor, ...], dynamic_dims: tuple[tuple[int, ...], ...]) -> None:
    """Before a compiled call: each argument's ``dynamic_dims`` may vary between calls, every
    other dim is static (also when another engine's sizes differ: no automatic dynamic, which
    would recompile mid-serving)."""
    for tensor, dims in zip(args, dynamic_dims, strict=True):
        for dim in range(tensor.dim()):
            if dim in dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
            else:
                torch._dynamo.mark_static(tensor, dim)


@functools.cache
def compiled_paged_decode():
    """``_paged_decode`` under ``torch.compile`` (inductor: C++/OpenMP loops on CPU, Triton on
    CUDA). One graph per cache shape and window."""
    torch._dynamo.config.recompile_limit += 8
    torch._dynamo.config.accumulated_recompile_limit += 8
    return torch.compile(_paged_decode, fullgraph=True)


def check_full_precision(kv: PagedKVCache | None, backend: str) -> None:
    if kv is not None and kv.quantized:
        raise ValueError(
            f"attention_backend={backend!r} needs a full-precision KV cache (kv_cache_dtype auto), not "
            f"{kv.kv_cache_dtype.value!r}: a quantized cache is read through the gather path "
            f"(attention_backend 'sdpa' or 'auto')"
        )


# A hand-written decode kernel: (q, k_cache, v_cache, tables, first_pos, context_lens, scale,
# window) -> [B, Hq, D], every batch size.
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None"],
    torch.Tensor,
]


class PagedDecodeAttention(PagedAttention):
    """Decodes attend through their block tables in one kernel per layer, which reads each block
    of the step's tables once and copies nothing: a backend's hand-written kernel
    (``decode_kernel``, e.g. the CPU backend's C++ one or the CUDA backend's Triton one) where it
    has one for the step, else inductor's compilation of ``_paged_decode``, and a decode batch
    of fewer than ``min_keys`` keys gathers instead (faster there). Prompt spans run as in
    ``PagedAttention`` unless a subclass brings a prompt kernel."""

    def __init__(
        self,
        kv: PagedKVCache | None,
        meta: AttentionMetadata,
        scale: float,
        ops: Ops | None = None,
        min_keys: int = PAGED_MIN_KEYS,
    ):
        check_full_precision(kv, "paged")
        super().__init__(kv, meta, scale, ops)
        self.min_keys = min_keys
        # Decided on the first layer, for the step: a hand-written kernel, inductor's kernel's
        # padded (tables, firsts, lens), or "gather" when the step's decodes are too few keys
        # for it (min_keys)
        self._plan: DecodeKernel | tuple[torch.Tensor, torch.Tensor, torch.Tensor] | str | None = None

    def decode_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> DecodeKernel | None:
        """A backend's own decode kernel for this step's queries and cache, or None."""
        return None

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta, cache = self.meta, self.cache
        if self._plan is None:
            tables, lens, firsts = meta.decode_block_tables, meta.decode_context_lens, meta.decode_first_pos
            if tables is None or lens is None or firsts is None:
                raise ValueError("a step with decodes needs their block tables, context and first positions")
            kernel = self.decode_kernel(q, cache.layers[layer][0])
            if kernel is not None:
                self._plan = kernel
            elif tables.numel() * cache.block_size < self.min_keys:
                self._plan = "gather"  # PagedAttention's path, its mask made there
            else:
                self._plan = _pad_decode_rows(tables, firsts, lens)
        if callable(self._plan):
            layer_cache = cache.layers[layer]
            tables, firsts, lens = meta.decode_block_tables, meta.decode_first_pos, meta.decode_context_lens
            assert tables is not None and firsts is not None and lens is not None
            return self._plan(q, layer_cache[0], layer_cache[1], tables, firsts, lens, self.scale, meta.sliding_window)
        if isinstance(self._plan, str):
            return super()._decode(layer, q)
        tables, firsts, lens = self._plan
        batch = q.shape[0]
        q = q.contiguous()  # a view of the fused q/k/v projection (strides are guarded)
        if tables.shape[0] != batch:
            q = torch.cat([q, q.new_zeros(tables.shape[0] - batch, *q.shape[1:])])
        layer_cache = cache.layers[layer]
        args = (q, layer_cache[0], layer_cache[1], tables, firsts, lens)
        mark_dims(args, _PAGED_DYNAMIC_DIMS)
        return compiled_paged_decode()(*args, self.scale, meta.sliding_window)[:batch]


def _pad_decode_rows(
    tables: torch.Tensor, firsts: torch.Tensor, lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """At least ``_MIN`` rows and blocks per row (dynamo specialises sizes 1): a padding block
    sits past its row's last key; a padding row reads one key of block 0."""
    if tables.shape[1] < _MIN:
        tables = torch.cat([tables, tables.new_zeros(tables.shape[0], _MIN - tables.shape[1])], 1)
    pad = _MIN - tables.shape[0]
    if pad > 0:
        tables = torch.cat([tables, tables.new_zeros(pad, tables.shape[1])])
        firsts = torch.cat([firsts, firsts.new_zeros(pad)])
        lens = torch.cat([lens, lens.new_ones(pad)])
    return tables, firsts, lens


def warm_up_paged_decode(kv: PagedKVCache, scale: float, num_q_heads: int, window: int | None) -> None:
    """Compile inductor's paged decode now, not in a request: 3 rows of 5 blocks (distinct
    sizes, so that dynamo's duck shaping does not tie batch and blocks to one symbol); what it
    reads is void."""
    dev = kv.layers[0].device
    with torch.inference_mode():  # steps run in it: their tensors are inference tensors (guarded)
        meta = AttentionMetadata(
            write=None,
            num_decodes=3,
            decode_block_tables=torch.zeros(3, 5, dtype=torch.long, device=dev),
            decode_context_lens=torch.ones(3, dtype=torch.long, device=dev),
            decode_first_pos=torch.zeros(3, dtype=torch.long, device=dev),
            sliding_window=window,
        )
        attn = PagedDecodeAttention(kv, meta, scale, min_keys=0)
        attn._decode(0, torch.zeros(3, num_q_heads, kv.head_dim, dtype=kv.dtype, device=dev))


# ---------------------------------------------------------------------------------- flex backend
FLEX_Q_BLOCK = 128  # queries per block-mask row


@dataclass(slots=True)
class FlexMask:
    """One ``flex_attention`` call's block mask over the physical cache, as plain tensors (the
    compiled function builds the ``BlockMask`` from them, so that nothing is captured)."""

    kv_num_blocks: torch.Tensor  # [B, 1, R] int32: partial blocks per query-block row
    kv_indices: torch.Tensor  # [B, 1, R, num_cache_blocks] int32, physical block ids
    full_num_blocks: torch.Tensor  # [B, 1, R] int32: blocks every query of the row sees whole
    full_indices: torch.Tensor  # [B, 1, R, num_cache_blocks] int32
    query_start: torch.Tensor  # [num_cache_blocks + 2] int64: row b's first query position (then +1...)
    # [num_cache_blocks] int64: the logical position of each read block's first key. One map for
    # the whole batch: a block two sequences share is a prefix block, at the same position in
    # both (and one per batch row would need a symbolic row stride, which inductor's CPU flex
    # template of torch 2.13 miscompiles: an undeclared cur_kvSplitSize<N> in the C++).
    block_pos: torch.Tensor
    num_queries: int  # queries per row after padding
    batch: int  # rows after padding


def _compact(tables: torch.Tensor, keep: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row ``[B, R, M]`` the kept blocks of ``tables`` ``[B, M]`` first, padded to ``width``:
    (count ``[B, 1, R]``, indices ``[B, 1, R, width]``), int32."""
    b, r, m = keep.shape
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
    ids = tables[:, None, :].expand(b, r, m).gather(-1, order)
    out = torch.zeros(b, 1, r, width, dtype=torch.int32, device=tables.device)
    out[:, 0, :, :m] = ids.to(torch.int32)
    return keep.sum(-1, dtype=torch.int32)[:, None], out


def build_flex_mask(
    tables: torch.Tensor,
    num_blocks: torch.Tensor,
    first_pos: torch.Tensor,
    query_start: torch.Tensor,
    num_queries: int,
    block_size: int,
    cache_blocks: int,
    window: int | None,
) -> FlexMask:
    """The block mask of a batch: row ``b`` reads blocks ``tables[b, :num_blocks[b]]`` (padded
    ``[B, M]``), whose first key sits at ``first_pos[b]``, for ``num_queries`` consecutive queries
    from ``query_start[b]`` (causal, and within ``window``). Pads batch, queries and rows to at
    least 2 (a padding query sits after the row's last one; its output is dropped)."""
    dev = tables.device
    batch = tables.shape[0]
    lq = max(_MIN, num_queries)
    if batch < _MIN:
        pad = _MIN - batch
        tables = torch.cat([tables, tables.new_zeros(pad, tables.shape[1])])
        num_blocks = torch.cat([num_blocks, num_blocks.new_zeros(pad)])
        first_pos = torch.cat([first_pos, first_pos.new_zeros(pad)])
        query_start = torch.cat([query_start, query_start.new_zeros(pad)])
        batch = _MIN
    rows = max(_MIN, -(-lq // FLEX_Q_BLOCK))
    first_q = torch.arange(rows, device=dev) * FLEX_Q_BLOCK  # [R] first query index of each row
    q_lo = (query_start[:, None] + first_q)[..., None]  # [B, R, 1]
    q_hi = (query_start[:, None] + torch.clamp(first_q + FLEX_Q_BLOCK - 1, max=lq - 1))[..., None]
    m = tables.shape[1]
    starts = first_pos[:, None] + torch.arange(m, device=dev) * block_size  # [B, M]
    valid = torch.arange(m, device=dev) < num_blocks[:, None]  # [B, M]
    start, end, ok = starts[:, None], starts[:, None] + block_size - 1, valid[:, None]  # [B, 1, M]
    full = ok & (end <= q_lo)
    seen = ok & (start <= q_hi)
    if window is not None:
        full &= start > q_hi - window
        seen &= end > q_lo - window
    kv_num, kv_idx = _compact(tables, seen & ~full, cache_blocks)
    full_num, full_idx = _compact(tables, full, cache_blocks)
    block_pos = torch.zeros(cache_blocks + 1, dtype=torch.long, device=dev)
    block_pos.scatter_(0, torch.where(valid, tables, cache_blocks).flatten(), starts.flatten())
    # Padded to a size fixed by the cache (every decode row owns its last block, so a batch has at
    # most cache_blocks rows): the mask_mod then indexes no tensor of a dynamic size (below).
    starts_padded = query_start.new_zeros(cache_blocks + _MIN)
    starts_padded[:batch] = query_start
    return FlexMask(kv_num, kv_idx, full_num, full_idx, starts_padded, block_pos[:cache_blocks], lq, batch)


def _flex_paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    full_num_blocks: torch.Tensor,
    full_indices: torch.Tensor,
    query_start: torch.Tensor,
    block_pos: torch.Tensor,
    scale: float,
    block_size: int,
    window: int | None,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx):
        diff = query_start[b] + q_idx - (block_pos[kv_idx // block_size] + kv_idx % block_size)
        if window is None:
            return diff >= 0
        return (diff >= 0) & (diff < window)

    mask = BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_num_blocks,
        full_indices,
        BLOCK_SIZE=(FLEX_Q_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(q.shape[2], k.shape[2]),
    )
    # CUDA: the Triton kernel's key tile must divide the mask's key block, our cache block (16
    # tokens by default; its default tiles are 64-128 wide and refuse to build otherwise). The
    # CPU template tiles on its own.
    options: FlexKernelOptions | None = None
    if q.device.type == "cuda" and block_size < 128:
        options = {"BLOCK_N": block_size}
    return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=options)


# The sizes that vary between calls (batch, queries, rows), per argument of ``_flex_paged``;
# the cache's block count, heads and head_dim are an engine's constants and stay static, and so
# are the sizes of the tensors the mask_mod indexes: inductor's CPU flex template (torch 2.13)
# renames its split-size symbols in the generated C++ by plain string replacement, so a size
# symbol "ks37" in the mask code becomes "cur_kvSplitSize7" when the split symbol is "ks3", and
# the C++ does not compile (``dynamic=True`` on every dim hits that).
_DYNAMIC_DIMS = ((0, 2), (), (), (0, 2), (0, 2), (0, 2), (0, 2), (), ())


@functools.cache
def compiled_flex():
    """``_flex_paged`` under ``torch.compile``: flex_attention is only efficient compiled (eager
    it materialises the scores). One graph per block size, window and model shape."""
    torch._dynamo.config.recompile_limit += 8
    torch._dynamo.config.accumulated_recompile_limit += 8
    return torch.compile(_flex_paged, fullgraph=True)


class FlexPagedAttention(PagedAttention):
    """The flex backend: decodes and chunks after cached context attend over the physical cache
    through block masks (module docstring); nothing goes through ``PagedKVCache.gather``."""

    def __init__(self, kv: PagedKVCache | None, meta: AttentionMetadata, scale: float, ops: Ops | None = None):
        check_full_precision(kv, "flex")
        super().__init__(kv, meta, scale, ops)
        self._decode_mask: FlexMask | None = None  # built on the first layer, shared by the rest
        self._span_masks: dict[int, FlexMask] = {}

    def _physical(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat = self.cache.flat(layer)  # [2, N * bs, H, D]
        return flat[0].transpose(0, 1).unsqueeze(0), flat[1].transpose(0, 1).unsqueeze(0)

    def _run(self, layer: int, q: torch.Tensor, mask: FlexMask) -> torch.Tensor:
        """q: [B, Hq, Lq, D] (unpadded). Returns [B, Hq, Lq, D]."""
        batch, _, lq, _ = q.shape
        pb, pq = mask.batch, mask.num_queries
        if pq != lq:
            q = F.pad(q, (0, 0, 0, pq - lq))
        if pb != batch:
            q = torch.cat([q, q.new_zeros(pb - batch, *q.shape[1:])])
        k, v = self._physical(layer)
        args: tuple[torch.Tensor, ...] = (q, k, v, mask.kv_num_blocks, mask.kv_indices, mask.full_num_blocks)
        args += (mask.full_indices, mask.query_start, mask.block_pos)
        mark_dims(args, _DYNAMIC_DIMS)
        o = compiled_flex()(*args, self.scale, self.cache.block_size, self.meta.sliding_window)
        return o[:batch, :, :lq]

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta, cache = self.meta, self.cache
        if self._decode_mask is None:
            tables, lens, firsts = meta.decode_block_tables, meta.decode_context_lens, meta.decode_first_pos
            if tables is None or lens is None or firsts is None:
                raise ValueError("a step with decodes needs their block tables, context and first positions")
            bs = cache.block_size
            num_blocks = (lens + bs - 1) // bs - firsts // bs
            self._decode_mask = build_flex_mask(
                tables, num_blocks, firsts, lens - 1, 1, bs, cache.num_blocks, meta.sliding_window
            )
        return self._run(layer, q.unsqueeze(2), self._decode_mask).squeeze(2)

    def _context_chunk(self, layer: int, span: PrefillSpan, qs: torch.Tensor) -> torch.Tensor:
        mask = self._span_masks.get(span.start)
        if mask is None:
            if span.block_table is None:
                raise ValueError("a chunk after cached tokens needs its block table")
            cache, dev = self.cache, qs.device
            table = span.block_table[None]
            mask = build_flex_mask(
                table,
                torch.tensor([table.shape[1]], device=dev),
                torch.tensor([span.first_key_pos], device=dev),
                torch.tensor([span.context_len - span.num_tokens], device=dev),
                span.num_tokens,
                cache.block_size,
                cache.num_blocks,
                self.meta.sliding_window,
            )
            self._span_masks[span.start] = mask
        return self._run(layer, qs, mask)


def warm_up_flex(kv: PagedKVCache, scale: float, num_q_heads: int, window: int | None) -> None:
    """Compile the flex graph now: 3 rows of 5 queries on block 0 (what it reads is void). The
    sizes are distinct so that dynamo's duck shaping does not tie batch, queries and rows to one
    symbol (a later call where they differ would recompile)."""
    dev = kv.layers[0].device
    attn = FlexPagedAttention(kv, AttentionMetadata(write=None, sliding_window=window), scale)
    with torch.inference_mode():  # steps run in it: their tensors are inference tensors (guarded)
        zeros = torch.zeros(3, dtype=torch.long, device=dev)
        mask = build_flex_mask(zeros[:, None], zeros + 1, zeros, zeros, 5, kv.block_size, kv.num_blocks, window)
        q = torch.zeros(3, num_q_heads, 5, kv.head_dim, dtype=kv.dtype, device=dev)
        attn._run(0, q, mask)
