"""A decode replica killed mid-request (1 prefill + 2 decode replicas, tiny llama): the ingress
resumes the request on the other decode replica from prompt + the tokens already sent, and the
client sees one uninterrupted answer equal to an unkilled run's, streamed and not, greedy and
seeded; a client that leaves during it aborts everything. Afterwards no replica holds a block."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from tests.integration.conftest import deploy, wait_idle
from tests.integration.test_faults import MODEL, app_args, kill, replicas, wait_replicas
from tests.unit.engine_helpers import random_prompts

pytestmark = pytest.mark.timeout(900)
APP = "migrate"
NEW_TOKENS = 160


@pytest.fixture(scope="module")
def two_decode_app(serve_cluster, tiny_llama):
    base = deploy(
        serve_cluster,
        APP,
        "/migrate",
        app_args(
            tiny_llama,
            serve_cluster.redis.url,
            decode={"replicas": 2, "num_cpus": 0.5},
            # Each step that runs sequences takes 10 ms more: a 160-token answer lasts >= 1.6 s on
            # any machine, so the tests' kill (or retirement) lands while it runs. Without it a fast
            # machine finished the tiny model's answer before the status poll saw it running.
            fault_injection={"step_delay_s": 0.01},
        ),
    )
    yield base
    from ray import serve

    wait_idle(base, timeout_s=60)
    serve.delete(APP)


def status(base: str) -> dict:
    return httpx.get(f"{base}/v1/cluster/status", timeout=15).json()


def busy_decode_replica(base: str, timeout_s: float = 60) -> str:
    """The decode replica running a sequence now (the status endpoint says which)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        busy = [r["worker_id"] for r in status(base)["pools"]["decode"] if r.get("healthy") and r["num_running"]]
        if busy:
            return busy[0]
        time.sleep(0.1)
    raise AssertionError("no decode replica ever ran the request")


def kill_busy_decode_replica(base: str, timeout_s: float = 60) -> str:
    """Kill the decode replica running a sequence now."""
    busy = busy_decode_replica(base, timeout_s)
    kill(next(name for name in replicas(APP, "decode") if name.endswith(busy)))
    return busy


def assert_migrated_once(base: str, before: int) -> None:
    """One migration more than ``before``; then Serve's replacement is up and every block is free."""
    assert status(base)["routing"]["migrations"] == before + 1
    wait_replicas(APP, "decode", 2, base)
    wait_idle(base)


def body(prompt, stream: bool, **sampling) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "temperature": 0,
        **sampling,
    }


def streamed(base: str, payload: dict, on_event=None) -> tuple[str, list[dict], dict | None]:
    """The streamed answer's text, events and usage; ``on_event(count, event)`` after each event."""
    text, events, usage = [], [], None
    with httpx.stream("POST", f"{base}/v1/completions", json=payload, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            assert "error" not in event, event
            usage = event.get("usage") or usage
            text.extend(c["text"] for c in event.get("choices", []))
            if on_event is not None:
                on_event(len(events), event)
    return "".join(text), events, usage


@pytest.mark.parametrize(
    "sampling",
    [
        pytest.param({}, id="greedy"),
        pytest.param({"temperature": 0.8, "seed": 11}, id="seeded"),
    ],
)
def test_a_killed_decode_replica_is_invisible_to_a_stream(two_decode_app, sampling):
    base = two_decode_app
    prompt = random_prompts((40,), seed=91)[0]
    reference, _, _ = streamed(base, body(prompt, True, **sampling))
    before = status(base)["routing"]["migrations"]

    def kill_at_fifth(count: int, _: dict) -> None:
        if count == 5:
            kill_busy_decode_replica(base)

    text, events, usage = streamed(base, body(prompt, True, **sampling), on_event=kill_at_fifth)
    assert text == reference
    assert len({e["id"] for e in events}) == 1  # one response id throughout
    assert usage["completion_tokens"] == NEW_TOKENS and usage["prompt_tokens"] == len(prompt)
    assert_migrated_once(base, before)


def test_a_killed_decode_replica_is_invisible_to_a_whole_answer(two_decode_app):
    base = two_decode_app
    prompt = random_prompts((55,), seed=92)[0]
    reference = httpx.post(f"{base}/v1/completions", json=body(prompt, False), timeout=300).json()
    before = status(base)["routing"]["migrations"]
    answer: dict = {}
    thread = threading.Thread(
        target=lambda: answer.update(httpx.post(f"{base}/v1/completions", json=body(prompt, False), timeout=300).json())
    )
    thread.start()
    kill_busy_decode_replica(base)
    thread.join(300)
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == NEW_TOKENS
    assert_migrated_once(base, before)


# Output the grammar forces to be long enough for the kill to land mid-stream (five words of
# 4-12 characters), whatever the tiny model's random weights prefer.
WORDS = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "minLength": 4, "maxLength": 12},
            "minItems": 5,
            "maxItems": 5,
        },
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["words", "count"],
}


def test_a_constrained_stream_survives_a_killed_decode_replica(two_decode_app):
    """The grammar's state is the tokens generated so far: the decode replica that resumes the
    stream rebuilds it from prompt + tokens sent, and the answer is the uninterrupted one, valid."""
    base = two_decode_app
    prompt = random_prompts((30,), seed=93)[0]
    constrained = body(
        prompt, True, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WORDS}}
    )
    reference, _, _ = streamed(base, constrained)
    before = status(base)["routing"]["migrations"]

    def kill_at_fifth(count: int, _: dict) -> None:
        if count == 5:
            kill_busy_decode_replica(base)

    text, _, usage = streamed(base, constrained, on_event=kill_at_fifth)
    assert text == reference
    value = json.loads(text)
    assert len(value["words"]) == 5 and all(4 <= len(w) <= 12 for w in value["words"])
    assert usage["completion_tokens"] < NEW_TOKENS  # the grammar ended it, not max_tokens
    assert_migrated_once(base, before)


def retire_busy_decode_replica(base: str) -> tuple[str, int]:
    """Send ``Retire`` (what the autoscaler sends a decode replica Serve is stopping) to the
    decode replica running a sequence now, at its control address in the worker directory."""
    from deploy.pools import directory
    from workers.transfer.control import ControlClient

    busy = busy_decode_replica(base)

    async def retire() -> int:
        address = (await directory.lookup(APP, "decode"))[busy]
        client = ControlClient("test")
        try:
            return await client.retire(address, 10.0)
        finally:
            await client.close()

    return busy, asyncio.run(retire())


def test_a_retiring_decode_replica_hands_its_stream_to_the_other_invisibly(two_decode_app):
    """A scale-down's decode replica hands its streams over at once instead of draining them:
    each moves live (its KV pulled by the other decode replica, nothing recomputed), and the
    client sees the same text, one response id and the same usage. The retired replica refuses
    new work from then on; Serve would stop it, here the test does."""
    base = two_decode_app
    prompt = random_prompts((40,), seed=94)[0]
    reference, _, _ = streamed(base, body(prompt, True))
    routing = status(base)["routing"]
    retired: list[tuple[str, int]] = []

    def retire_at_fifth(count: int, _: dict) -> None:
        if count == 5:
            retired.append(retire_busy_decode_replica(base))

    text, events, usage = streamed(base, body(prompt, True), on_event=retire_at_fifth)
    assert text == reference
    assert len({e["id"] for e in events}) == 1
    assert usage["completion_tokens"] == NEW_TOKENS and usage["prompt_tokens"] == len(prompt)
    (worker_id, ended), now = retired[0], status(base)["routing"]
    assert ended == 1
    assert now["live_migrations"] == routing["live_migrations"] + 1
    assert now["migrations"] == routing["migrations"]  # nothing recomputed
    retiring = next(r for r in status(base)["pools"]["decode"] if r["worker_id"] == worker_id)
    assert retiring["retired_streams"] == retiring["moved_out"] == 1
    kill(next(name for name in replicas(APP, "decode") if name.endswith(worker_id)))
    wait_replicas(APP, "decode", 2, base)
    wait_idle(base)


def migrate(base: str, request_id: str, recompute: bool = False) -> httpx.Response:
    body = {"request_id": request_id, "recompute": recompute}
    return httpx.post(f"{base}/v1/cluster/migrate", json=body, timeout=30)


@pytest.mark.parametrize(
    ("sampling", "recompute"),
    [
        pytest.param({}, False, id="greedy"),
        pytest.param({"temperature": 0.8, "seed": 11}, False, id="seeded"),
        pytest.param({}, True, id="recompute"),
    ],
)
def test_a_stream_moved_by_the_operator_is_invisible(two_decode_app, sampling, recompute):
    """``POST /v1/cluster/migrate`` (``pdserve migrate``) mid-stream: the stream moves to the other
    decode replica with its KV, nothing is recomputed (no migration counted, no recomputed
    prefill), and the client's text, id and usage are an unmoved run's. With ``recompute`` the
    other replica computes prompt + tokens instead (a migration counted), same text."""
    base = two_decode_app
    prompt = random_prompts((40,), seed=95)[0]
    reference, _, _ = streamed(base, body(prompt, True, **sampling))
    routing = status(base)["routing"]
    recomputed = sum(r.get("recomputed_prefills", 0) for r in status(base)["pools"]["decode"])
    answers: list[httpx.Response] = []

    def move_at_fifth(count: int, event: dict) -> None:
        if count == 5:
            answers.append(migrate(base, event["id"], recompute))

    # its own cache salt: no decode replica holds its blocks, so the move's pre-copy sends them
    moved = body(prompt, True, cache_salt=f"moved-{recompute}-{sampling}", **sampling)
    text, events, usage = streamed(base, moved, on_event=move_at_fifth)
    assert text == reference
    assert len({e["id"] for e in events}) == 1
    assert usage["completion_tokens"] == NEW_TOKENS and usage["prompt_tokens"] == len(prompt)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    ((moved_from, ids),) = answer.json()["moved"].items()
    assert ids == [f"{events[0]['id']}-0"]
    now = status(base)["routing"]
    if not recompute:  # 40 prompt tokens and at least 4 generated: 2 full blocks went ahead of the move
        assert now["precopied_blocks"] >= routing["precopied_blocks"] + 2
    assert now["live_migrations"] == routing["live_migrations"] + (not recompute)
    assert now["migrations"] == routing["migrations"] + recompute
    decode = status(base)["pools"]["decode"]
    if not recompute:
        assert sum(r.get("recomputed_prefills", 0) for r in decode) == recomputed
        assert next(r for r in decode if r["worker_id"] == moved_from)["moved_out"] >= 1
    wait_idle(base)


def test_a_source_killed_while_its_stream_moves_loses_nothing(two_decode_app):
    """The source decode replica is killed while the operator's move runs (pre-copy, hand-off
    or pull, whichever it reached): the stream still ends with the unmoved text (moved live, or
    resumed by recompute from the tokens sent), the migrate call answers, and afterwards Serve's
    replacement is up and no replica holds a block."""
    base = two_decode_app
    prompt = random_prompts((40,), seed=96)[0]
    reference, _, _ = streamed(base, body(prompt, True))
    answers: list[httpx.Response | Exception] = []
    killed: list[str] = []

    def ask(request_id: str) -> None:
        try:
            answers.append(migrate(base, request_id))
        except httpx.HTTPError as exc:
            answers.append(exc)

    movers: list[threading.Thread] = []

    def move_and_kill_at_fifth(count: int, event: dict) -> None:
        if count == 5:
            movers.append(threading.Thread(target=ask, args=(event["id"],)))
            movers[0].start()
            killed.append(kill_busy_decode_replica(base))

    text, events, _ = streamed(base, body(prompt, True, cache_salt="killed-source"), on_event=move_and_kill_at_fifth)
    movers[0].join(60)
    assert text == reference
    assert len({e["id"] for e in events}) == 1
    assert answers and not isinstance(answers[0], Exception), answers  # answered (moved, or 404: gone first)
    assert answers[0].status_code in (200, 404), answers[0].text
    wait_replicas(APP, "decode", 2, base)
    wait_idle(base)


def test_migrate_names_what_it_cannot_do(two_decode_app):
    """A request id nothing decodes is a 404, a body that is not ``{"request_id": ...}`` a 400
    naming the field: clear errors, never a 500."""
    base = two_decode_app
    missing = migrate(base, "cmpl-nothing-like-it")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"
    for bad in ({}, {"request_id": ""}, {"request_id": "x", "target": "y"}):
        resp = httpx.post(f"{base}/v1/cluster/migrate", json=bad, timeout=30)
        assert resp.status_code == 400, (bad, resp.text)
        assert resp.json()["error"]["param"] in ("request_id", "target"), resp.text


def test_a_client_leaving_during_a_migration_frees_everything(two_decode_app):
    base = two_decode_app
    prompt = random_prompts((33,), seed=93)[0]
    aborted = status(base)["requests"]["aborted"]
    with httpx.stream("POST", f"{base}/v1/completions", json=body(prompt, True), timeout=300) as resp:
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        kill_busy_decode_replica(base)
    # the client has gone; the ingress aborts the continuation wherever it got to
    wait_replicas(APP, "decode", 2, base)
    wait_idle(base)
    assert status(base)["requests"]["aborted"] == aborted + 1
