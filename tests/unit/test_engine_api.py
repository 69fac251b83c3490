"""Engine API beyond greedy parity: sampling, stops, logprobs, abort, step-wise driving, errors."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.engine_helpers import hf_greedy, hf_model, random_prompts
from workers.engine import LLMEngine, SamplingParams


@pytest.fixture
def engine(tiny_llama):
    eng = LLMEngine(tiny_llama, num_kv_blocks=256, load_progress=False)
    yield eng
    assert not eng.has_unfinished()
    eng.check_idle()


def test_text_prompt_and_text_output(engine, tiny_llama):
    out = engine.generate(["The quick brown fox"], SamplingParams(max_tokens=20, temperature=0.0))[0]
    prompt_ids = engine.tokenizer.encode("The quick brown fox")
    assert out.prompt_token_ids == prompt_ids
    assert out.token_ids == hf_greedy(tiny_llama, tuple(prompt_ids), 20)
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_seeded_sampling_reproduces_across_batches(engine):
    prompts = random_prompts((5, 40, 90), seed=2)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=s) for s in (1, 2, 3)]
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    other_seed = engine.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=0.9, seed=99))[0]
    assert other_seed.token_ids != together[0].token_ids


def test_top_k_one_and_tiny_min_p_window_equal_greedy(engine):
    prompt = random_prompts((30,), seed=4)
    greedy = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0))[0].token_ids
    top1 = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=5))[0].token_ids
    minp = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, min_p=1.0, seed=5))[0].token_ids
    assert top1 == greedy == minp


def test_stop_token_ids_and_max_tokens(engine):
    prompt = random_prompts((20,), seed=5)
    ref = engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 10
    stop_at = ref.token_ids[4]
    first = ref.token_ids.index(stop_at)
    out = engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_stop_string_truncates_text(engine):
    prompt = "Once upon a time"
    ref = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert len(ref.text) > 6
    stop = ref.text[3:6]
    out = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == ref.text[: ref.text.index(stop)]
    kept = engine.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=[stop], include_stop_str_in_output=True)
    )[0]
    assert kept.text == ref.text[: ref.text.index(stop) + len(stop)]


def test_logprobs_are_the_model_distribution(engine, tiny_llama):
    prompt = random_prompts((12,), seed=6)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=5))[0]
    assert len(out.logprobs) == 3
    with torch.no_grad():
        logits = hf_model(tiny_llama)(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] == int(expected.argmax())
    assert math.isclose(first.logprob, float(expected.max()), abs_tol=1e-4)
    assert [t for t, _ in first.top] == expected.topk(5).indices.tolist()
    assert first.top[0][1] >= first.top[-1][1]


def test_step_wise_interface_and_abort_free_blocks(engine):
    before = engine.stats()
    engine.add_request("a", random_prompts((50,), seed=8)[0], SamplingParams(max_tokens=100, temperature=0.0))
    engine.add_request("b", random_prompts((20,), seed=9)[0], SamplingParams(max_tokens=3, temperature=0.0))
    seen: dict[str, list[int]] = {"a": [], "b": []}
    finished = set()
    for _ in range(5):
        for out in engine.step():
            seen[out.request_id].extend(out.new_token_ids)
            assert out.token_ids == seen[out.request_id]
            if out.finished:
                finished.add(out.request_id)
    assert finished == {"b"} and len(seen["b"]) == 3
    after = engine.stats()
    assert after.num_free_blocks < engine.num_kv_blocks
    # the model's time and the prompt tokens it computed in it (what prefill's tokens/s is read from)
    hits = after.prefix_hits - before.prefix_hits
    assert after.prefill_tokens_computed - before.prefill_tokens_computed == 50 + 20 - hits
    assert after.busy_s > before.busy_s
    # each token after a prompt's first came from a decode row; its step's seconds are counted once per row
    decoded = after.decode_tokens - before.decode_tokens
    assert decoded == len(seen["a"]) + len(seen["b"]) - 2
    assert 0 < after.decode_token_s - before.decode_token_s <= decoded * (after.busy_s - before.busy_s)
    # the step-time fit's sums: steps with decode rows (at most 2 rows here), their seconds, rows²
    steps = after.decode_steps - before.decode_steps
    step_s = after.decode_step_s - before.decode_step_s
    assert decoded / 2 <= steps <= decoded
    assert decoded <= after.decode_rows_sq - before.decode_rows_sq <= 2 * decoded
    assert 0 < step_s <= after.busy_s - before.busy_s
    assert step_s <= after.decode_token_s - before.decode_token_s <= 2 * step_s
    assert engine.abort("a")
    assert not engine.abort("a")
    assert not engine.has_unfinished()


def test_bad_requests_are_refused_with_the_reason(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("v", [10**6], SamplingParams())
    with pytest.raises(ValueError, match="context holds"):
        engine.add_request("l", [5] * (engine.max_model_len + 1), SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=1))
    engine.abort("dup")


def test_generation_stops_at_the_context_limit(tiny_llama):
    engine = LLMEngine(tiny_llama, num_kv_blocks=4, load_progress=False)  # 64 tokens of KV
    assert engine.max_model_len == 64
    out = engine.generate([[7] * 60], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    engine.check_idle()


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        LLMEngine(str(tmp_path), load_progress=False)


def test_an_emulated_device_pads_each_step_to_its_time_and_changes_no_token(tiny_llama, monkeypatch):
    """bench/autoscale.py's emulated accelerator: a step sleeps until per step + per prefill token
    + per decode context token seconds have passed since it began. The clock is the engine's, so
    a fake one checks the arithmetic without timing anything."""
    import workers.engine.engine as engine_module

    prompt = random_prompts((40,), seed=8)
    greedy = hf_greedy(tiny_llama, tuple(prompt[0]), 3)
    slept: list[float] = []

    class Clock:
        now = 100.0

        @staticmethod
        def monotonic() -> float:
            return Clock.now

        @staticmethod
        def sleep(seconds: float) -> None:
            slept.append(seconds)
            Clock.now += seconds

    monkeypatch.setattr(engine_module, "time", Clock)
    eng = LLMEngine(tiny_llama, num_kv_blocks=64, load_progress=False, emulated_step_s=(0.01, 0.001, 0.0001))
    out = eng.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.token_ids == greedy
    # the prompt's step (40 prefill tokens), then two decodes reading 41 and 42 tokens
    assert slept == pytest.approx([0.01 + 0.040, 0.01 + 0.0041, 0.01 + 0.0042])
    with pytest.raises(ValueError, match="emulated_step_s"):
        LLMEngine(tiny_llama, num_kv_blocks=64, load_progress=False, emulated_step_s=(0.01, -1.0, 0.0))
