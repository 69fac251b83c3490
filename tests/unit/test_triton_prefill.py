"""The CUDA prompt-attention kernel (workers/backends/cuda/triton_prefill.py) against attention
computed in float64 over the gathered keys: chunks after cached context read through a shuffled
block table, fresh prompts from their own K/V, GQA with groups of 1, 2 and 3 (padded) heads,
sliding windows (the table starting past freed blocks), and NaN in every slot no query may read.
Runs on CUDA, or on CPU under Triton's interpreter (tests/conftest.py; bf16 on CUDA only, as for
the decode kernel)."""

from __future__ import annotations

import pytest
import torch

from workers.backends.cuda import triton_prefill

ON_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not triton_prefill.available(), reason="needs triton (the test extra installs it)")
DEVICE = "cuda" if ON_CUDA else "cpu"


def reference(q, keys, values, query_pos, key_pos, scale, window):
    """q [n, Hq, D]; keys/values [L, Hkv, D]; float64 softmax attention with the causal and window tests."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    diff = query_pos[:, None] - key_pos[None, :]
    seen = diff >= 0
    if window:
        seen &= diff < window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), v)


def chunk_case(hq, hkv, d, block_size, cached, n, window, seed):
    """A cache of shuffled blocks holding ``cached + n`` keys (the chunk's own written too), the
    chunk's queries and its block table; freed (window) and unwritten slots hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    context = cached + n
    first_block = (max(0, cached - window + 1) // block_size) if window else 0
    first_key_pos = first_block * block_size
    blocks = -(-context // block_size) - first_block
    num_blocks = blocks + 5
    k = torch.full((num_blocks, block_size, hkv, d), float("nan"))
    v = torch.full((num_blocks, block_size, hkv, d), float("nan"))
    table = torch.randperm(num_blocks, generator=gen)[:blocks]
    keys = torch.randn(context - first_key_pos, hkv, d, generator=gen)
    values = torch.randn(context - first_key_pos, hkv, d, generator=gen)
    for j in range(context - first_key_pos):
        k[table[j // block_size], j % block_size] = keys[j]
        v[table[j // block_size], j % block_size] = values[j]
    q = torch.randn(n, hq, d, generator=gen)
    query_pos = torch.arange(cached, context)
    key_pos = torch.arange(first_key_pos, context)
    return q, k, v, table, first_key_pos, context, keys, values, query_pos, key_pos


@pytest.mark.parametrize(
    "hq,hkv,d,block_size,cached,n,window",
    [
        (4, 2, 16, 4, 37, 21, None),  # GQA 2, a chunk after cached context
        (3, 1, 32, 16, 70, 9, None),  # a group of 3, padded to 4
        (2, 2, 16, 4, 5, 80, None),  # more queries than one program's tile
        (4, 2, 16, 4, 50, 30, 24),  # a sliding window: the table starts past freed blocks
        (2, 1, 16, 16, 0, 40, None),  # no cached context, read through the table all the same
    ],
)
def test_a_chunk_attends_through_its_block_table(hq, hkv, d, block_size, cached, n, window):
    q, k, v, table, first, context, keys, values, qpos, kpos = chunk_case(hq, hkv, d, block_size, cached, n, window, 1)
    scale = d**-0.5
    out = triton_prefill.paged_prefill(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), table.to(DEVICE), first, context, scale, window
    )
    expected = reference(q, keys, values, qpos, kpos, scale, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_a_fresh_prompt_reads_its_own_keys_from_strided_views(window):
    gen = torch.Generator().manual_seed(2)
    n, hq, hkv, d = 45, 4, 2, 16
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen)  # the fused projection's output
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    out = triton_prefill.paged_prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None, 0, n, 0.25, window)
    pos = torch.arange(n)
    torch.testing.assert_close(out.double().cpu(), reference(q, k, v, pos, pos, 0.25, window), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not ON_CUDA, reason="Triton's interpreter mishandles bf16 tl.dot")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_chunks_on_cuda(dtype):
    q, k, v, table, first, context, keys, values, qpos, kpos = chunk_case(32, 8, 128, 16, 900, 300, None, 3)
    out = triton_prefill.paged_prefill(
        q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), table.to(DEVICE), first, context, 128**-0.5, None
    )
    expected = reference(q.to(dtype), keys.to(dtype), values.to(dtype), qpos, kpos, 128**-0.5, None)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_the_cuda_backends_prompt_spans_equal_the_reference_attention(tiny_llama, monkeypatch):
    """The CUDA backend's attention object runs its prompt spans through the kernel (a chunk after
    cached context through its block table, a fresh fp32 prompt from its own K/V) and equals the
    reference's gather + SDPA; the interpreter stands in for the GPU here."""
    from workers.backends.cuda import backend as cuda_backend
    from workers.layers.kv_cache import PagedKVCache
    from workers.layers.paged_attention import AttentionMetadata, PagedAttention, PrefillSpan
    from workers.models.config import ModelConfig

    model = ModelConfig.from_dir(tiny_llama)
    kv = PagedKVCache(model, 64, 16, "auto", torch.float32, torch.device(DEVICE))
    if kv.head_dim < 16 or kv.head_dim & (kv.head_dim - 1):
        pytest.skip(f"the tiny model's head_dim {kv.head_dim} is not one the kernel takes")
    monkeypatch.setattr(cuda_backend, "_kernel_device", lambda q: True)
    gen = torch.Generator().manual_seed(4)
    for layer in kv.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    chunk = PrefillSpan(0, 20, 50, torch.tensor([5, 9, 2, 30], device=DEVICE))
    fresh = PrefillSpan(20, 13, 13, None)
    meta = AttentionMetadata(write=None, prefills=[chunk, fresh])
    hq = model.num_heads
    q = torch.randn(33, hq, kv.head_dim, generator=gen).to(DEVICE)
    k = torch.randn(33, kv.num_kv_heads, kv.head_dim, generator=gen).to(DEVICE)
    v = torch.randn(33, kv.num_kv_heads, kv.head_dim, generator=gen).to(DEVICE)
    scale = kv.head_dim**-0.5
    expected = PagedAttention(kv, meta, scale).forward(0, q, k, v)
    calls = []
    real = triton_prefill.paged_prefill
    monkeypatch.setattr(triton_prefill, "paged_prefill", lambda *a, **kw: calls.append(a[3] is None) or real(*a, **kw))
    got = cuda_backend.TritonPromptAttention(kv, meta, scale).forward(0, q, k, v)
    assert calls == [False, True]  # the chunk through its table, the fresh prompt from its own K/V
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_cuda_backend_decodes_through_the_triton_kernel_by_default(tiny_llama, monkeypatch):
    """``auto`` on CUDA: paged (the Triton decode kernel reads the cache in place) for a
    full-precision cache; sdpa for a quantized one, and where Triton does not import."""
    from workers.backends.cuda import backend as cuda_backend
    from workers.engine.config import EngineConfig
    from workers.layers.kv_cache import PagedKVCache
    from workers.models.config import ModelConfig

    model = ModelConfig.from_dir(tiny_llama)
    backend = cuda_backend.CUDABackend(torch.device("cpu"), EngineConfig(model_dir=tiny_llama))
    full = PagedKVCache(model, 8, 16, "auto", torch.float32, torch.device("cpu"))
    quantized = PagedKVCache(model, 8, 16, "int8", torch.float32, torch.device("cpu"))
    assert backend.default_attention(full) == "paged"
    assert backend.default_attention(quantized) == "sdpa"
    monkeypatch.setattr(cuda_backend, "triton_available", lambda: False)
    assert backend.default_attention(full) == "sdpa"


def test_a_prompt_kernel_that_fails_leaves_sdpa_running_and_says_so(tiny_llama, monkeypatch, caplog):
    from workers.backends.cuda import backend as cuda_backend
    from workers.layers.kv_cache import PagedKVCache
    from workers.layers.paged_attention import AttentionMetadata, PagedAttention, PrefillSpan
    from workers.models.config import ModelConfig

    model = ModelConfig.from_dir(tiny_llama)
    kv = PagedKVCache(model, 16, 16, "auto", torch.float32, torch.device("cpu"))
    monkeypatch.setattr(cuda_backend, "_kernel_device", lambda q: True)
    monkeypatch.setattr(cuda_backend, "_prompt_kernel_failed", [])

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(triton_prefill, "paged_prefill", broken)
    meta = AttentionMetadata(write=None, prefills=[PrefillSpan(0, 9, 30, torch.tensor([3, 1]))])
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(9, model.num_heads, kv.head_dim, generator=gen)
    k = v = torch.randn(9, kv.num_kv_heads, kv.head_dim, generator=gen)
    with caplog.at_level("WARNING", logger="workers.backends.cuda.backend"):
        got = cuda_backend.TritonPromptAttention(kv, meta, 0.25).forward(0, q, k, v)
        again = cuda_backend.TritonPromptAttention(kv, meta, 0.25).forward(0, q, k, v)
    expected = PagedAttention(kv, meta, 0.25).forward(0, q, k, v)
    assert torch.equal(got, expected) and torch.equal(again, expected)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "out of resources" in warnings[0]  # once, then the kernel is off
