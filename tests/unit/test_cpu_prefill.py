"""The CPU prompt-attention kernel (``workers/backends/cpu/prefill.py``): the attention of a fresh
prompt and of a chunk after cached tokens, against a float64 reference, at each vector width this
CPU runs; out-of-range key rows refused; and the engine, with the kernel on, serving
transformers' greedy tokens for fresh prompts, chunks after a cached prefix and sliding windows,
with the kernel really taking those spans (and not under the SDPA reference backend)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.unit.engine_helpers import hf_greedy
from workers.backends.cpu import prefill as cpu_prefill


def _widths() -> list[int]:
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": [16, 8, 4], "AVX2": [8, 4]}.get(capability, [4])


pytestmark = pytest.mark.skipif(not cpu_prefill.available(2, 16), reason="the kernel does not build here")


def _reference(q, k, v, q_pos0, k_pos0, scale, window):
    """Masked softmax attention in float64: q [n, Hq, D], k/v [L, Hkv, D] in key order."""
    n, num_keys = q.shape[0], k.shape[0]
    qpos = torch.arange(q_pos0, q_pos0 + n)[:, None]
    kpos = torch.arange(k_pos0, k_pos0 + num_keys)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= qpos - kpos < window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].double(),
        k.transpose(0, 1)[None].double(),
        v.transpose(0, 1)[None].double(),
        attn_mask=allowed,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).float()


# (queries, cached keys before them, q heads, kv heads, head dim, window)
CASES = [
    (256, 0, 9, 3, 64, None),  # SmolLM2's shapes, a fresh prompt
    (37, 0, 9, 3, 64, None),  # a tail block of queries, keys not a whole chunk
    (100, 300, 9, 3, 64, None),  # a chunk after cached tokens
    (1, 5, 9, 3, 64, None),  # one query
    (130, 0, 8, 2, 128, None),  # a wider head, a group of four
    (200, 50, 4, 4, 32, 64),  # no GQA, a window shorter than the chunk
    (70, 0, 6, 2, 16, 16),  # a fresh prompt longer than its window
]


@pytest.mark.parametrize("width", _widths())
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(str(x) for x in c))
def test_matches_a_float64_reference(case, width):
    n, cached, hq, hkv, d, window = case
    gen = torch.Generator().manual_seed(n * 7 + cached)
    num_keys = cached + n
    total = num_keys + 11  # rows of k/v the keys are scattered over (a cache's slots)
    k = torch.randn(total, hkv, d, generator=gen)
    v = torch.randn(total, hkv, d, generator=gen)
    rows = torch.randperm(total, generator=gen)[:num_keys]
    # q as the engine has it: a strided view of a wider row (the fused projection's output)
    q = torch.randn(n, hq + 2 * hkv, d, generator=gen)[:, :hq]
    out = torch.full((n + 3, hq, d), float("nan"))[1 : n + 1]  # out[rows] of a bigger tensor
    scale = d**-0.5
    cpu_prefill.prefill_attention(q, k, v, rows, cached, 0, scale, window, out=out, max_vector_floats=width)
    ref = _reference(q, k[rows], v[rows], cached, 0, scale, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)


def test_key_positions_start_where_the_table_does():
    """A chunk whose table starts past position 0 (a sliding window's first block): keys at
    k_pos0 + j."""
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(96, 2, 16, generator=gen), torch.randn(96, 2, 16, generator=gen)
    q = torch.randn(20, 4, 16, generator=gen)
    rows = torch.arange(10, 90)  # keys at positions 32 .. 111, the queries at 92 .. 111
    out = cpu_prefill.prefill_attention(q, k, v, rows, 92, 32, 0.25, 48)
    torch.testing.assert_close(out, _reference(q, k[rows], v[rows], 92, 32, 0.25, 48), rtol=1e-5, atol=2e-6)


def test_a_key_row_out_of_range_is_refused():
    k = v = torch.zeros(8, 1, 16)
    q = torch.zeros(2, 1, 16)
    with pytest.raises(IndexError, match="outside the 8 rows"):
        cpu_prefill.prefill_attention(q, k, v, torch.tensor([0, 8]), 0, 0, 1.0, None)
    with pytest.raises(IndexError):
        cpu_prefill.prefill_attention(q, k, v, torch.tensor([-1, 0]), 0, 0, 1.0, None)


def test_an_output_of_another_layout_is_refused():
    q, k = torch.zeros(4, 2, 16), torch.zeros(4, 1, 16)
    heads_apart = torch.zeros(2, 4, 16).transpose(0, 1)  # [4, 2, 16] with a row's heads 64 floats apart
    with pytest.raises(ValueError, match="each row's heads contiguous"):
        cpu_prefill.prefill_attention(q, k, k, torch.arange(4), 0, 0, 1.0, None, out=heads_apart)


def test_takes_only_cpu_fp32_rows_of_heads():
    q, k = torch.zeros(4, 4, 16), torch.zeros(4, 2, 16)
    assert cpu_prefill.takes(q, k, k)
    assert not cpu_prefill.takes(q.double(), k.double(), k.double())
    assert not cpu_prefill.takes(torch.zeros(4, 4, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8))  # head dim 8
    assert not cpu_prefill.takes(q.transpose(0, 1), k, k)  # heads not one after another in a row


class _Spy:
    """Counts the spans the kernel takes, fresh (k_pos0 = q_pos0 = 0 over the step's rows) or not."""

    def __init__(self, monkeypatch) -> None:
        self.fresh = self.chunks = 0
        self._run = cpu_prefill.prefill_attention
        monkeypatch.setattr(cpu_prefill, "prefill_attention", self)

    def __call__(self, q, k, v, key_rows, q_pos0, k_pos0, *args, **kwargs):
        if q_pos0 == 0:
            self.fresh += 1
        else:
            self.chunks += 1
        return self._run(q, k, v, key_rows, q_pos0, k_pos0, *args, **kwargs)


def _engine(model_dir: str, **kwargs):
    from workers.engine import LLMEngine

    return LLMEngine(model_dir, load_progress=False, num_kv_blocks=96, **kwargs)


def _greedy(engine, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    from workers.engine import SamplingParams

    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [list(output.token_ids) for output in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])  # plain; q/k/v biases; a sliding window
def test_engine_serves_transformers_tokens_through_the_kernel(tiny_model_dirs, arch, monkeypatch):
    """Fresh prompts, then prompts that extend a cached prefix (their new tokens attend over the
    cached blocks in place), greedy: transformers' tokens, with the kernel taking both kinds."""
    model_dir = tiny_model_dirs[arch]
    spy = _Spy(monkeypatch)
    engine = _engine(model_dir, enable_prefix_caching=True)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(5, 250, (40,), generator=gen).tolist()
    fresh = [prefix + torch.randint(5, 250, (9,), generator=gen).tolist(), [7, 8, 9]]
    extended = [prefix + torch.randint(5, 250, (n,), generator=gen).tolist() for n in (3, 21)]
    assert _greedy(engine, fresh) == [hf_greedy(model_dir, tuple(p), 24) for p in fresh]
    assert spy.fresh > 0 and spy.chunks == 0
    assert _greedy(engine, extended) == [hf_greedy(model_dir, tuple(p), 24) for p in extended]
    assert spy.chunks > 0, "the prompts after the cached prefix did not run through the kernel"


def test_the_switch_and_the_sdpa_backend_keep_sdpa(tiny_llama, monkeypatch):
    spy = _Spy(monkeypatch)
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    with_kernel = _greedy(_engine(tiny_llama), prompts)
    taken = spy.fresh
    assert taken > 0
    assert _greedy(_engine(tiny_llama, attention_backend="sdpa"), prompts) == with_kernel
    assert spy.fresh == taken, "the SDPA reference backend ran the kernel"
    assert _greedy(_engine(tiny_llama, prompt_kernel=False), prompts) == with_kernel
    assert spy.fresh == taken, "prompt_kernel=False still ran the kernel"


def test_the_kernel_is_built_at_start_up_not_in_a_request(tiny_llama, monkeypatch):
    """The engine's start-up (the paged backend's warm-up) builds the kernel; the first prompt
    then finds it built (no C++ compile while a request waits)."""
    monkeypatch.setattr(cpu_prefill, "build", functools.cache(cpu_prefill.build.__wrapped__))
    monkeypatch.setattr(cpu_prefill, "available", functools.cache(cpu_prefill.available.__wrapped__))
    engine = _engine(tiny_llama)
    built = cpu_prefill.build.cache_info()
    assert built.currsize == 1
    spy = _Spy(monkeypatch)
    _greedy(engine, [[3, 4, 5, 6, 7]])
    assert spy.fresh > 0
    assert cpu_prefill.build.cache_info().currsize == 1, "a request built the kernel"
