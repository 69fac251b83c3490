"""The CPU backend's paged attention: the hand-written C++ decode kernel (``paged.py``, fp32 or bf16)
and the prompt kernel (``prefill.py``, fp32), both reading the cache in place.

``CPUPagedAttention`` is ``PagedDecodeAttention`` with those two kernels where they take the step
(each builds and passes its self-check once per shape); where they do not, the generic paths run
(inductor's compiled decode or gather + SDPA, SDPA for prompts).
"""

from __future__ import annotations

import torch

from workers.backends.base import Ops
from workers.backends.cpu import paged as cpu_paged
from workers.backends.cpu import prefill as cpu_prefill
from workers.layers.kv_cache import PagedKVCache
from workers.layers.paged_attention import (
    PAGED_MIN_KEYS,
    AttentionMetadata,
    DecodeKernel,
    PagedDecodeAttention,
    PrefillSpan,
)


def decode_kernel_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decodes with queries like ``q`` run the C++ kernel on ``k_cache``: a CPU fp32 or
    bf16 cache of a shape it takes, and the kernel built for that shape and dtype."""
    if not cpu_paged.supports(q, k_cache):
        return False
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    bf16 = int(q.dtype == torch.bfloat16)
    return cpu_paged.available(block_size, num_kv_heads, q.shape[1] // num_kv_heads, head_dim, bf16)


class CPUPagedAttention(PagedDecodeAttention):
    """The paged backend on CPU (module docstring). ``decode_kernel_on`` / ``prompt_kernel_on``:
    False runs the generic path instead (the kernels' own tests and benchmarks compare them)."""

    def __init__(
        self,
        kv: PagedKVCache | None,
        meta: AttentionMetadata,
        scale: float,
        ops: Ops | None = None,
        min_keys: int = PAGED_MIN_KEYS,
        decode_kernel_on: bool = True,
        prompt_kernel_on: bool = True,
    ):
        super().__init__(kv, meta, scale, ops, min_keys)
        self.decode_kernel_on = decode_kernel_on
        self.prompt_kernel_on = prompt_kernel_on
        self._prompt_kernel_takes: bool | None = None  # decided on the first span of the step
        # by span start: (key rows, first query position, first key position), made and checked once a step
        self._prompt_plans: dict[int, tuple[torch.Tensor, int, int]] = {}

    def decode_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> DecodeKernel | None:
        if self.decode_kernel_on and decode_kernel_usable(q, k_cache):
            return cpu_paged.paged_decode
        return None

    def _prompt_kernel(
        self, layer: int, span: PrefillSpan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> bool:
        """Attend ``span``'s rows of q into ``out`` with the prompt kernel: a fresh prompt over its
        own rows of the step's K/V, a chunk after cached tokens over its blocks of the cache, in
        place. False where the kernel does not take the step (SDPA runs instead)."""
        if self._prompt_kernel_takes is None:
            self._prompt_kernel_takes = self.prompt_kernel_on and cpu_prefill.takes(q, k, v)
        if not self._prompt_kernel_takes:
            return False
        if span.fresh:
            keys, values = k, v
        else:
            flat = self.cache.flat(layer)
            keys, values = flat[0], flat[1]
        plan = self._prompt_plans.get(span.start)
        if plan is None:
            plan = self._prompt_plan(span, keys.shape[0])
            self._prompt_plans[span.start] = plan
        key_rows, q_pos0, k_pos0 = plan
        rows = slice(span.start, span.start + span.num_tokens)
        cpu_prefill.prefill_attention(
            q[rows],
            keys,
            values,
            key_rows,
            q_pos0,
            k_pos0,
            self.scale,
            self.meta.sliding_window,
            out[rows],
            check=False,
        )
        return True

    def _prompt_plan(self, span: PrefillSpan, num_rows: int) -> tuple[torch.Tensor, int, int]:
        """The span's key rows (a fresh prompt's own rows of the step; a chunk's cache slots, from
        its block table), checked against the ``num_rows`` they index, and the positions of its
        first query and first key."""
        if span.fresh:
            key_rows = torch.arange(span.start, span.start + span.num_tokens)
            q_pos0 = k_pos0 = 0
        else:
            if span.block_table is None:
                raise ValueError("a chunk after cached tokens needs its block table")
            block_size = self.cache.block_size
            j = torch.arange(span.context_len - span.first_key_pos)
            key_rows = span.block_table.to(torch.int64)[j // block_size] * block_size + j % block_size
            q_pos0, k_pos0 = span.context_len - span.num_tokens, span.first_key_pos
        cpu_prefill.check_key_rows(key_rows, num_rows)
        return key_rows, q_pos0, k_pos0


def warm_up(kv: PagedKVCache, num_q_heads: int, prompt_kernel_on: bool = True) -> bool:
    """Build the prompt and decode kernels for ``kv``'s shape now, not in a request; True when
    the decode kernel runs (else inductor's compiled decode needs compiling)."""
    probe = torch.zeros(1, num_q_heads, kv.head_dim, dtype=kv.dtype, device=kv.layers[0].device)
    if prompt_kernel_on and not kv.quantized:
        flat = kv.flat(0)
        cpu_prefill.takes(probe, flat[0], flat[1])  # builds the kernel for this shape where it runs
    return decode_kernel_usable(probe, kv.layers[0][0])
