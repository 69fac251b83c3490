"""Request status through the engine's public surface: every transition, abort from every
status back to the starting free count, prefix hits counted once per request, ``stats()``,
``take_events()`` and construction from an ``EngineConfig``."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.events import BlockStored
from kvstore.hashing import hash_prompt_blocks
from tests.unit.engine_helpers import random_prompts
from workers.engine import EngineConfig, EngineStats, LLMEngine, RequestStatus, SamplingParams
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import FinishReason, Sequence

NUM_BLOCKS = 32
PROMPT = random_prompts((40,), seed=31)[0]  # 3 blocks of 16


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama):
    eng = LLMEngine(tiny_llama, num_kv_blocks=NUM_BLOCKS, load_progress=False)
    yield eng
    assert not eng.has_unfinished() and eng.stats().num_free_blocks == NUM_BLOCKS
    eng.check_idle()


def run(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


def test_waiting_running_finished(engine):
    seq = engine.add_request("r", PROMPT, greedy(3))
    assert engine.status("r") is RequestStatus.WAITING
    assert (engine.stats().num_waiting, engine.stats().num_running) == (1, 0)
    engine.step()  # the prompt and the first token
    assert engine.status("r") is RequestStatus.RUNNING and seq.block_table == [0, 1, 2]
    assert (engine.stats().num_waiting, engine.stats().num_running, engine.stats().num_free_blocks) == (0, 1, 29)
    outs = engine.step() + engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert engine.status("r") is None and seq.status is RequestStatus.FINISHED
    assert seq.finish_reason is FinishReason.LENGTH and seq.block_table == []


def test_held_for_decode_until_released(engine):
    seq = engine.add_request("h", PROMPT, greedy(1), hold_kv=True)
    (out,) = engine.step()
    assert out.finished and seq.is_finished
    assert engine.status("h") is RequestStatus.HELD_FOR_DECODE and not engine.has_unfinished()
    stats = engine.stats()
    assert (stats.num_held, stats.num_running, stats.num_free_blocks) == (1, 0, NUM_BLOCKS - 3)
    assert engine.num_held == 1 and engine.held_block_ids("h") == [0, 1, 2]
    assert engine.release_kv("h")
    assert engine.status("h") is None and seq.status is RequestStatus.FINISHED
    assert engine.held_block_ids("h") is None and not engine.release_kv("h") and engine.num_held == 0


def test_awaiting_remote_kv_runs_on_commit(engine):
    res = engine.reserve_remote_kv("a", PROMPT, 5, greedy(4))
    assert res.block_ids == [0, 1, 2] and res.missing_block_ids == [0, 1, 2]
    assert engine.status("a") is RequestStatus.AWAITING_REMOTE_KV and not engine.has_unfinished()
    stats = engine.stats()
    assert (stats.num_awaiting_kv, stats.num_waiting, stats.num_running, stats.num_free_blocks) == (1, 0, 0, 29)
    engine.commit_remote_kv("a")  # the blocks hold garbage KV here: only the statuses are checked
    assert engine.status("a") is RequestStatus.RUNNING and engine.stats().num_running == 1
    with pytest.raises(KeyError, match="not awaiting remote KV"):
        engine.commit_remote_kv("a")
    out = run(engine)["a"]
    assert len(out) == 4 and out[0] == 5


def test_a_failed_transfer_recomputes_from_waiting(engine):
    ref = engine.generate([PROMPT], greedy(4))[0].token_ids
    engine.reserve_remote_kv("f", PROMPT, ref[0], greedy(4))
    engine.commit_remote_kv("f", recompute=True)
    assert engine.status("f") is RequestStatus.WAITING
    assert engine.stats().num_waiting == 1 and engine.stats().num_free_blocks == NUM_BLOCKS
    assert run(engine)["f"] == ref


def test_commit_of_an_unknown_request_is_refused(engine):
    with pytest.raises(KeyError, match="'nope' is not awaiting remote KV"):
        engine.commit_remote_kv("nope")
    engine.add_request("w", PROMPT, greedy(1))
    with pytest.raises(KeyError):  # waiting, not awaiting KV: its status stays
        engine.commit_remote_kv("w")
    assert engine.status("w") is RequestStatus.WAITING
    engine.abort("w")


def _to_waiting(e):
    e.add_request("x", PROMPT, greedy(8))


def _to_running(e):
    e.add_request("x", PROMPT, greedy(8))
    e.step()


def _to_awaiting(e):
    e.reserve_remote_kv("x", PROMPT, 5, greedy(8))


def _to_held(e):
    e.add_request("x", PROMPT, greedy(1), hold_kv=True)
    e.step()


@pytest.mark.parametrize(
    ("into", "status", "blocks"),
    [
        (_to_waiting, RequestStatus.WAITING, 0),
        (_to_running, RequestStatus.RUNNING, 3),
        (_to_awaiting, RequestStatus.AWAITING_REMOTE_KV, 3),
        (_to_held, RequestStatus.HELD_FOR_DECODE, 3),
    ],
    ids=["waiting", "running", "awaiting_remote_kv", "held_for_decode"],
)
def test_abort_from_every_status_frees_its_blocks(engine, into, status, blocks):
    into(engine)
    assert engine.status("x") is status and engine.stats().num_free_blocks == NUM_BLOCKS - blocks
    assert engine.abort("x")
    assert engine.status("x") is None and engine.stats().num_free_blocks == NUM_BLOCKS
    assert not engine.abort("x") and not engine.release_kv("x")
    assert engine.step() == []


def test_abort_of_a_preempted_request_frees_its_blocks(tiny_llama):
    # 6 blocks: two 40-token prompts fit (3 + 3), their fourth blocks do not: one is preempted.
    engine = LLMEngine(tiny_llama, num_kv_blocks=6, load_progress=False)
    a = engine.add_request("a", PROMPT, greedy(30))
    b = engine.add_request("b", random_prompts((40,), seed=32)[0], greedy(30))
    while not (a.num_preemptions or b.num_preemptions):
        engine.step()
    victim = a if a.num_preemptions else b
    assert victim.status is RequestStatus.WAITING and engine.stats().preemptions == 1
    assert engine.abort(victim.request_id)
    run(engine)
    assert engine.stats().num_free_blocks == 6
    engine.check_idle()


def test_prefix_hits_are_counted_once_per_request(engine):
    prefix = random_prompts((48,), seed=33)[0]
    engine.generate([prefix + [1, 2, 3]], greedy(2))
    assert (engine.stats().prefix_queries, engine.stats().prefix_hits) == (51, 0)
    (out,) = engine.generate([prefix + [4, 5]], greedy(2))
    assert out.num_cached_tokens == 48
    assert (engine.stats().prefix_queries, engine.stats().prefix_hits) == (101, 48)
    # The decode side's reservation counts too; its recompute after a failed transfer does not.
    res = engine.reserve_remote_kv("c", prefix + [6], 7, greedy(2))
    assert res.num_cached_tokens == 48 and res.num_cached_blocks == 3
    engine.commit_remote_kv("c", recompute=True)
    run(engine)
    assert (engine.stats().prefix_queries, engine.stats().prefix_hits) == (150, 96)


def test_a_shared_prefix_being_computed_is_waited_for_not_computed_twice(engine):
    prefix = random_prompts((32,), seed=35)[0]  # 2 blocks: MIN_SHARED_BLOCKS
    a, b, c = prefix + [1, 2, 3], prefix + [4, 5, 6, 7], prefix[:16] + [8] * 20
    alone = {i: engine.generate([p], greedy(3))[0].token_ids for i, p in enumerate((a, b, c))}
    assert engine.block_manager.reset_prefix_cache()
    before = engine.stats().prefill_tokens_computed
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        engine.add_request(rid, prompt, greedy(3))
    engine.step()  # a computes the prefix; b waits for it; c shares one block only and runs
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert stats.prefill_tokens_computed - before == len(a) + len(c)
    done = run(engine)
    assert done == {"a": alone[0], "b": alone[1], "c": alone[2]}  # the same tokens as alone
    # b computed only what follows the prefix: 32 of its tokens came from a's blocks
    assert engine.stats().prefill_tokens_computed - before == len(a) + len(c) + len(b) - 32


def test_a_prefix_computed_over_several_chunks_is_waited_for_to_its_end(tiny_llama):
    engine = LLMEngine(tiny_llama, num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=40, load_progress=False)
    prefix = random_prompts((64,), seed=37)[0]  # 4 blocks, more than one 40-token chunk
    a, b, c = prefix + [1, 2, 3], prefix + [4, 5, 6], prefix[:16] + [8] * 20
    alone = [engine.generate([p], greedy(3))[0].token_ids for p in (a, b, c)]
    assert engine.block_manager.reset_prefix_cache()
    before = engine.stats().prefill_tokens_computed
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        engine.add_request(rid, prompt, greedy(3))
    engine.step()  # a's first chunk (blocks 0-1 and half of 2); b and c wait
    assert (engine.stats().num_running, engine.stats().num_waiting) == (1, 2)
    engine.step()  # a's last 27 tokens; b still waits for blocks 2-3; c shares one block only: runs
    assert (engine.stats().num_running, engine.stats().num_waiting) == (2, 1)
    assert run(engine) == {"a": alone[0], "b": alone[1], "c": alone[2]}
    # b computed only its last 3 tokens: all 4 prefix blocks came from a
    assert engine.stats().prefill_tokens_computed - before == len(a) + (len(b) - 64) + (len(c) - 16)
    assert engine.stats().num_free_blocks == NUM_BLOCKS
    engine.check_idle()


def test_a_request_for_prompt_logprobs_does_not_wait_for_a_shared_prefix(engine):
    prefix = random_prompts((48,), seed=36)[0]
    engine.add_request("a", prefix + [1], greedy(2))
    engine.add_request("b", prefix + [2], dataclasses.replace(greedy(2), prompt_logprobs=1))
    engine.step()  # b takes no prefix hit (it needs every prompt position's logits): it runs
    assert (engine.stats().num_running, engine.stats().num_waiting) == (2, 0)
    run(engine)


def test_take_events_hands_over_each_stored_block_once(engine):
    engine.take_events()  # nothing yet
    prompt = random_prompts((33,), seed=34)[0]
    engine.generate([prompt], greedy(1))
    hashes = hash_prompt_blocks(prompt[:32], 16, engine.model_key)
    assert engine.take_events() == [BlockStored(tuple(hashes), None)]
    assert engine.take_events() == []
    stats = engine.stats()
    assert stats.num_cached_blocks == 2 and stats.evictions == 0


def test_stats_is_a_frozen_snapshot(engine):
    before = engine.stats()
    engine.add_request("s", PROMPT, greedy(2))
    assert before.num_waiting == 0 and engine.stats().num_waiting == 1
    assert before == EngineStats(
        num_blocks=NUM_BLOCKS,
        num_free_blocks=NUM_BLOCKS,
        num_cached_blocks=0,
        num_waiting=0,
        num_running=0,
        num_awaiting_kv=0,
        num_held=0,
        preemptions=0,
        evictions=0,
        prefix_queries=0,
        prefix_hits=0,
    )
    assert before.usage == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.num_waiting = 3
    engine.step()
    assert engine.stats().usage == 3 / NUM_BLOCKS
    run(engine)


def test_check_idle_names_the_requests_left(engine):
    engine.add_request("left", PROMPT, greedy(1))
    with pytest.raises(AssertionError, match="'left': 'waiting'"):
        engine.check_idle()
    engine.abort("left")


def test_engine_from_an_engine_config(tiny_llama):
    config = EngineConfig(model_dir=tiny_llama, num_kv_blocks=16, load_progress=False)
    by_keywords = LLMEngine(tiny_llama, num_kv_blocks=16, load_progress=False)
    assert by_keywords.config == config
    expected = by_keywords.generate([PROMPT], greedy(4))[0].token_ids
    for engine in (LLMEngine(config=config), LLMEngine.from_config(config)):
        assert engine.config is config and engine.num_kv_blocks == 16
        assert engine.generate([PROMPT], greedy(4))[0].token_ids == expected
    with pytest.raises(TypeError, match="not both"):
        LLMEngine(tiny_llama, config=config)
    with pytest.raises(TypeError, match="not both"):
        LLMEngine(config=config, num_kv_blocks=8)
    with pytest.raises(TypeError, match="needs a model directory"):
        LLMEngine()


def test_the_scheduler_refuses_a_move_outside_its_transitions():
    bm = BlockManager(4, 16, "m")
    sched = Scheduler(bm, 64, 4)
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=0.0)
    sched.add(seq)
    with pytest.raises(RuntimeError, match="'r': waiting -> finished .* starts from held_for_decode"):
        sched.release(seq)
    with pytest.raises(RuntimeError, match="waiting -> running .* starts from awaiting_remote_kv"):
        sched.commit_remote(seq)
    assert seq.status is RequestStatus.WAITING and sched.get("r") is seq and list(sched.waiting) == [seq]
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Sequence("r", [4], SamplingParams(max_tokens=1), arrival_time=0.0))
    sched.abort(seq)
    with pytest.raises(RuntimeError, match="finished -> finished"):
        sched.abort(seq)
    assert sched.requests == {} and not sched.has_unfinished
    bm.check_idle()


def test_each_running_sequences_tokens_left_and_blocks(engine):
    engine.add_request("a", PROMPT, greedy(10))
    engine.add_request("b", PROMPT[:20], greedy(3))
    assert engine.running_left() == []  # waiting: nothing runs yet
    engine.step()  # both prompts computed, each its first token
    left = dict(zip(("a", "b"), engine.running_left(), strict=True))
    assert left == {"a": (9, 3), "b": (2, 2)}  # 40 + 1 tokens in 3 blocks of 16; 20 + 1 in 2
    run(engine)
    assert engine.running_left() == []
