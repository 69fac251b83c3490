"""Sliding-window attention (Mistral-style): exact against transformers past several windows,
bounded KV memory per sequence while it generates, and disaggregation of a windowed prompt."""

from __future__ import annotations

import pytest

from tests.unit.engine_helpers import hf_greedy, random_prompts
from tests.unit.test_engine_disagg import copy_blocks, prefill, run_decode
from workers.engine import LLMEngine, SamplingParams
from workers.engine.block_manager import NULL_BLOCK
from workers.models.tiny import make_tiny_model

WINDOW = 64
NEW_TOKENS = 3 * WINDOW + 40  # generation runs well past three windows
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BLOCKS_PER_SEQ = WINDOW // 16 + 1  # the window's keys span at most this many 16-token blocks


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory) -> str:
    return str(
        make_tiny_model(tmp_path_factory.mktemp("swa") / "mistral", arch="mistral", seed=1, sliding_window=WINDOW)
    )


def hf_reference(model_dir: str, prompt: list[int]) -> list[int]:
    return hf_greedy(model_dir, tuple(prompt), NEW_TOKENS)


def make(model_dir: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLMEngine(model_dir, load_progress=False, **kwargs)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="default"),
        pytest.param({"max_num_batched_tokens": 24}, id="chunked-prefill-24"),
        pytest.param({"kv_cache_dtype": "int8"}, id="int8"),
    ],
)
def test_matches_transformers_past_three_windows(windowed_model, engine_kwargs):
    eng = make(windowed_model, **engine_kwargs)
    assert eng.sliding_window == WINDOW
    prompts = random_prompts((5, 40, 150), seed=4)
    outs = eng.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert len(prompt) + len(out.token_ids) > 3 * WINDOW
        if "kv_cache_dtype" in engine_kwargs:
            continue  # quantized: checked against the full-precision engine below
        assert out.token_ids == hf_reference(windowed_model, prompt), f"{len(prompt)}-token prompt diverged"
    if "kv_cache_dtype" in engine_kwargs:
        # Quantized windowed blocks: greedy follows the full-precision run for most of 232 tokens.
        full = make(windowed_model).generate(prompts, GREEDY)
        agreed = [
            next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), NEW_TOKENS)
            for a, b in zip(outs, full)
        ]
        print(f"\nint8 windowed: tokens before the first divergence {agreed} of {NEW_TOKENS}")
        assert sum(agreed) >= 0.5 * NEW_TOKENS * len(prompts)
    eng.check_idle()


def test_block_usage_stays_flat_while_generating(windowed_model):
    eng = make(windowed_model)
    prompt = random_prompts((150,), seed=5)[0]
    seq = eng.add_request("r", prompt, GREEDY)
    used = []
    while eng.has_unfinished():
        eng.step()
        if not seq.is_finished:
            used.append(eng.num_kv_blocks - eng.stats().num_free_blocks)
            held = [b for b in seq.block_table if b != NULL_BLOCK]
            assert len(held) == used[-1] <= BLOCKS_PER_SEQ
    # 150 + 232 tokens would take 24 blocks without the window; it never holds more than 5.
    assert len(used) == NEW_TOKENS - 1 and max(used) == BLOCKS_PER_SEQ
    assert max(used[len(used) // 2 :]) == max(used[: len(used) // 2])  # no growth over time
    eng.check_idle()


def test_windowed_sequences_survive_a_small_cache_by_preemption(windowed_model):
    # 4 sequences x 5 blocks do not fit in 14 blocks: preemption and recompute, same output.
    eng = make(windowed_model, num_kv_blocks=14)
    prompts = random_prompts((20, 33, 48, 70), seed=6)
    outs = eng.generate(prompts, GREEDY)
    assert eng.stats().preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_reference(windowed_model, prompt)
    eng.check_idle()


def test_disaggregated_windowed_prompt_moves_only_the_window(windowed_model):
    p, d = make(windowed_model), make(windowed_model)
    prompt = random_prompts((150,), seed=8)[0]
    first, src_ids = prefill(p, "r", prompt, GREEDY)
    # The prefill side kept only the blocks the first decode step can see: (150-63)//16 = 5 on.
    assert src_ids[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in src_ids[5:]
    res = d.reserve_remote_kv("r", prompt, first, GREEDY)
    assert res.missing_positions == list(range(5, 10))
    copy_blocks(p, [src_ids[i] for i in res.missing_positions], d, res.missing_block_ids)
    p.release_kv("r")
    d.commit_remote_kv("r")
    done = run_decode(d)
    assert [first] + done["r"][1:] == done["r"] == hf_reference(windowed_model, prompt)
    for e in (p, d):
        e.check_idle()


def test_prompt_longer_than_the_cache_runs_in_window_sized_chunks(windowed_model):
    # 14 blocks hold 224 tokens; a 500-token prompt runs in chunks of (14 - 64/16 - 2) x 16 = 128.
    eng = make(windowed_model, num_kv_blocks=14)
    assert eng.max_chunk_tokens == 128 and eng.max_model_len > 500
    prompt = random_prompts((500,), seed=9)[0]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    (out,) = eng.generate([prompt], params)
    assert out.token_ids == hf_greedy(windowed_model, tuple(prompt), 64)
    eng.check_idle()
    # The decode side of a hand-off reserves only the window: 5 blocks of 14 for the same prompt.
    d = make(windowed_model, num_kv_blocks=14)
    res = d.reserve_remote_kv("r", prompt, out.token_ids[0], params)
    assert res is not None and len(res.missing_block_ids) == 5
    assert d.stats().num_free_blocks == 14 - 5
    d.abort("r")
    d.check_idle()


def test_cache_smaller_than_a_window_caps_the_context(windowed_model):
    eng = make(windowed_model, num_kv_blocks=5)  # < 64/16 + 2: one window does not fit
    assert eng.sliding_window is None and eng.max_model_len == 5 * 16
