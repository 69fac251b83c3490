"""The engine's halves of disaggregation, in one process: a prefill engine holds a prompt's
blocks, a decode engine reserves blocks, the KV is copied between them (the transfer layer's
job, done here by indexing), and decoding continues with output identical to a colocated run."""

from __future__ import annotations

import pytest

from tests.unit.engine_helpers import MAX_NEW_TOKENS, hf_greedy, random_prompts
from workers.engine import LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)


def copy_blocks(src: LLMEngine, src_ids: list[int], dst: LLMEngine, dst_ids: list[int]) -> None:
    for s, d in zip(src.kv_caches, dst.kv_caches, strict=True):
        d[:, dst_ids] = s[:, src_ids]


def prefill(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    engine.add_request(
        request_id,
        prompt,
        SamplingParams(
            max_tokens=1,
            temperature=params.temperature,
            seed=params.seed,
            top_k=params.top_k,
            detokenize=False,
        ),
        hold_kv=True,
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = [o for o in outs if o.request_id == request_id]
    return out.token_ids[0], engine.held_block_ids(request_id)


def run_decode(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    return done


@pytest.fixture
def pair(tiny_llama):
    p = LLMEngine(tiny_llama, num_kv_blocks=128, load_progress=False)
    d = LLMEngine(tiny_llama, num_kv_blocks=128, load_progress=False)
    yield p, d
    for e in (p, d):
        assert not e.has_unfinished() and e.num_held == 0
        e.check_idle()


def test_split_prefill_and_decode_match_transformers(pair, tiny_llama):
    p, d = pair
    prompts = random_prompts((1, 16, 45, 200), seed=21)
    for i, prompt in enumerate(prompts):
        first, src_ids = prefill(p, f"r{i}", prompt, GREEDY)
        res = d.reserve_remote_kv(f"r{i}", prompt, first, GREEDY)
        assert res.num_cached_blocks == 0 and len(res.block_ids) == len(src_ids)
        copy_blocks(p, src_ids, d, res.missing_block_ids)
        assert p.release_kv(f"r{i}")
        d.commit_remote_kv(f"r{i}")
    done = run_decode(d)
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(tiny_llama, tuple(prompt))


def test_decode_reuses_its_own_prefix_cache_and_moves_only_missing_blocks(pair, tiny_llama):
    p, d = pair
    prefix = random_prompts((64,), seed=22)[0]
    first_prompt, second_prompt = prefix + [5, 6, 7], prefix + list(range(8, 25))
    for rid, prompt in (("a", first_prompt), ("b", second_prompt)):
        first, src_ids = prefill(p, rid, prompt, GREEDY)
        res = d.reserve_remote_kv(rid, prompt, first, GREEDY)
        if rid == "b":
            assert res.num_cached_blocks == 4 and res.num_cached_tokens == 64
            assert len(res.missing_block_ids) == 2
        copy_blocks(p, src_ids[res.num_cached_blocks :], d, res.missing_block_ids)
        p.release_kv(rid)
        d.commit_remote_kv(rid)
        assert run_decode(d)[rid] == hf_greedy(tiny_llama, tuple(prompt))


def test_failed_transfer_recomputes_to_the_same_output(pair, tiny_llama):
    p, d = pair
    prompt = random_prompts((77,), seed=23)[0]
    first, _ = prefill(p, "r", prompt, GREEDY)
    d.reserve_remote_kv("r", prompt, first, GREEDY)
    p.release_kv("r")  # e.g. the lease expired; nothing arrives
    d.commit_remote_kv("r", recompute=True)
    assert run_decode(d)["r"] == hf_greedy(tiny_llama, tuple(prompt))


def test_seeded_sampling_is_identical_split_or_colocated(pair):
    p, d = pair
    prompt = random_prompts((30,), seed=24)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_k=40, seed=1234)
    colocated = p.generate([prompt], params)[0].token_ids
    first, src_ids = prefill(p, "s", prompt, params)
    res = d.reserve_remote_kv("s", prompt, first, params)
    copy_blocks(p, src_ids, d, res.missing_block_ids)
    p.release_kv("s")
    d.commit_remote_kv("s")
    assert run_decode(d)["s"] == colocated


def test_abort_frees_reserved_and_held_blocks(pair):
    p, d = pair
    prompt = random_prompts((40,), seed=25)[0]
    first, _ = prefill(p, "x", prompt, GREEDY)
    assert d.reserve_remote_kv("x", prompt, first, GREEDY) is not None
    assert d.abort("x") and p.abort("x")
    assert not p.release_kv("x")


def test_reservation_fails_cleanly_when_blocks_run_out(tiny_llama):
    d = LLMEngine(tiny_llama, num_kv_blocks=8, load_progress=False)
    assert d.reserve_remote_kv("a", list(range(10, 110)), 5, GREEDY) is not None  # 7 blocks
    assert d.reserve_remote_kv("b", list(range(200, 240)), 5, GREEDY) is None  # needs 3, 1 free
    assert d.stats().num_free_blocks == 1
    assert d.abort("a")
    assert not d.has_unfinished()
    d.check_idle()


def test_a_running_sequence_held_mid_decode_continues_elsewhere_exactly(pair, tiny_llama):
    """``hold_running`` (live migration) stops a decoding sequence between steps with its KV
    over every token but the last; another engine reserves that as a prompt, the last token as
    its first, and goes on to transformers' greedy output. Only a sequence between decode
    steps can be held: one still waiting, or not there, cannot."""
    a, b = pair
    prompt = random_prompts((37,), seed=77)[0]
    expected = hf_greedy(tiny_llama, tuple(prompt))
    a.add_request("w", prompt, GREEDY)
    assert a.hold_running("w") is None  # waiting: its prompt is not computed
    assert a.hold_running("nobody") is None
    produced: list[int] = []
    while len(produced) < len(expected) // 2:
        for out in a.step():
            produced += out.new_token_ids
    held = a.hold_running("w")
    assert held is not None and held.token_ids == [*prompt, *produced]
    assert a.num_held == 1 and not a.has_unfinished()
    params = SamplingParams(
        max_tokens=MAX_NEW_TOKENS - len(produced) + 1, temperature=0.0, output_position_offset=len(produced) - 1
    )
    res = b.reserve_remote_kv("w", held.token_ids[:-1], held.token_ids[-1], params)
    assert len(res.block_ids) == len(held.block_ids)
    copy_blocks(a, held.block_ids, b, res.missing_block_ids)
    assert a.release_kv("w")
    b.commit_remote_kv("w")
    rest = run_decode(b)["w"]
    assert produced + rest[1:] == expected


def test_the_preemption_candidate_is_the_last_admitted_sequence_between_decode_steps(pair):
    a, _ = pair
    prompts = random_prompts((20, 30), seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert a.preemption_candidate() is None
    for i, prompt in enumerate(prompts):
        a.add_request(f"c{i}", prompt, params)
    a.step()  # both prompts computed, first tokens sampled
    assert a.preemption_candidate() == ("c1", -(-(30 + 40) // 16))
    a.abort("c1")
    assert a.preemption_candidate() == ("c0", -(-(20 + 40) // 16))
    a.abort("c0")
    assert a.preemption_candidate() is None
