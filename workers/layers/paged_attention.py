"""Attention over the paged KV cache.

A step's tokens are laid out decodes first (one query token each), then prefill chunks. Each
layer writes its new K/V into the cache through the step's ``KVWritePlan`` (its slots, and for a
quantized cache its blocks) and then attends:

- decodes, batched: the block tables are gathered into a padded ``[B, H, L, D]`` view and one
  ``scaled_dot_product_attention`` call runs with a key-length mask;
- each prefill chunk on its own: a fresh prompt (nothing cached before it) attends to its own
  K/V with ``is_causal``, exactly like a plain forward; a chunk after cached or earlier-computed
  tokens gathers its context from the cache and uses a causal mask offset by that context.

With a sliding window (Mistral-style ``sliding_window``), a query at position ``p`` sees keys at
``p - window < k <= p``; only blocks holding such keys are gathered (blocks wholly before every
query's window have been freed by the block manager).

K/V go through ``PagedKVCache``, which quantizes on write and dequantizes on gather for an
int8/fp8 cache. A quantized cache stores V rotated (``PagedKVCache.rotation``): attention over
gathered values runs in the rotated basis and its output is rotated back once
(``unrotate_values``), which is exact up to rounding since the rotation is orthonormal. On CUDA
with flash-attn installed, a block size it accepts (a multiple of 256), a full-precision cache
and full attention, the decode batch uses ``flash_attn_with_kvcache`` over the block tables
instead of gathering.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workers.layers.kv_cache import KVWritePlan, PagedKVCache

try:  # optional, CUDA only
    from flash_attn import flash_attn_with_kvcache
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_with_kvcache = None


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
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size]
    prefills: list[PrefillSpan] = field(default_factory=list)
    sliding_window: int | None = None  # a key is seen by queries less than this many positions on
    use_flash_attn: bool = False


def flash_attn_usable(
    device: torch.device, block_size: int, kv: PagedKVCache | None = None, sliding_window: int | None = None
) -> bool:
    return (
        flash_attn_with_kvcache is not None
        and device.type == "cuda"
        and block_size % 256 == 0
        and (kv is None or not kv.quantized)
        and sliding_window is None
    )


def attention_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[..., Q, K]`` bool: causal, and within ``window`` (keys at ``q - window < k <= q``)."""
    diff = query_pos[..., :, None] - key_pos[..., None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


class PagedAttention:
    """Attention for one step; the model calls ``forward`` once per layer."""

    def __init__(self, kv: PagedKVCache | None, meta: AttentionMetadata, scale: float):
        self.kv = kv
        self.meta = meta
        self.scale = scale

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
            self.cache.write(layer, meta.write, k, v)

        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(layer, q[: meta.num_decodes])
        window = meta.sliding_window
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.num_tokens)
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
                if span.block_table is None:
                    raise ValueError("a chunk after cached tokens needs its block table")
                kv = self.cache.gather(layer, span.block_table, rotated_values=True)  # [2, n_blocks * bs, Hkv, D]
                length = span.context_len - span.first_key_pos
                ks = kv[0, :length].transpose(0, 1).unsqueeze(0)
                vs = kv[1, :length].transpose(0, 1).unsqueeze(0)
                query_pos = torch.arange(span.context_len - span.num_tokens, span.context_len, device=q.device)
                key_pos = torch.arange(span.first_key_pos, span.context_len, device=q.device)
                o = self.cache.unrotate_values(
                    F.scaled_dot_product_attention(
                        qs,
                        ks,
                        vs,
                        attn_mask=attention_mask(query_pos, key_pos, window),
                        scale=self.scale,
                        enable_gqa=True,
                    )
                )
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta, cache = self.meta, self.cache
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if tables is None or lens is None:
            raise ValueError("a step with decodes needs their block tables and context lengths")
        if meta.use_flash_attn:
            layer_cache = cache.layers[layer]
            o = flash_attn_with_kvcache(
                q.unsqueeze(1),
                layer_cache[0],
                layer_cache[1],
                cache_seqlens=lens.to(torch.int32),
                block_table=tables.to(torch.int32),
                softmax_scale=self.scale,
                causal=True,
            )
            return o.squeeze(1)
        kv = cache.gather(layer, tables, rotated_values=True).transpose(2, 3)  # [2, B, Hkv, L, D]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kv[0], kv[1], attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
        )
        return cache.unrotate_values(o.squeeze(2))
