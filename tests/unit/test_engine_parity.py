"""Greedy output of the engine equals transformers' generate, token for token (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine_helpers import MAX_NEW_TOKENS, hf_greedy, random_prompts
from workers.engine import LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
ARCHS = ("llama", "qwen2", "qwen3")


# The conformance suite: every test below runs on each backend this machine has (the reference
# is the specification; a new backend is added by passing these).
BACKENDS = ("cpu", "reference") + (("cuda",) if torch.cuda.is_available() else ())
_backend = BACKENDS[0]


@pytest.fixture(autouse=True, params=BACKENDS)
def backend(request):
    global _backend
    _backend = request.param
    yield request.param
    _backend = BACKENDS[0]


def make_engine(model_dir: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_kv_blocks", 512)
    kwargs.setdefault("backend", _backend)
    kwargs.setdefault("device", "cuda" if _backend == "cuda" else "cpu")
    engine = LLMEngine(model_dir, load_progress=False, **kwargs)
    assert engine.backend.name == _backend
    return engine


def assert_matches_hf(model_dir: str, prompts: list[list[int]], outs) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_greedy(model_dir, tuple(prompt))
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == ("length" if len(expected) == MAX_NEW_TOKENS else "stop")


@pytest.mark.parametrize("arch", ARCHS)
def test_single_prompt(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    engine = make_engine(model_dir)
    prompt = random_prompts((45,), seed=1)
    assert_matches_hf(model_dir, prompt, engine.generate(prompt, GREEDY))
    engine.check_idle()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"enable_prefix_caching": True}, id="prefix-cache-on"),
        pytest.param({"enable_prefix_caching": False}, id="prefix-cache-off"),
        pytest.param({"max_num_batched_tokens": 32}, id="chunked-prefill-32"),
        pytest.param({"num_kv_blocks": 26}, id="preemption-26-blocks"),
    ],
)
def test_batch_of_prompts(tiny_model_dirs, arch, engine_kwargs):
    model_dir = tiny_model_dirs[arch]
    engine = make_engine(model_dir, **engine_kwargs)
    prompts = random_prompts()
    outs = engine.generate(prompts, GREEDY)
    assert_matches_hf(model_dir, prompts, outs)
    if "num_kv_blocks" in engine_kwargs:
        # 8 prompts (750 tokens, +64 each) cannot all fit in 26 x 16 = 416 tokens
        assert engine.stats().preemptions > 0
    engine.check_idle()


def test_preemption_with_prefix_caching_off_still_exact(tiny_llama):
    engine = make_engine(tiny_llama, num_kv_blocks=26, enable_prefix_caching=False, max_num_batched_tokens=64)
    prompts = random_prompts(seed=3)
    assert_matches_hf(tiny_llama, prompts, engine.generate(prompts, GREEDY))
    assert engine.stats().preemptions > 0
    engine.check_idle()


def test_shared_prefix_is_served_from_cache(tiny_llama):
    engine = make_engine(tiny_llama)
    prefix = random_prompts((200,), seed=7)[0]
    first = prefix + [11, 12, 13]
    second = prefix + [21, 22, 23, 24, 25]
    out1 = engine.generate([first], GREEDY)[0]
    out2 = engine.generate([second], GREEDY)[0]
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens >= 192
    cold = make_engine(tiny_llama).generate([second], GREEDY)[0]
    assert cold.num_cached_tokens == 0
    assert out2.token_ids == cold.token_ids == hf_greedy(tiny_llama, tuple(second))
    engine.check_idle()


def test_identical_prompt_reuses_all_but_the_last_token(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompts((64,), seed=9)[0]  # exactly 4 blocks
    a = engine.generate([prompt], GREEDY)[0]
    b = engine.generate([prompt], GREEDY)[0]
    assert b.num_cached_tokens == 48  # the last block is recomputed for its logits
    assert a.token_ids == b.token_ids
    engine.check_idle()


def test_the_fp32_norm_is_one_op_and_bit_for_bit_transformers_arithmetic(backend):
    """RMSNorm runs ``F.rms_norm`` in fp32 (one op instead of six a norm, two norms a layer);
    it must equal transformers' LlamaRMSNorm exactly, at model widths and q/k-norm head dims.
    Other dtypes keep transformers' rounding (normalized, cast to the input dtype, then scaled)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from workers.backends.base import Ops
    from workers.backends.cpu.backend import CPUOps
    from workers.models.llama import RMSNorm

    ops = CPUOps() if backend == "cpu" else Ops()
    torch.manual_seed(3)
    for width in (64, 128, 256, 576, 4096):
        ours, theirs = RMSNorm(width, 1e-5, ops), LlamaRMSNorm(width, eps=1e-5)
        with torch.no_grad():
            ours.weight.copy_(torch.randn(width))
            theirs.weight.copy_(ours.weight)
        for shape in ((1, width), (37, width), (5, 4, width)):
            x = torch.randn(*shape) * 3
            assert torch.equal(ours(x), theirs(x))
        half = RMSNorm(width, 1e-5, ops).to(torch.bfloat16)
        ref = LlamaRMSNorm(width, eps=1e-5).to(torch.bfloat16)
        with torch.no_grad():
            half.weight.copy_(ours.weight)
            ref.weight.copy_(ours.weight)
        x = torch.randn(9, width, dtype=torch.bfloat16)
        assert torch.equal(half(x), ref(x))


def test_prefill_steps_run_on_their_own_threads_and_stay_exact(tiny_llama, backend):
    """``prefill_threads``: a step with prompt tokens runs on that many torch threads, a decode-only
    step on the process's own, which every step leaves as it found it; the output is unchanged."""
    if backend != "cpu":
        pytest.skip("step threads are the CPU backend's option")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = make_engine(tiny_llama, prefill_threads=2, max_num_batched_tokens=32)
        seen: list[tuple[bool, int]] = []  # (the step computes prompt tokens, torch threads meanwhile)
        forward = engine.model.forward

        def recording_forward(input_ids, positions, attn):
            seen.append((bool(attn.meta.prefills), torch.get_num_threads()))
            return forward(input_ids, positions, attn)

        engine.model.forward = recording_forward
        prompts = random_prompts()
        assert_matches_hf(tiny_llama, prompts, engine.generate(prompts, GREEDY))
        assert torch.get_num_threads() == 1
        assert {threads for prompt, threads in seen if prompt} == {2}, seen
        assert {threads for prompt, threads in seen if not prompt} == {1}, seen
        engine.check_idle()
    finally:
        torch.set_num_threads(before)


def test_small_decode_steps_run_on_their_own_threads_and_stay_exact(tiny_llama, backend):
    """``small_batch_threads``: a decode-only step of at most ``small_batch_max_seqs`` sequences
    runs on that many torch threads, a larger one and a prompt step on the process's own; every
    step leaves the count as it found it, and the output is unchanged."""
    if backend != "cpu":
        pytest.skip("step threads are the CPU backend's option")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = make_engine(tiny_llama, small_batch_threads=1, small_batch_max_seqs=2, max_num_batched_tokens=32)
        seen: list[tuple[bool, int, int]] = []  # (prompt tokens, sequences, torch threads meanwhile)
        forward = engine.model.forward

        def recording_forward(input_ids, positions, attn):
            meta = attn.meta
            seen.append((bool(meta.prefills), meta.num_decodes + len(meta.prefills), torch.get_num_threads()))
            return forward(input_ids, positions, attn)

        engine.model.forward = recording_forward
        prompts = random_prompts()
        assert_matches_hf(tiny_llama, prompts, engine.generate(prompts, GREEDY))
        assert torch.get_num_threads() == 2
        small = {threads for prompt, seqs, threads in seen if not prompt and seqs <= 2}
        large = {threads for prompt, seqs, threads in seen if not prompt and seqs > 2}
        assert small == {1} and large == {2}, seen  # random_prompts() decode 3+ together, then fewer
        assert {threads for prompt, seqs, threads in seen if prompt} == {2}, seen
        engine.check_idle()
    finally:
        torch.set_num_threads(before)
