"""The CUDA backend: attention and memory facts for NVIDIA GPUs.

- Attention: "sdpa" (default) gathers the blocks a step reads for SDPA, and decodes through
  flash-attn's paged kernel where it is installed and takes the cache (``FlashDecodeAttention``);
  "paged" decodes through the block tables with the hand-written Triton kernel
  (``triton_paged.py``) where Triton is importable, else inductor's compiled kernel; "flex"
  FlexAttention over the cache.
- Elementwise ops and linears: the reference's (plain torch; cuBLAS under ``F.linear``).
- Memory: ``gpu_memory_utilization`` of the device less what is in use after loading.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from workers.backends.base import AttentionFactory, Backend
from workers.layers.paged_attention import DecodeKernel, PagedAttention, PagedDecodeAttention

if TYPE_CHECKING:
    from workers.layers.kv_cache import PagedKVCache

try:  # optional
    from flash_attn import flash_attn_with_kvcache
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_with_kvcache = None


def flash_attn_usable(kv: PagedKVCache, window: int | None) -> bool:
    """Whether flash-attn's paged kernel reads ``kv`` for decodes: installed, a block size it
    accepts (a multiple of 256), a full-precision cache, full attention."""
    return (
        flash_attn_with_kvcache is not None
        and kv.layers[0].device.type == "cuda"
        and kv.block_size % 256 == 0
        and not kv.quantized
        and window is None
    )


class FlashDecodeAttention(PagedAttention):
    """The sdpa kind with decodes through flash-attn's paged kernel over the block tables."""

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta, layer_cache = self.meta, self.cache.layers[layer]
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if tables is None or lens is None:
            raise ValueError("a step with decodes needs their block tables and context lengths")
        assert flash_attn_with_kvcache is not None
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


class TritonPagedAttention(PagedDecodeAttention):
    """The paged attention with the Triton decode kernel where Triton is importable."""

    def decode_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> DecodeKernel | None:
        from workers.backends.cuda import triton_paged

        if q.device.type == "cuda" and triton_paged.available():
            return triton_paged.paged_decode
        return None


def cuda_kv_blocks(device: torch.device, utilization: float, bytes_per_block: int) -> int:
    """KV blocks that ``utilization`` of the device holds beside what is in use now."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * utilization) - used
    if budget < bytes_per_block:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {used / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
            f"in use after loading; raise gpu_memory_utilization or use a smaller model"
        )
    return budget // bytes_per_block


class CUDABackend(Backend):
    name = "cuda"
    attention_kinds = ("sdpa", "paged", "flex")

    def attention(self, kind: str, kv: PagedKVCache, window: int | None) -> AttentionFactory:
        if kind == "paged":
            return functools.partial(TritonPagedAttention, ops=self.ops)
        if kind == "sdpa" and flash_attn_usable(kv, window):
            return functools.partial(FlashDecodeAttention, ops=self.ops)
        return super().attention(kind, kv, window)

    def warm_up_attention(
        self, kind: str, kv: PagedKVCache, scale: float, num_q_heads: int, window: int | None
    ) -> None:
        from workers.backends.cuda import triton_paged

        if kind == "paged" and not triton_paged.available():
            from workers.layers.paged_attention import warm_up_paged_decode

            warm_up_paged_decode(kv, scale, num_q_heads, window)  # inductor's kernel runs instead
        else:
            super().warm_up_attention(kind, kv, scale, num_q_heads, window)

    def describe(self) -> str:
        return f"cuda backend on {torch.cuda.get_device_name(self.device)} ({self.device})"
