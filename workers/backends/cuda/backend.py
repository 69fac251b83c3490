"""The CUDA backend: attention and memory facts for NVIDIA GPUs.

- Attention: "paged" (the default for a full-precision cache where Triton imports, decision
  0026) decodes through the block tables with the hand-written Triton kernel
  (``triton_paged.py``), else inductor's compiled kernel; "sdpa" (the default otherwise) gathers
  the blocks a step's decodes read for SDPA, and decodes through flash-attn's paged kernel where
  it is installed and takes the cache (``FlashDecodeAttention``); "flex" FlexAttention over the
  cache. In "paged" and "sdpa", prompt chunks after cached context (and fresh prompts SDPA's
  flash kernel does not take) run the Triton prompt kernel over the cache in place
  (``TritonPromptAttention``, ``triton_prefill.py``).
- Elementwise ops and linears: the reference's (plain torch; cuBLAS under ``F.linear``).
- Memory: measured for the engine's memory plan through ``CUDAMemoryProbe`` (a profile run
  after loading; ``workers/engine/memory_plan.py``).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

from workers.backends.base import AttentionFactory, Backend
from workers.backends.cuda import triton_available, triton_prefill
from workers.layers.paged_attention import DecodeKernel, PagedAttention, PagedDecodeAttention, PrefillSpan

if TYPE_CHECKING:
    from workers.layers.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

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


_prompt_kernel_failed: list[str] = []  # why the prompt kernel failed in this process, once


def _kernel_device(q: torch.Tensor) -> bool:
    """Whether the Triton kernels run on ``q``'s device (a test under Triton's interpreter says yes on CPU)."""
    return q.device.type == "cuda"


class TritonPromptAttention(PagedAttention):
    """Prompt spans through the Triton prompt kernel (``triton_prefill.py``), which reads a
    chunk's context from the cache in place: a chunk after cached context always (SDPA there
    needs an explicit mask, which rules out its fused kernels), a fresh prompt where SDPA's flash
    kernel would not take it (fp32, or a window shorter than the prompt). A fresh fp16/bf16
    prompt without a window stays on SDPA (causal, GQA: the flash kernel); a quantized cache and
    head sizes the kernel does not take keep the gather path."""

    def _prompt_kernel(
        self, layer: int, span: PrefillSpan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> bool:
        head_dim = q.shape[-1]
        if not _kernel_device(q) or head_dim < 16 or head_dim & (head_dim - 1) or not triton_prefill.available():
            return False
        if _prompt_kernel_failed:
            return False
        try:
            return self._run_prompt_kernel(layer, span, q, k, v, out)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile or launch here: SDPA runs
            _prompt_kernel_failed.append(f"{type(exc).__name__}: {exc}")
            logger.warning("the Triton prompt kernel failed (%s); gather + SDPA runs prompt chunks", exc)
            return False

    def _run_prompt_kernel(
        self, layer: int, span: PrefillSpan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> bool:
        rows = slice(span.start, span.start + span.num_tokens)
        window = self.meta.sliding_window
        if span.fresh:
            if q.dtype != torch.float32 and (window is None or span.num_tokens <= window):
                return False
            triton_prefill.paged_prefill(
                q[rows], k[rows], v[rows], None, 0, span.num_tokens, self.scale, window, out=out[rows]
            )
            return True
        if span.block_table is None or self.cache.quantized:
            return False
        layer_cache = self.cache.layers[layer]
        triton_prefill.paged_prefill(
            q[rows],
            layer_cache[0],
            layer_cache[1],
            span.block_table,
            span.first_key_pos,
            span.context_len,
            self.scale,
            window,
            out=out[rows],
        )
        return True


class FlashDecodeAttention(TritonPromptAttention):
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


class TritonPagedAttention(PagedDecodeAttention, TritonPromptAttention):
    """The paged attention with the Triton decode kernel where Triton is importable (and the
    Triton prompt kernel)."""

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

    def default_attention(self, kv: PagedKVCache) -> str:
        # paged: decodes read the cache in place (gather + SDPA with a key mask can land on SDPA's
        # math path, and copies a step's KV per layer); flash-attn's kernel where it takes the
        # cache, and a quantized cache, stay on sdpa (decision 0026)
        if kv.quantized or flash_attn_usable(kv, None) or not triton_available():
            return "sdpa"
        return "paged"

    def attention(self, kind: str, kv: PagedKVCache, window: int | None) -> AttentionFactory:
        if kind == "paged":
            return functools.partial(TritonPagedAttention, ops=self.ops)
        if kind == "sdpa":
            cls = FlashDecodeAttention if flash_attn_usable(kv, window) else TritonPromptAttention
            return functools.partial(cls, ops=self.ops)
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
