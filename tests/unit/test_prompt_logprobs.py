"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's logprob given its
prefix, plus the top N, equal to transformers' log-softmax of the prompt's logits, whatever the
chunking, prefix cache or preemption."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.unit.engine_helpers import hf_model, random_prompts
from workers.engine import LLMEngine, SamplingParams

TOP = 5
TOL = 1e-4


def engine(model_dir: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLMEngine(model_dir, load_progress=False, **kwargs)


@functools.lru_cache(maxsize=32)
def hf_log_probs(model_dir: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """``[len(prompt), vocab]``: row p is the log-distribution of the token after position p."""
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches_hf(model_dir: str, prompt: list[int], got, top: int = TOP) -> None:
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None  # nothing precedes the first token
    want = hf_log_probs(model_dir, tuple(prompt))
    for i in range(1, len(prompt)):
        entry, row = got[i], want[i - 1]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - row[prompt[i]].item()) <= TOL, (i, entry.logprob, row[prompt[i]].item())
        assert len(entry.top) == top
        values, ids = row.topk(top)
        got_values = torch.tensor([v for _, v in entry.top])
        assert torch.allclose(got_values, values, atol=TOL), i
        # the same tokens, up to ties within the tolerance
        for (tok, _value), want_value in zip(entry.top, values.tolist()):
            assert abs(row[tok].item() - want_value) <= TOL


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_logprobs_equal_transformers_with_small_chunks(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    # 8-token step budget: every prompt is computed in chunks, most attending to earlier chunks
    # through the cache; 1-token chunks in mid-prompt run as decodes.
    eng = engine(model_dir, max_num_batched_tokens=8)
    prompts = random_prompts((1, 2, 9, 33, 70), seed=5)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP)
    outs = eng.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(model_dir, prompt, out.prompt_logprobs)
    eng.check_idle()


def test_prompt_logprobs_zero_gives_the_tokens_only(tiny_llama):
    prompt = random_prompts((40,), seed=6)[0]
    out = engine(tiny_llama, max_num_batched_tokens=16).generate(
        [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0)
    )[0]
    assert_matches_hf(tiny_llama, prompt, out.prompt_logprobs, top=0)
    plain = engine(tiny_llama).generate([prompt], SamplingParams(max_tokens=1))[0]
    assert plain.prompt_logprobs is None


def test_prefix_cache_hit_is_skipped_for_prompt_logprobs(tiny_llama):
    eng = engine(tiny_llama, max_num_batched_tokens=16)
    prompt = random_prompts((70,), seed=7)[0]
    eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # caches 4 blocks
    again = eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert again.num_cached_tokens == 64
    out = eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP))[0]
    assert out.num_cached_tokens == 0  # computed, not served from the cache
    assert_matches_hf(tiny_llama, prompt, out.prompt_logprobs)
    assert out.token_ids == again.token_ids
    eng.check_idle()


def test_prompt_logprobs_survive_preemption(tiny_llama):
    # 12 blocks of 16 tokens for 3 prompts of 60 tokens + 40 new each: sequences get preempted
    # and recomputed; the prompt logprobs stay complete and exact.
    eng = engine(tiny_llama, num_kv_blocks=12, max_num_batched_tokens=32)
    prompts = random_prompts((60, 60, 60), seed=8)
    outs = eng.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=2))
    assert eng.stats().preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(tiny_llama, prompt, out.prompt_logprobs, top=2)
    eng.check_idle()


def test_negative_prompt_logprobs_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
