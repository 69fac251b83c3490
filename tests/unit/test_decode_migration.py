"""Decode migration (deploy/pools/worker_calls.py): a decode stream whose replica dies resumes on
another replica from prompt + the tokens already out, with sampling positions continued. The
engine half is exact (a continuation samples the same tokens, seeded or greedy); the routing
half runs WorkerCalls against stand-in pool handles that die on cue."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import ray

from deploy.args import Mode
from deploy.pools.worker_calls import DecodeMigrationError, WorkerCalls, continuation
from tests.unit.engine_helpers import random_prompts
from workers.decode import DecodeRetiring
from workers.engine import LLMEngine, SamplingParams
from workers.protocol import GenerateRequest, PrefillResult, TokenChunk


@pytest.mark.parametrize(
    "sampling",
    [
        pytest.param({"temperature": 0.0}, id="greedy"),
        pytest.param({"temperature": 0.9, "top_p": 0.95, "seed": 5}, id="seeded"),
    ],
)
def test_a_continuation_samples_the_same_tokens(tiny_llama, sampling):
    engine = LLMEngine(tiny_llama, load_progress=False, num_kv_blocks=128)
    prompt = random_prompts((23,), seed=4)[0]
    whole = engine.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, **sampling))[0].token_ids
    head = engine.generate([prompt], SamplingParams(max_tokens=15, ignore_eos=True, **sampling))[0].token_ids
    tail = engine.generate(
        [prompt + head], SamplingParams(max_tokens=25, ignore_eos=True, output_position_offset=15, **sampling)
    )[0].token_ids
    assert head + tail == whole
    if "seed" in sampling:  # without the offset the draws restart: the test would notice
        unshifted = engine.generate([prompt + head], SamplingParams(max_tokens=25, ignore_eos=True, **sampling))
        assert unshifted[0].token_ids != tail
    engine.check_idle()


def test_continuation_request():
    choice = GenerateRequest("cmpl-1-0", (1, 2, 3), {"max_tokens": 10, "seed": 3}, "salt", (b"aa",), 5.0)
    seen = []
    nxt = continuation(choice, [7, 8], 1, lambda ids, salt: seen.append((tuple(ids), salt)) or (b"bb", b"cc"))
    assert nxt.request_id == "cmpl-1-0~m1" and nxt.prompt_token_ids == (1, 2, 3, 7, 8)
    assert nxt.sampling == {"max_tokens": 8, "seed": 3, "output_position_offset": 2}
    assert nxt.block_hashes == (b"bb", b"cc") and seen == [((1, 2, 3, 7, 8), "salt")]
    assert (nxt.cache_salt, nxt.arrival_time) == ("salt", 5.0)
    again = continuation(nxt, [9], 2, lambda ids, salt: ())
    assert again.sampling["output_position_offset"] == 3 and again.sampling["max_tokens"] == 7


# ------------------------------------------------------------------ WorkerCalls with stand-ins
class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class _Stream:
    """A decode stream: yields ``tokens`` one per chunk, then dies if ``die`` (as a killed replica does)."""

    def __init__(self, request_id, tokens, die, worker_id=None):
        self.request_id, self.tokens, self.die, self.cancelled = request_id, tokens, die, False
        self.worker_id = worker_id

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for i, token in enumerate(self.tokens):
            last = i == len(self.tokens) - 1 and not self.die
            yield TokenChunk(
                self.request_id,
                (token,),
                finish_reason="length" if last else None,
                num_cached_tokens=99,
                worker_id=self.worker_id,
            )
        if self.die:
            raise ray.exceptions.ActorDiedError()

    def cancel(self):
        self.cancelled = True


class FakePools:
    """Prefill answers token 100 + len(prompt); decode replica k streams the next tokens of a
    fixed script and dies after ``die_after[k]`` of them; with ``named`` its chunks carry the
    worker id ``d<k>``, as real decode replicas' chunks carry theirs."""

    def __init__(self, script: list[int], die_after: list[int | None], named: bool = False):
        self.script, self.die_after, self.calls, self.named = script, die_after, [], named
        self.prefill = type("P", (), {"prefill": _Remote(self._prefill)})()
        pools = self

        class _Decode:
            def options(self, stream=False):
                return type("D", (), {"generate": _Remote(pools._decode)})()

        self.decode = _Decode()

    async def _prefill(self, choice):
        self.calls.append(("prefill", choice))
        produced = len(choice.prompt_token_ids) - 3  # the original prompt has 3 tokens
        return PrefillResult(
            choice.request_id,
            self.script[produced],
            choice.prompt_token_ids,
            None,
            num_cached_tokens=len(choice.prompt_token_ids) - 1,
        )

    def _decode(self, choice, result):
        attempt = sum(1 for kind, _ in self.calls if kind == "decode")
        self.calls.append(("decode", choice))
        start = len(choice.prompt_token_ids) - 3 + 1  # after the tokens out so far and prefill's one
        end = start + choice.sampling["max_tokens"] - 1  # the rest of this choice's budget
        die = self.die_after[attempt] if attempt < len(self.die_after) else None
        tokens = self.script[start:end] if die is None else self.script[start : start + die]
        return _Stream(choice.request_id, tokens, die is not None, f"d{attempt}" if self.named else None)


class FakeIndex:
    """``live``: how many decode records (d0, d1, ...) are live, or the ids themselves."""

    def __init__(self, live: int | list[str] | None):
        self.live = live

    async def live_workers(self, role=None):
        if self.live is None:
            return None
        ids = self.live if isinstance(self.live, list) else [f"d{i}" for i in range(self.live)]
        return {worker_id: object() for worker_id in ids}

    async def longest_prefix(self, hashes, role=None):
        return None


def run(calls: WorkerCalls, choice: GenerateRequest) -> list[TokenChunk]:
    async def collect():
        return [chunk async for chunk in calls.generate(choice)]

    return asyncio.run(collect())


SCRIPT = list(range(200, 230))
CHOICE = GenerateRequest("cmpl-x-0", (1, 2, 3), {"max_tokens": 20, "seed": 1}, None, ())


def make(die_after, live=2, max_migrations=2, named=False) -> tuple[WorkerCalls, FakePools]:
    pools = FakePools(SCRIPT, die_after, named)
    calls = WorkerCalls(
        Mode.DISAGGREGATED,
        prefill=pools.prefill,
        decode=pools.decode,
        index=FakeIndex(live),
        rehash=lambda ids, salt: (b"h",) * (len(ids) // 2),
        max_migrations=max_migrations,
    )
    return calls, pools


def test_a_lost_decode_replica_is_resumed_without_a_gap_or_duplicate():
    calls, pools = make([4, 6])  # dies after 4 tokens, then the continuation's replica after 6 more
    chunks = run(calls, CHOICE)
    assert [t for c in chunks for t in c.token_ids] == SCRIPT[:20]
    assert chunks[-1].finish_reason == "length" and calls.migrations == 2
    prefills = [c for kind, c in pools.calls if kind == "prefill"]
    assert [p.prompt_token_ids for p in prefills] == [(1, 2, 3), (1, 2, 3, *SCRIPT[:5]), (1, 2, 3, *SCRIPT[:12])]
    assert [p.sampling.get("output_position_offset", 0) for p in prefills] == [0, 5, 12]
    assert [p.sampling["max_tokens"] for p in prefills] == [20, 15, 8]
    assert prefills[2].request_id == "cmpl-x-0~m2" and prefills[2].block_hashes == (b"h",) * 7
    assert chunks[0].num_cached_tokens == 2 and all(c.num_cached_tokens == 0 for c in chunks[6:])


def test_more_deaths_than_max_migrations_end_with_an_error():
    calls, _ = make([2, 2, 2])
    with pytest.raises(DecodeMigrationError, match="after 9 tokens and 2 migration"):
        run(calls, CHOICE)
    assert (calls.migrations, calls.failed_migrations) == (2, 1)


def test_no_other_decode_replica_ends_with_an_error():
    calls, _ = make([3], live=1)
    with pytest.raises(DecodeMigrationError, match="another decode replica: none"):
        run(calls, CHOICE)
    assert calls.migrations == 0


def test_the_lost_replica_is_known_by_name_whether_or_not_its_record_expired():
    # A lost host: Ray may notice after the lost replica's index record expired. Only the other
    # replica's record is live then, and that is enough.
    calls, _ = make([3], live=["d1"], named=True)
    chunks = run(calls, CHOICE)
    assert [t for c in chunks for t in c.token_ids] == SCRIPT[:20] and calls.migrations == 1
    # The lost replica's own record is the only live one: nowhere to go.
    calls, _ = make([3], live=["d0"], named=True)
    with pytest.raises(DecodeMigrationError, match="another decode replica: none"):
        run(calls, CHOICE)
    assert calls.migrations == 0


def test_a_continuation_lost_before_its_first_token_is_not_taken_for_the_first_replica():
    # d0 dies after 3 tokens; the continuation (its prefill gave one more) loses d1 before d1
    # names itself. Only d1's record is live: the lost replica is unknown, so one live record
    # is not another replica (d0's name, left over from the first attempt, would have let it go).
    calls, _ = make([3, 0, None], live=["d1"], named=True)
    with pytest.raises(DecodeMigrationError, match="after 5 tokens and 1 migration"):
        run(calls, CHOICE)
    assert calls.migrations == 1


def test_migration_off_ends_with_an_error():
    calls, _ = make([3], max_migrations=0)
    with pytest.raises(DecodeMigrationError):
        run(calls, CHOICE)


def test_without_the_index_the_continuation_is_routed_by_serve():
    calls, _ = make([3], live=None)
    chunks = run(calls, replace(CHOICE, sampling={"max_tokens": 10}))
    assert [t for c in chunks for t in c.token_ids] == SCRIPT[:10] and calls.migrations == 1


# ------------------------------------------------------------------ a retiring decode replica
class _RetiringStream(_Stream):
    """Ends like a decode stream that a retiring replica cut: a last chunk marked ``retiring``
    (what the replica sends), or (``as_error``) Ray's task error caused by ``DecodeRetiring``."""

    def __init__(self, request_id, tokens, worker_id, as_error):
        super().__init__(request_id, tokens, False, worker_id)
        self.as_error = as_error

    def __aiter__(self):
        return self._retire()

    async def _retire(self):
        for token in self.tokens:
            yield TokenChunk(self.request_id, (token,), num_cached_tokens=99, worker_id=self.worker_id)
        if not self.as_error:
            yield TokenChunk(self.request_id, (), worker_id=self.worker_id, retiring=True)
            return
        error = RuntimeError("ray task error")
        error.cause = DecodeRetiring("decode replica d0 is retiring", "d0")  # type: ignore[attr-defined]
        raise error


@pytest.mark.parametrize("as_error", [False, True], ids=["marked-chunk", "task-error"])
def test_a_retiring_decode_replica_hands_its_stream_straight_to_another_decode_replica(as_error):
    """A scale-down's replica ends its streams early (``DecodeRetiring``): each resumes without a
    gap or duplicate, its continuation computed by another decode replica itself (generate_local),
    not sent through the prefill pool again; it counts as a migration and as a retired stream."""
    pools = FakePools(SCRIPT, [None])
    local_calls = []

    def retiring_generate(choice, result):
        pools.calls.append(("decode", choice))
        return _RetiringStream(choice.request_id, SCRIPT[1:5], "d0", as_error)

    def generate_local(choice):
        local_calls.append(choice)
        start = len(choice.prompt_token_ids) - 3
        return _Stream(choice.request_id, SCRIPT[start : start + choice.sampling["max_tokens"]], False, "d1")

    class _Decode:
        def options(self, stream=False):
            return type("D", (), {"generate": _Remote(retiring_generate), "generate_local": _Remote(generate_local)})()

    calls = WorkerCalls(
        Mode.DISAGGREGATED,
        prefill=pools.prefill,
        decode=_Decode(),
        index=FakeIndex(["d0", "d1"]),
        rehash=lambda ids, salt: (),
        max_migrations=2,
    )
    chunks = run(calls, CHOICE)
    assert [t for c in chunks for t in c.token_ids] == SCRIPT[:20]
    assert [kind for kind, _ in pools.calls] == ["prefill", "decode"]  # no second prefill
    assert [c.prompt_token_ids for c in local_calls] == [(1, 2, 3, *SCRIPT[:5])]
    assert local_calls[0].sampling == {"max_tokens": 15, "seed": 1, "output_position_offset": 5}
    assert (calls.migrations, calls.retired_streams, calls.failed_migrations) == (1, 1, 0)
    # without migrations the stream ends with the error, as a lost replica's does
    calls.max_migrations = 0
    pools.calls.clear()
    with pytest.raises(DecodeMigrationError, match="decode replica retiring after 5 tokens"):
        run(calls, CHOICE)
