"""Compiled decode steps (``enforce_eager=False``): greedy output still equals transformers'
generate token for token (fp32, CPU), every bucket is compiled at start-up and nothing is
compiled while requests run. The first run compiles for minutes on 2 cores; inductor's caches
make later runs take seconds."""

from __future__ import annotations

import pytest

from tests.conftest import CHAT_QUESTIONS, chat_prompt_ids
from tests.unit.engine_helpers import compiled_graphs, hf_greedy, random_prompts
from tests.unit.test_engine_parity import GREEDY, assert_matches_hf
from workers.engine import LLMEngine, SamplingParams
from workers.engine.compiled import CompiledDecode, decode_buckets

pytestmark = pytest.mark.timeout(1800)


def compiled_engine(model_dir: str, **kwargs) -> LLMEngine:
    kwargs = {"num_kv_blocks": 512, "max_num_seqs": 4, **kwargs}  # 4: buckets 1, 2, 4
    return LLMEngine(model_dir, load_progress=False, enforce_eager=False, **kwargs)


def test_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(4) == (1, 2, 4)
    assert decode_buckets(6) == (1, 2, 4, 6)
    assert decode_buckets(32) == (1, 2, 4, 8, 16, 32)


def _count_compiled_runs(monkeypatch) -> list[int]:
    batches: list[int] = []
    run = CompiledDecode.run

    def counted(self, input_ids, positions, attn):
        batches.append(len(input_ids))
        return run(self, input_ids, positions, attn)

    monkeypatch.setattr(CompiledDecode, "run", counted)
    return batches


@pytest.mark.parametrize("arch", ("llama", "qwen2", "qwen3", "mistral"))
def test_compiled_decode_equals_transformers(tiny_model_dirs, arch, monkeypatch):
    model_dir = tiny_model_dirs[arch]
    engine = compiled_engine(model_dir)
    graphs = compiled_graphs()
    batches = _count_compiled_runs(monkeypatch)
    prompts = random_prompts()  # 8 prompts, 4 at a time: decode batches of 4, then fewer as they end
    assert_matches_hf(model_dir, prompts, engine.generate(prompts, GREEDY))
    assert batches and set(batches) <= {1, 2, 3, 4}  # decode steps ran compiled (3 pads to 4)
    assert compiled_graphs() == graphs  # nothing compiled mid-request
    engine.check_idle()


def test_compiled_with_chunked_prefill_and_preemption(tiny_llama):
    # Prefill chunks (eager) interleave with compiled decode steps; preemption recomputes.
    engine = compiled_engine(tiny_llama, num_kv_blocks=26, max_num_batched_tokens=32)
    prompts = random_prompts(seed=3)
    assert_matches_hf(tiny_llama, prompts, engine.generate(prompts, GREEDY))
    assert engine.stats().preemptions > 0
    engine.check_idle()


def test_eager_switch_compiles_nothing(tiny_llama):
    engine = LLMEngine(tiny_llama, load_progress=False, num_kv_blocks=64, enforce_eager=True)
    assert engine.runner.compiled is None


@pytest.mark.slow
def test_compiled_smollm2_equals_transformers_on_chat_prompts(smollm2_dir):
    prompts = [chat_prompt_ids(smollm2_dir, q) for q in CHAT_QUESTIONS]
    # One graph (batch 8; smaller batches pad to it): the real model's compile is the test's cost.
    engine = compiled_engine(smollm2_dir, num_kv_blocks=256, max_num_seqs=8, compile_batch_sizes=(8,))
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for question, prompt, out in zip(CHAT_QUESTIONS, prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(smollm2_dir, tuple(prompt), 24), question
    engine.check_idle()


def test_bucket_sizes_are_checked(tiny_llama):
    with pytest.raises(ValueError, match="compile_batch_sizes"):
        LLMEngine(tiny_llama, load_progress=False, num_kv_blocks=64, max_num_seqs=4, compile_batch_sizes=(8,))
