"""The CUDA backend: attention and memory facts for NVIDIA GPUs.

- Attention: "sdpa" (default) gathers the blocks a step reads for SDPA, and decodes through
  flash-attn's paged kernel where it is installed and takes the cache (``FlashDecodeAttention``);
  "paged" decodes through the block tables with the hand-written Triton kernel
  (``triton_paged.py``) where Triton is importable, else inductor's compiled kernel; "flex"
  FlexAttention over the cache.
- Elementwise ops and linears: the reference's (plain torch; cuBLAS under ``F.linear``).
- Memory: measured for the engine's memory plan through ``CUDAMemoryProbe`` (a profile run
  after loading; ``workers/engine/memory_plan.py``).
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


class CUDAMemoryProbe:
    """The device's memory for the engine's memory plan (``workers.engine.memory_plan.MemoryProbe``):
    torch's caching allocator for this process's tensors, the driver for the whole device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def used(self) -> int:
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()  # cached but unused blocks are not in use
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


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
