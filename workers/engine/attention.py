"""Attention over the paged KV cache.

A step's tokens are laid out decodes first (one query token each), then prefill chunks. Each
layer writes its new K/V into the cache through ``slot_mapping`` and then attends:

- decodes, batched: the block tables are gathered into a padded ``[B, H, L, D]`` view and one
  ``scaled_dot_product_attention`` call runs with a key-length mask;
- each prefill chunk on its own: a fresh prompt (nothing cached before it) attends to its own
  K/V with ``is_causal``, exactly like a plain forward; a chunk after cached or earlier-computed
  tokens gathers its context from the cache and uses a causal mask offset by that context.

On CUDA with flash-attn installed and a block size it accepts (a multiple of 256), the decode
batch uses ``flash_attn_with_kvcache`` over the block tables instead of gathering.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

try:  # optional, CUDA only
    from flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_with_kvcache = None


@dataclass(slots=True)
class PrefillSpan:
    start: int  # first row of this chunk in the step's token layout
    num_tokens: int
    context_len: int  # tokens of this sequence in the cache after this step (cached + chunk)
    block_table: torch.Tensor | None  # None for a fresh prompt (no gather needed)

    @property
    def fresh(self) -> bool:
        return self.context_len == self.num_tokens


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # [T] cache slot of each token; None: run without a cache
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] (padded with block 0)
    decode_context_lens: torch.Tensor | None = None  # [B]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size]
    prefills: list[PrefillSpan] = field(default_factory=list)
    use_flash_attn: bool = False


def flash_attn_usable(device: torch.device, block_size: int) -> bool:
    return flash_attn_with_kvcache is not None and device.type == "cuda" and block_size % 256 == 0


class PagedAttention:
    """Attention for one step; the model calls ``forward`` once per layer."""

    def __init__(self, kv_caches: list[torch.Tensor] | None, meta: AttentionMetadata, scale: float):
        self.kv_caches = kv_caches
        self.meta = meta
        self.scale = scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (already rotated). Returns [T, Hq, D]."""
        meta = self.meta
        cache = None
        if meta.slot_mapping is not None:
            cache = self.kv_caches[layer]
            num_kv_heads, head_dim = cache.shape[-2:]
            flat = cache.view(2, -1, num_kv_heads, head_dim)
            flat[0].index_copy_(0, meta.slot_mapping, k.to(cache.dtype))
            flat[1].index_copy_(0, meta.slot_mapping, v.to(cache.dtype))

        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(cache, q[: meta.num_decodes])
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.num_tokens)
            qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if span.fresh:
                ks = k[rows].transpose(0, 1).unsqueeze(0)
                vs = v[rows].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=span.num_tokens > 1, scale=self.scale, enable_gqa=True
                )
            else:
                ks, vs = _gather(cache, span.block_table, span.context_len)
                mask = torch.ones(
                    span.num_tokens, span.context_len, dtype=torch.bool, device=q.device
                ).tril_(span.context_len - span.num_tokens)
                o = F.scaled_dot_product_attention(
                    qs, ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=mask, scale=self.scale,
                    enable_gqa=True,
                )
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode(self, cache: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        if meta.use_flash_attn:
            o = flash_attn_with_kvcache(
                q.unsqueeze(1), cache[0], cache[1],
                cache_seqlens=meta.decode_context_lens.to(torch.int32),
                block_table=meta.decode_block_tables.to(torch.int32),
                softmax_scale=self.scale, causal=True,
            )
            return o.squeeze(1)
        batch = q.shape[0]
        num_kv_heads, head_dim = cache.shape[-2:]
        ks = cache[0][meta.decode_block_tables].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        vs = cache[1][meta.decode_block_tables].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), ks, vs, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
        )
        return o.squeeze(2)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first ``length`` tokens as [Hkv, length, D]."""
    num_kv_heads, head_dim = cache.shape[-2:]
    k = cache[0][block_table].view(-1, num_kv_heads, head_dim)[:length]
    v = cache[1][block_table].view(-1, num_kv_heads, head_dim)[:length]
    return k.transpose(0, 1), v.transpose(0, 1)
