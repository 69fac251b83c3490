"""The engine on real weights: SmolLM2-135M-Instruct (converted from its GGUF) against
transformers' greedy generate on chat prompts, and the GGUF path serving the same tokens."""

from __future__ import annotations

import pytest

from tests.conftest import CHAT_QUESTIONS, chat_prompt_ids
from tests.unit.engine_helpers import hf_greedy
from workers.engine import LLMEngine, SamplingParams

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="default"),
        pytest.param({"max_num_batched_tokens": 32, "num_kv_blocks": 14}, id="chunked-32-preempting"),
        # whatever the load-time timing chose here: decode steps on the panel kernel, or on oneDNN
        pytest.param({"plain_linear_rows": 64}, id="panel-kernel"),  # on coded panels (one byte a weight)
        pytest.param({"plain_linear_rows": 64, "coded_weights": False}, id="panel-kernel-fp32"),
        # every batch on the wide path: AMX's tiles where the CPU has AMX (workers/backends/cpu/amx.py)
        pytest.param({"plain_linear_rows": 0}, id="wide-path"),
        pytest.param({"plain_linear_rows": 0, "amx_linears": False}, id="onednn"),
    ],
)
def test_engine_equals_transformers_on_chat_prompts(smollm2_dir, engine_kwargs):
    prompts = [chat_prompt_ids(smollm2_dir, q) for q in CHAT_QUESTIONS]
    engine = LLMEngine(smollm2_dir, load_progress=False, **{"num_kv_blocks": 256, **engine_kwargs})
    outs = engine.generate(prompts, GREEDY)
    for question, prompt, out in zip(CHAT_QUESTIONS, prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(smollm2_dir, tuple(prompt), NEW_TOKENS), question
    if "num_kv_blocks" in engine_kwargs:  # 8 prompts of 35-40 tokens (+ up to 24) cannot all fit in 14 x 16
        assert engine.stats().preemptions > 0
    engine.check_idle()


def test_the_panel_kernel_holds_every_weight_of_the_gguf_checkpoint_coded(smollm2_dir):
    """SmolLM2's fp32 weights come from Q4_1 (linears) and Q8_0 (embedding and tied head)
    tensors: every one codes exactly, so decode steps stream a quarter of the bytes."""
    from workers.backends.cpu import panels as cpu_linear
    from workers.backends.cpu.linears import _packed_units

    if not cpu_linear.available():
        pytest.skip("the panel kernel did not build (no C++ compiler)")
    engine = LLMEngine(smollm2_dir, load_progress=False, num_kv_blocks=16, plain_linear_rows=64)
    units = _packed_units(engine.model)
    assert len(units) == 30 * 4 + 1  # q/k/v, o, gate/up, down per layer; the head
    assert all(isinstance(u.panels, cpu_linear.CodedPanels) for u in units)
    plain = LLMEngine(smollm2_dir, load_progress=False, num_kv_blocks=16, plain_linear_rows=64, coded_weights=False)
    assert not any(isinstance(u.panels, cpu_linear.CodedPanels) for u in _packed_units(plain.model))


def test_amx_tiles_hold_every_coded_weight_and_a_long_prompt_equals_transformers(smollm2_dir):
    """Where the CPU has AMX, every coded weight gets tiles, and batches wider than the panel
    kernel's (here every one) multiply on them: a ~300-token prompt's greedy continuation equals
    transformers'. With ``amx_linears=False`` no weight has tiles."""
    from workers.backends.cpu import amx as cpu_amx
    from workers.backends.cpu.linears import _packed_units

    if not cpu_amx.available():
        pytest.skip("no AMX on this CPU (or the AMX kernel did not build)")
    engine = LLMEngine(smollm2_dir, load_progress=False, num_kv_blocks=64, plain_linear_rows=0)
    units = _packed_units(engine.model)
    assert len(units) == 30 * 4 + 1 and all(u.tiles is not None for u in units)
    prompt = [t for q in CHAT_QUESTIONS for t in chat_prompt_ids(smollm2_dir, q)]
    assert len(prompt) > 256
    out = engine.generate([prompt], GREEDY)[0]
    assert out.token_ids == hf_greedy(smollm2_dir, tuple(prompt), NEW_TOKENS)
    plain = LLMEngine(smollm2_dir, load_progress=False, num_kv_blocks=16, plain_linear_rows=0, amx_linears=False)
    assert not any(u.tiles is not None for u in _packed_units(plain.model))


def test_a_chat_question_with_a_known_answer(smollm2_dir):
    engine = LLMEngine(smollm2_dir, load_progress=False, num_kv_blocks=64)
    out = engine.generate([chat_prompt_ids(smollm2_dir, "What is the capital of France?")], GREEDY)[0]
    assert "Paris" in out.text and out.finish_reason == "stop"  # ends on <|im_end|>, the model's EOS


@pytest.mark.slow
def test_the_gguf_file_serves_the_same_tokens_as_the_pulled_directory(smollm2_dir, smollm2_gguf):
    from workers.models.gguf import describe_model
    from workers.models.source import resolve_model

    converted = resolve_model(smollm2_gguf, progress=False)
    assert converted != resolve_model("smollm2") and converted.name == "SmolLM2-135M-Instruct.Q4_1"
    assert resolve_model(smollm2_gguf, progress=False) == converted  # cached by content: no second conversion
    assert describe_model(converted).startswith("weights converted from SmolLM2-135M-Instruct.Q4_1.gguf")
    prompts = [chat_prompt_ids(smollm2_dir, q) for q in CHAT_QUESTIONS[:3]]
    from_gguf = LLMEngine(str(converted), load_progress=False, num_kv_blocks=64).generate(prompts, GREEDY)
    from_dir = LLMEngine(smollm2_dir, load_progress=False, num_kv_blocks=64).generate(prompts, GREEDY)
    assert [o.token_ids for o in from_gguf] == [o.token_ids for o in from_dir]
