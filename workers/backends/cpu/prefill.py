"""Prompt attention on CPU (fp32) as one hand-written C++ kernel: causal, GQA, sliding window,
over the step's own K/V (a fresh prompt) or the paged cache (a chunk after cached context),
without a gathered copy.

A prompt's attention went to ``F.scaled_dot_product_attention``: aten's flash kernel for CPU
(``cpu_flash_attention``) for a fresh prompt, and for a chunk after cached tokens the same kernel
with an additive mask over a gathered copy of the sequence's blocks. On 2 cores (Zen 4, SmolLM2's
shapes: 9 query heads over 3 KV heads of 64) it ran a 256-token prompt's 30 layers in 41 ms, 55
GFLOPS of the causal half's arithmetic, an eighth of a 256-token prefill; at 1024 tokens 400
ms. It cuts a 256-token prompt's queries into blocks of 64 and its keys into blocks of 512
(``cpu_flash_attention<float, float, 64, 512>`` in ``perf``), so every query block multiplies
every key of the prompt and masks the causal half away; each query head of a GQA group reads its
K/V apart, and each block product goes through MKL's sgemm.

Here one task takes one KV head and ``QB`` consecutive queries: the ``QB x G`` query rows of
that head's group, stacked (position-major), share every K/V row they read. The task walks the
keys the block can see (from the window's start, or the first key, to its last query's
position) ``KC`` at a time. For each chunk it copies the chunk's K rows transposed into a
``[D][KC]`` buffer (so a score row is ``D`` broadcast-and-FMA steps over ``KC / VL`` vectors,
with ``MS`` rows' scores in registers: the panel kernel's tile, ``cpu_linear``), masks what a
row may not see (only in the chunks that cross a row's causal edge or window start), updates
each row's running maximum and sum (online softmax, exponentials through ``at::vec``'s Sleef
``exp``) and adds the chunk's V rows weighted by the row's probabilities into the row's output,
``MO`` rows of ``D`` in registers at a time. Tasks run in order of decreasing work (the last
query blocks see the most keys) under OpenMP's dynamic schedule. Keys are addressed through a
row index per key (``key_rows``): a fresh prompt's are its own rows of the step's K/V, a
chunk's are its cache slots (``table[j // bs] * bs + j % bs``), so one kernel reads either and
the cache is read in place.

Not bit for bit SDPA: the sums run in another order (each score is ``D`` FMAs from ``k = 0``
up, each output a sum over keys in position order). The engine's greedy parity with
transformers is held by its tests with this kernel on (``test_engine_parity.py``,
``test_real_model.py``, ``test_cpu_prefill.py``), as for the panel kernel. The paged backend
(CPU's default) runs it (``CPUPagedAttention._prompt_kernel``); ``CPUOptions(prompt_kernel=False)``
turns it off, and the SDPA backend (``attention_backend="sdpa"``) stays the reference. The kernel
is ``csrc/prefill.cpp`` (its vector type ``csrc/vector.h``, the panel kernels'), built once per
(group, head dim) through ``build.py``, as ``cpu_paged``'s is; where it cannot be built prompts
keep SDPA.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from workers.backends.cpu import build as loader

QB = 64  # query positions per task (x the group's heads: the rows that share a K/V chunk)


@functools.cache
def build(group: int, head_dim: int, max_vector_floats: int) -> Any:
    """The kernel (``csrc/prefill.cpp``) for one (group, head dim), with vectors of at most
    ``max_vector_floats`` floats (16: AVX-512 where the CPU has it; below that only for the
    tests). Every caller passes all three (one cache key per kernel)."""
    return loader.kernel("prefill", group=group, head_dim=head_dim, qb=QB, max_vl=max_vector_floats)


@functools.cache
def available(group: int, head_dim: int) -> bool:
    """Whether the kernel builds here for this shape (asked once per shape; a failure is logged
    and prompts keep SDPA)."""
    return loader.usable("prefill", group, head_dim)


# build.py's registry (the lambda looks ``build`` up when called); ``warm``: SmolLM2's 9 heads over 3
loader.register(
    "prefill",
    loader.SelfCheck("CPU prompt-attention", "SDPA for prompts", lambda g, d: build(g, d, 16), warm=((3, 64),)),
)


def _rows_of_heads(x: torch.Tensor) -> bool:
    """``[rows, heads, dim]`` fp32 on CPU whose heads lie one after another in each row."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel runs this attention: CPU fp32, a head dim of whole 16-float vectors,
    rows whose heads are contiguous, and the kernel built for the shape."""
    return (
        _rows_of_heads(q)
        and _rows_of_heads(k)
        and _rows_of_heads(v)
        and q.shape[-1] % 16 == 0
        and q.shape[-2] % k.shape[-2] == 0
        and available(q.shape[-2] // k.shape[-2], q.shape[-1])
    )


def check_key_rows(key_rows: torch.Tensor, num_rows: int) -> None:
    """Raise ``IndexError`` for a key row outside ``[0, num_rows)`` (the kernel reads it unchecked)."""
    if key_rows.numel() and (int(key_rows.min()) < 0 or int(key_rows.max()) >= num_rows):
        raise IndexError(f"a key row is outside the {num_rows} rows of k and v")


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_rows: torch.Tensor,
    q_pos0: int,
    k_pos0: int,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
    max_vector_floats: int = 16,
    check: bool = True,
) -> torch.Tensor:
    """Attention of ``n`` queries over ``len(key_rows)`` keys (see the module docstring).

    q ``[n, Hq, D]`` and out (made if None) ``[n, Hq, D]``, any row stride; k and v
    ``[rows, Hkv, D]``, any row strides (the step's K/V, or a cache layer's flat view);
    key_rows ``[L]`` int64, key ``j``'s row of k/v. Query ``i`` is at position ``q_pos0 + i``,
    key ``j`` at ``k_pos0 + j``; every query must see at least its own position's key. ``check=False``
    skips ``check_key_rows`` (a caller that checked the step's rows once for every layer)."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if v.shape[1:] != k.shape[1:] or v.shape[0] != k.shape[0]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if out is None:
        out = torch.empty(n, num_q_heads, head_dim, dtype=q.dtype)
    elif out.shape != q.shape or not _rows_of_heads(out):
        raise ValueError(f"out {tuple(out.shape)} must be q's shape {tuple(q.shape)} with each row's heads contiguous")
    if n == 0:
        return out
    key_rows = key_rows.contiguous()
    if check:
        check_key_rows(key_rows, k.shape[0])
    kernel = build(num_q_heads // num_kv_heads, head_dim, max_vector_floats)
    kernel(
        q,
        k,
        v,
        key_rows,
        out,
        n,
        key_rows.numel(),
        num_kv_heads,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        out.stride(0),
        q_pos0,
        k_pos0,
        window or 0,
        torch.get_num_threads(),
        float(scale),
    )
    return out
