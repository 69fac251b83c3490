"""The paged attention backend (decodes attend through their block tables in one kernel, no
gathered copy), each test with both CPU kernels: the C++ one (``cpu_paged``, the default for an
fp32 cache) and inductor's (other dtypes, or where the C++ one does not build). Greedy output
equals transformers' generate on the tiny architectures with chunked prefill, preemption,
prefix caching and a sliding window; a decode step reads nothing through the cache's gather and
nothing outside its blocks; batch and table width vary without recompiling; a quantized cache
refuses it."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.unit.engine_helpers import compiled_graphs, random_prompts
from tests.unit.test_engine_parity import GREEDY, assert_matches_hf, make_engine
from tests.unit.test_flex_attention import _decode_step
from tests.unit.test_sliding_window import GREEDY as WINDOW_GREEDY
from tests.unit.test_sliding_window import hf_reference, windowed_model  # noqa: F401 - a fixture
from workers.backends.cpu import paged as cpu_paged
from workers.backends.cpu.attention import CPUPagedAttention
from workers.engine import EngineConfig
from workers.layers.kv_cache import PagedKVCache
from workers.layers.paged_attention import AttentionMetadata, PagedAttention, PagedDecodeAttention
from workers.models.config import ModelConfig

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


_cpp = True  # the kernel fixture's choice: the C++ decode kernel, else inductor's


def paged(kv, meta, scale, min_keys: int = 0):
    """The CPU backend's paged attention with the kernel the test runs (min_keys 0: the tiny
    models' steps read far fewer keys than PAGED_MIN_KEYS, and inductor's kernel runs anyway)."""
    return CPUPagedAttention(kv, meta, scale, min_keys=min_keys, decode_kernel_on=_cpp)


@pytest.fixture(autouse=True, params=["cpp", "inductor"])
def kernel(request) -> str:
    """Which CPU kernel the test runs (the C++ one runs at every size)."""
    global _cpp
    _cpp = request.param == "cpp"
    yield request.param
    _cpp = True


def paged_engine(model_dir: str, **kwargs):
    engine = make_engine(model_dir, attention_backend="paged", paged_min_keys=0, decode_kernel=_cpp, **kwargs)
    assert engine.runner.attention_backend == "paged"
    return engine


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_with_preemption_matches_hf(tiny_model_dirs, arch):
    """Chunks of 32 tokens, decodes of 1..8 sequences, preemption and recomputation: token for
    token transformers' output, with no recompilation after start-up. Only chunks after earlier
    chunks gather (their own context); decodes gather nothing."""
    model_dir = tiny_model_dirs[arch]
    engine = paged_engine(model_dir, num_kv_blocks=26, max_num_batched_tokens=32)
    prompts = random_prompts()
    frames = compiled_graphs()
    assert_matches_hf(model_dir, prompts, engine.generate(prompts, GREEDY))
    assert engine.stats().preemptions > 0
    assert compiled_graphs() == frames, "a step recompiled the paged decode graph"
    engine.check_idle()


def test_decodes_gather_nothing(tiny_model_dirs):
    """Unchunked prompts then decodes: no byte goes through the cache's gather."""
    model_dir = tiny_model_dirs["qwen3"]
    engine = paged_engine(model_dir)
    prompts = random_prompts((3, 17, 40), seed=5)
    assert_matches_hf(model_dir, prompts, engine.generate(prompts, GREEDY))
    assert engine.kv.bytes_gathered == 0


def test_prefix_cache_hit_matches_hf(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]
    engine = paged_engine(model_dir)
    prefix = random_prompts((200,), seed=7)[0]
    first, second = prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]
    assert_matches_hf(model_dir, [first], engine.generate([first], GREEDY))
    out = engine.generate([second], GREEDY)
    assert out[0].num_cached_tokens >= 192
    assert_matches_hf(model_dir, [second], out)


@pytest.mark.parametrize("chunk", [None, 24], ids=["default", "chunked-prefill-24"])
def test_sliding_window_matches_hf(windowed_model, chunk):  # noqa: F811 - the imported fixture
    """Mistral with a 64-token window past three windows: the kernel's window test and tables
    that start at the first window block."""
    kwargs = {"num_kv_blocks": 64} | ({"max_num_batched_tokens": chunk} if chunk else {})
    engine = paged_engine(windowed_model, **kwargs)
    prompts = random_prompts((5, 40, 150), seed=4)
    for prompt, out in zip(prompts, engine.generate(prompts, WINDOW_GREEDY)):
        assert out.token_ids == hf_reference(windowed_model, prompt), f"{len(prompt)}-token prompt diverged"
    engine.check_idle()


def test_decode_reads_only_the_steps_blocks(tiny_llama):
    """Three sequences of 2, 3 and 1 blocks in a 4096-block cache where every other block (and
    every unwritten slot of the sequences' last blocks) holds NaN: the paged kernel's output is
    finite and equals the SDPA path's over clean copies of the same blocks, so it read nothing
    else; and it gathered nothing."""
    model = ModelConfig.from_dir(tiny_llama)
    kv = PagedKVCache(model, 4096, 16, "auto", torch.float32, torch.device("cpu"))
    tables, lens = [[7, 4000], [12, 3, 2048], [99]], [20, 40, 5]
    gen = torch.Generator().manual_seed(1)
    for layer in kv.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    reference = _decode_step(kv, PagedAttention, tables, lens)
    for layer in kv.layers:
        kept = layer.clone()
        layer.fill_(math.nan)
        for table, n in zip(tables, lens):
            for i, block in enumerate(table):
                rows = min(kv.block_size, n - i * kv.block_size)
                layer[:, block, :rows] = kept[:, block, :rows]
    kv.bytes_gathered = 0
    outputs = _decode_step(kv, paged, tables, lens)
    assert kv.bytes_gathered == 0
    for got, want in zip(outputs, reference):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_graph_for_every_batch_and_width(tiny_llama):
    """After start-up's warm-up, batches of 1..9 rows with tables of 1..6 blocks run without
    compiling again (sizes 1 are padded to 2, which dynamo would otherwise specialise)."""
    engine = paged_engine(tiny_llama)
    kv = engine.kv
    frames = compiled_graphs()
    for batch, width in [(1, 1), (2, 1), (1, 6), (9, 3), (4, 2)]:
        tables = [[(r * 7 + i) % 500 + 1 for i in range(width)] for r in range(batch)]
        lens = [width * kv.block_size - r % 5 for r in range(batch)]
        got = _decode_step(kv, paged, tables, lens)
        want = _decode_step(kv, PagedAttention, tables, lens)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert compiled_graphs() == frames, "a decode batch recompiled the paged graph"


def test_small_batches_gather(tiny_llama, kernel):
    """With the inductor kernel, below ``min_keys`` the step gathers and runs SDPA (cheaper
    there), with the same output; at or above it nothing is gathered. The C++ kernel runs at
    every size: nothing is gathered either way."""
    model = ModelConfig.from_dir(tiny_llama)
    kv = PagedKVCache(model, 64, 16, "auto", torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    for layer in kv.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    tables, lens = [[1, 2], [3, 4, 5]], [30, 41]  # 2 rows x 3 padded blocks = 96 keys
    want = _decode_step(kv, PagedAttention, tables, lens)
    kv.bytes_gathered = 0
    below = _decode_step(kv, functools.partial(paged, min_keys=97), tables, lens, mask=False)
    assert (kv.bytes_gathered > 0) == (kernel == "inductor")
    kv.bytes_gathered = 0
    at = _decode_step(kv, functools.partial(paged, min_keys=96), tables, lens, mask=False)
    assert kv.bytes_gathered == 0
    for a, b, w in zip(below, at, want):
        exact = kernel == "inductor"  # the gather path is the reference's arithmetic
        torch.testing.assert_close(a, w, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)
        torch.testing.assert_close(b, w, rtol=1e-5, atol=1e-5)


def test_each_kernel_runs_where_chosen(tiny_llama, kernel):
    """The step's plan is the kernel the test asked for: the C++ one by default on CPU fp32,
    inductor's when it is turned off (so neither parametrisation tests the other by accident)."""
    model = ModelConfig.from_dir(tiny_llama)
    kv = PagedKVCache(model, 16, 16, "auto", torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(
        write=None,
        num_decodes=1,
        decode_block_tables=torch.tensor([[1, 2]]),
        decode_context_lens=torch.tensor([20]),
        decode_first_pos=torch.zeros(1, dtype=torch.long),
    )
    attn = paged(kv, meta, 1.0)
    empty = torch.empty(0, kv.num_kv_heads, kv.head_dim)
    attn.forward(0, torch.zeros(1, 2 * kv.num_kv_heads, kv.head_dim), empty, empty)
    assert (attn._plan is cpu_paged.paged_decode) == (kernel == "cpp")


def test_paged_with_a_quantized_cache_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model_dir=tiny_llama, attention_backend="paged", kv_cache_dtype="fp8")
    model = ModelConfig.from_dir(tiny_llama)
    kv = PagedKVCache(model, 8, 16, "int8", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend"):
        PagedDecodeAttention(kv, AttentionMetadata(write=None), 1.0)


def test_auto_runs_paged_on_cpu(tiny_llama):
    """The CPU backend's choice for a full-precision cache (CPUBackend.default_attention)."""
    engine = make_engine(tiny_llama)
    assert engine.runner.attention_backend == "paged"


def test_serving_args_carry_the_backend(tiny_llama):
    """``pdserve up --attention-backend`` reaches the engine's arguments; paged over a quantized
    cache, and flex with compiled decode steps, are refused before any replica starts."""
    from pydantic import ValidationError

    from deploy.args import PDServeArgs
    from deploy.ops.cli import build_parser, up_app_args

    flags = ["up", "--model", tiny_llama, "--threads-per-replica", "1", "--attention-backend", "sdpa"]
    args = up_app_args(build_parser().parse_args(flags), tiny_llama, None)
    assert args.engine_kwargs("cpu")["attention_backend"] == "sdpa"
    assert PDServeArgs(model=tiny_llama).engine_kwargs("cpu")["attention_backend"] == "auto"
    with pytest.raises(ValidationError, match="attention_backend paged needs kv_cache_dtype auto"):
        PDServeArgs(model=tiny_llama, attention_backend="paged", kv_cache_dtype="int8")
    with pytest.raises(ValidationError, match="attention_backend flex runs with eager decode steps only"):
        PDServeArgs(model=tiny_llama, attention_backend="flex", enforce_eager=False)
    PDServeArgs(model=tiny_llama, attention_backend="paged", enforce_eager=False)  # compiled paged is fine


def test_kernel_runs_on_the_engine_loops_thread(tiny_llama):
    """Serving steps run on the engine loop's own thread, not the one that compiled at start-up:
    the graph is reused there (no recompilation) and gives the same output."""
    import threading

    engine = paged_engine(tiny_llama)
    kv = engine.kv
    tables, lens = [[3, 4], [5, 6, 7]], [25, 40]
    want = _decode_step(kv, PagedAttention, tables, lens)
    graphs = compiled_graphs()
    got: list = []
    thread = threading.Thread(target=lambda: got.append(_decode_step(kv, paged, tables, lens)))
    thread.start()
    thread.join()
    assert compiled_graphs() == graphs, "the loop's thread compiled the paged graph again"
    for g, w in zip(got[0], want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
