"""The flex attention backend (FlexAttention over the physical KV cache, no gathers): greedy
output equals transformers' generate on the tiny architectures with prefix caching, chunked
prefill, preemption and a sliding window; a decode step reads no block through the cache's
gather (the SDPA path reads only the step's tables); a quantized cache refuses flex."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine_helpers import compiled_graphs, random_prompts
from tests.unit.test_engine_parity import GREEDY, assert_matches_hf, make_engine
from tests.unit.test_sliding_window import GREEDY as WINDOW_GREEDY
from tests.unit.test_sliding_window import hf_reference, windowed_model  # noqa: F401 - a fixture
from workers.engine import EngineConfig
from workers.layers.kv_cache import PagedKVCache
from workers.layers.paged_attention import AttentionMetadata, FlexPagedAttention, PagedAttention
from workers.models.config import ModelConfig

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def flex_engine(model_dir: str, **kwargs):
    engine = make_engine(model_dir, attention_backend="flex", **kwargs)
    assert engine.runner.attention_backend == "flex"
    return engine


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_with_preemption_matches_hf(tiny_model_dirs, arch):
    """Chunks of 32 tokens after earlier chunks, decodes of 1..8 sequences, preemption (26 blocks
    cannot hold the batch) and recomputation: token for token transformers' output, with no
    recompilation after start-up and nothing read through gather."""
    model_dir = tiny_model_dirs[arch]
    engine = flex_engine(model_dir, num_kv_blocks=26, max_num_batched_tokens=32)
    prompts = random_prompts()
    frames = compiled_graphs()
    assert_matches_hf(model_dir, prompts, engine.generate(prompts, GREEDY))
    assert engine.stats().preemptions > 0
    assert compiled_graphs() == frames, "a step recompiled the flex graph"
    assert engine.kv.bytes_gathered == 0
    engine.check_idle()


def test_prefix_cache_hit_matches_hf(tiny_model_dirs):
    """A prompt whose first 192 tokens come from the prefix cache: its chunk attends over cached
    blocks through the block mask."""
    model_dir = tiny_model_dirs["qwen3"]
    engine = flex_engine(model_dir)
    prefix = random_prompts((200,), seed=7)[0]
    first, second = prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]
    assert_matches_hf(model_dir, [first], engine.generate([first], GREEDY))
    out = engine.generate([second], GREEDY)
    assert out[0].num_cached_tokens >= 192
    assert_matches_hf(model_dir, [second], out)
    assert engine.kv.bytes_gathered == 0
    engine.check_idle()


@pytest.mark.parametrize("chunk", [None, 24], ids=["default", "chunked-prefill-24"])
def test_sliding_window_matches_hf(windowed_model, chunk):  # noqa: F811 - the imported fixture
    """Mistral with a 64-token window, generating past three windows: the mask_mod's window test
    and the first window block (partial) against transformers."""
    kwargs = {"num_kv_blocks": 64} | ({"max_num_batched_tokens": chunk} if chunk else {})
    engine = flex_engine(windowed_model, **kwargs)
    prompts = random_prompts((5, 40, 150), seed=4)
    for prompt, out in zip(prompts, engine.generate(prompts, WINDOW_GREEDY)):
        assert out.token_ids == hf_reference(windowed_model, prompt), f"{len(prompt)}-token prompt diverged"
    engine.check_idle()


def _decode_step(
    kv: PagedKVCache, attention: type[PagedAttention], tables: list[list[int]], lens: list[int], mask: bool = True
):
    """One decode step's attention over every layer; returns the outputs of each layer. Without
    ``mask`` the step carries no SDPA mask (the gather path then makes its own, as in serving)."""
    heads = kv.num_kv_heads * 2
    bs = kv.block_size
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        write=None,
        num_decodes=len(tables),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor(lens),
        decode_first_pos=torch.zeros(len(tables), dtype=torch.long),
    )
    if mask:
        key_pos = torch.arange(width * bs)[None, :]
        meta.decode_mask = (key_pos <= meta.decode_context_lens[:, None] - 1)[:, None, None]
    attn = attention(kv, meta, kv.head_dim**-0.5)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(tables), heads, kv.head_dim, generator=gen)
    empty = torch.empty(0, kv.num_kv_heads, kv.head_dim)
    return [attn.forward(layer, q, empty, empty) for layer in range(len(kv.layers))]


def test_decode_reads_only_the_steps_blocks(tiny_llama):
    """Three sequences of 2, 3 and 1 blocks in a 4096-block cache: the SDPA path gathers their
    padded tables (3 x 3 blocks per layer, never the context of anything else), the flex path
    gathers nothing, and both attend to the same values."""
    model = ModelConfig.from_dir(tiny_llama)
    kv = PagedKVCache(model, 4096, 16, "auto", torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for layer in kv.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    tables, lens = [[7, 4000], [12, 3, 2048], [99]], [20, 40, 5]
    reference = _decode_step(kv, PagedAttention, tables, lens)
    block_bytes = 2 * kv.block_size * kv.num_kv_heads * kv.head_dim * 4  # K and V of one block
    assert kv.bytes_gathered == len(kv.layers) * 3 * 3 * block_bytes
    cache_bytes = sum(c.numel() * c.element_size() for c in kv.layers)
    assert kv.bytes_gathered * 400 < cache_bytes

    kv.bytes_gathered = 0
    flex = _decode_step(kv, FlexPagedAttention, tables, lens)
    assert kv.bytes_gathered == 0
    for got, want in zip(flex, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_with_a_quantized_cache_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model_dir=tiny_llama, attention_backend="flex", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model_dir=tiny_llama, attention_backend="triton")
    with pytest.raises(ValueError, match="attention_backend='flex' runs with eager decode steps only"):
        EngineConfig(model_dir=tiny_llama, attention_backend="flex", enforce_eager=False)
    model = ModelConfig.from_dir(tiny_llama)
    kv = PagedKVCache(model, 8, 16, "fp8", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend"):
        FlexPagedAttention(kv, AttentionMetadata(write=None), 1.0)


def test_auto_keeps_the_gather_path_for_a_quantized_cache(tiny_llama):
    engine = make_engine(tiny_llama, kv_cache_dtype="int8", num_kv_blocks=32)
    assert engine.runner.attention_backend == "sdpa"
