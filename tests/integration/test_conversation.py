"""Conversations that keep their cache, and the per-request context cap, through the front door:
real Ray Serve, a real redis-server, 4-turn chats over HTTP with the `openai` client.

A turn's ``cached_tokens`` must cover the previous turns exactly: the previous turn computed its
prompt and all of its answer but the last token, so (prompt + completion - 1) tokens rounded
down to whole blocks are cached, and no more (the new message's blocks were never computed)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis

from deploy.ops.status_table import format_status
from tests.integration.conftest import deploy, wait_idle

pytestmark = pytest.mark.timeout(600)
MODEL = "conv"
BLOCK = 16
MAX_TOKENS = 24
EOT = 4  # <|eot_id|>, the tiny models' end of turn (special)
SYSTEM_LONG = (
    "You answer questions about rivers, towns and the weather, briefly and plainly. "
    "Keep to the facts you are given and say when you do not know. "
) * 4
USERS = ["Tell me about the river.", "And the town?", "What about the weather?", "Thanks, anything else?"]


def app_args(model_dir: str, **overrides) -> dict:
    args = {
        "model": model_dir,
        "served_model_name": MODEL,
        "num_kv_blocks": 512,
        "device": "cpu",
        "transfer_timeout_s": 10.0,
        "lease_ttl_s": 10.0,
        "max_model_len": 1024,
        "prefill": {"replicas": 1, "num_cpus": 0.5},
        "decode": {"replicas": 1, "num_cpus": 0.5},
        "colocated": {"replicas": 1, "num_cpus": 0.5},
    }
    return {**args, **overrides}


@pytest.fixture(scope="module")
def apps(serve_cluster, tiny_llama):
    from ray import serve

    # two decode replicas: each turn must find the one that holds its conversation's history
    pd = deploy(
        serve_cluster,
        "conv-pd",
        "/conv-pd",
        app_args(tiny_llama, redis_url=serve_cluster.redis.url, decode={"replicas": 2, "num_cpus": 0.5}),
    )
    # colocated without Redis: turns are kept in the ingress's own memory
    colo = deploy(serve_cluster, "conv-colo", "/conv-colo", app_args(tiny_llama, mode="colocated"))
    yield {"pd": pd, "colo": colo}
    for base in (pd, colo):
        wait_idle(base)
    serve.delete("conv-pd")
    serve.delete("conv-colo")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@dataclass
class Turn:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    answer: str


def chat_turn(c: openai.OpenAI, messages: list[dict], salt: str, stream: bool) -> Turn:
    kwargs = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"cache_salt": salt},
    }
    if not stream:
        out = c.chat.completions.create(**kwargs)
        return Turn(
            out.usage.prompt_tokens,
            out.usage.completion_tokens,
            out.usage.prompt_tokens_details.cached_tokens,
            out.choices[0].finish_reason,
            out.choices[0].message.content,
        )
    pieces, usage, finish = [], None, None
    for chunk in c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return Turn(
        usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens, finish, "".join(pieces)
    )


def converse(base: str, system: str, salt: str, before_turn=None) -> tuple[list[Turn], list[dict]]:
    """Four turns, each sending back the whole history; turn 3 streams."""
    c = client(base)
    messages = [{"role": "system", "content": system}]
    turns = []
    for k, user in enumerate(USERS):
        if before_turn is not None:
            before_turn()
        messages.append({"role": "user", "content": user})
        turn = chat_turn(c, messages, salt, stream=k == 2)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn.answer})
        time.sleep(0.3)  # a user reads the answer: the index has the decode replica's new blocks
    return turns, messages


def expected_cached(turns: list[Turn]) -> list[int]:
    """Turn k reuses what turn k-1 computed: its prompt and answer but the answer's last token."""
    return [0] + [(t.prompt_tokens + t.completion_tokens - 1) // BLOCK * BLOCK for t in turns[:-1]]


def expected_skips(turns: list[Turn]) -> int:
    """Turns whose prompt the decode replica held >= 90 % of (the ingress skips the prefill)."""
    skips = 0
    for prev, turn in itertools.pairwise(turns):
        held, blocks = (prev.prompt_tokens + prev.completion_tokens - 1) // BLOCK, turn.prompt_tokens // BLOCK
        skips += blocks >= 2 and held >= 0.9 * blocks
    return skips


def render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def stitched_prompt(
    tokenizer, messages: list[dict], k: int, previous: list[int], generated: list[int], finish_reason: str
) -> list[int]:
    """The prompt ids turn ``k`` > 0 should be served with: turn k-1's prompt ids, its generated
    ids (less a trailing end of turn), then the new text after its answer."""
    history = messages[: 2 + 2 * k]  # system, (user, assistant) pairs, then the k-th user message
    text, head = render(tokenizer, history), render(tokenizer, history[:-2])
    answer = history[-2]["content"]
    shown = answer if text.startswith(answer, len(head)) else answer.strip()  # the template trims
    assert text.startswith(head + shown)
    generated = generated[:-1] if finish_reason == "stop" and generated[-1] == EOT else generated
    return previous + generated + tokenizer.encode(text[len(head) + len(shown) :], add_special_tokens=False)


def replay(engine, tokenizer, messages: list[dict], turns: list[Turn], reuse: bool):
    """Each turn's prompt ids as the ingress should have built them (stitched, or the text
    tokenized), and a fresh engine's greedy answer to them, which must be the served answer."""
    from workers.engine import SamplingParams

    history: list[tuple[list[int], list[int]]] = []
    finish = None
    for k, turn in enumerate(turns):
        if reuse and k > 0:
            prompt = stitched_prompt(tokenizer, messages, k, *history[-1], finish)
        else:
            prompt = tokenizer.encode(render(tokenizer, messages[: 2 + 2 * k]), add_special_tokens=False)
        assert len(prompt) == turn.prompt_tokens
        out = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
        assert (tokenizer.decode(out.token_ids, skip_special_tokens=True), len(out.token_ids), out.finish_reason) == (
            turn.answer,
            turn.completion_tokens,
            turn.finish_reason,
        )
        history.append((prompt, list(out.token_ids)))
        finish = out.finish_reason
    return history


def cached_by_prefix(history: list[tuple[list[int], list[int]]]) -> list[int]:
    """What each turn finds cached: the whole blocks it shares with what an earlier turn
    computed (that turn's prompt and answer but the answer's last token)."""
    cached = []
    for k, (prompt, _) in enumerate(history):
        best = 0
        for earlier, answer in history[:k]:
            computed = earlier + answer[:-1]
            n = next((i for i, (a, b) in enumerate(zip(prompt, computed)) if a != b), min(len(prompt), len(computed)))
            best = max(best, n)
        cached.append(min(best, len(prompt) - 1) // BLOCK * BLOCK)
    return cached


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from workers.engine import LLMEngine

    return LLMEngine(tiny_llama, num_kv_blocks=128, enable_prefix_caching=False)


# ------------------------------------------------------------------ conversation reuse
@pytest.mark.parametrize("mode", ["pd", "colo"])
def test_four_turns_reuse_prompts_and_answers(apps, mode, engine, tokenizer):
    base = apps[mode]
    before = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()
    turns, messages = converse(base, SYSTEM_LONG, salt=f"reuse-{mode}")
    after = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()

    assert [t.cached_tokens for t in turns] == expected_cached(turns)
    assert all(t.cached_tokens >= 208 for t in turns[1:])  # more than the ~220-token first prompt's blocks
    counts = {k: after["conversations"][k] - before["conversations"][k] for k in ("lookups", "hits", "recorded")}
    assert counts == {"lookups": 3, "hits": 3, "recorded": 4}
    conv = after["conversations"]
    assert (
        f"conversations: {conv['hits']} of {conv['lookups']} follow-up turns reused a recorded turn "
        f"({conv['reused_tokens']} tokens), {conv['recorded']} turns recorded"
    ) in format_status(after)
    if mode == "pd":  # every later turn's history sits on the decode replica: no remote prefill
        assert expected_skips(turns) == 3
        assert after["routing"]["skipped_prefills"] - before["routing"]["skipped_prefills"] == 3
    # the served turns are a fresh engine's greedy answers to the stitched prompt ids
    history = replay(engine, tokenizer, messages, turns, reuse=True)
    assert cached_by_prefix(history) == expected_cached(turns)


def test_interleaved_conversations_each_return_to_their_decode_replica(apps):
    """Three conversations, turns interleaved, over two decode replicas: every later turn is
    served where its history is (exact cached tokens; with the prefill skipped when the holder
    has >= 90 % of the prompt). Which replica a first turn lands on is the router's choice by
    load (with equal load, the same one); the later turns follow the history."""
    base = apps["pd"]
    c = client(base)
    before = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()
    systems = [f"Conversation {i}: " + SYSTEM_LONG for i in range(3)]
    histories = [[{"role": "system", "content": s}] for s in systems]
    turns: list[list[Turn]] = [[] for _ in systems]
    for user in USERS[:3]:
        for i, messages in enumerate(histories):
            messages.append({"role": "user", "content": user})
            turn = chat_turn(c, messages, salt="interleaved", stream=False)
            turns[i].append(turn)
            messages.append({"role": "assistant", "content": turn.answer})
        time.sleep(0.3)
    after = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()
    for conversation in turns:
        assert [t.cached_tokens for t in conversation] == expected_cached(conversation)
    skipped = after["routing"]["skipped_prefills"] - before["routing"]["skipped_prefills"]
    assert skipped == sum(expected_skips(t) for t in turns) == 6
    served = [
        r["requests"] - b["requests"]
        for r, b in zip(
            sorted(after["pools"]["decode"], key=lambda r: r["worker_id"]),
            sorted(before["pools"]["decode"], key=lambda r: r["worker_id"]),
        )
    ]
    assert sum(served) == 9 and len(served) == 2


def test_short_turns_reuse_the_answers_held_by_decode(apps):
    """Short prompts: decode holds < 90 % of them, so prefill runs; the decode replica still
    finds the previous answers in its own cache and pulls only the new blocks."""
    turns, _ = converse(apps["pd"], "Be brief.", salt="short")
    assert [t.cached_tokens for t in turns] == expected_cached(turns)
    assert all(t.cached_tokens > 0 for t in turns[1:])


def test_without_recorded_turns_the_answers_are_recomputed(apps, serve_cluster, engine, tokenizer):
    """The same conversation with the store emptied before every turn (as when its entries
    expire): each turn is its text tokenized, the previous answer's re-tokenized ids differ from
    the generated ones, and cached_tokens stop where they part."""
    store = redis.Redis.from_url(serve_cluster.redis.url)

    def forget_turns() -> None:
        for key in store.scan_iter(match="pd:{*}:conv:*"):
            store.delete(key)

    with_reuse, _ = converse(apps["pd"], SYSTEM_LONG, salt="compare-on")
    without, messages = converse(apps["pd"], SYSTEM_LONG, salt="compare-off", before_turn=forget_turns)
    store.close()
    assert [t.cached_tokens for t in with_reuse] == expected_cached(with_reuse)
    assert [t.cached_tokens for t in without] == cached_by_prefix(
        replay(engine, tokenizer, messages, without, reuse=False)
    )
    assert sum(t.cached_tokens for t in without) < sum(t.cached_tokens for t in with_reuse)


def test_reuse_can_be_turned_off(serve_cluster, tiny_llama, engine, tokenizer):
    from ray import serve

    base = deploy(
        serve_cluster, "conv-off", "/conv-off", app_args(tiny_llama, mode="colocated", conversation_reuse=False)
    )
    try:
        turns, messages = converse(base, SYSTEM_LONG, salt="off")
        assert httpx.get(f"{base}/v1/cluster/status", timeout=10).json()["conversations"] is None
        assert [t.cached_tokens for t in turns] == cached_by_prefix(
            replay(engine, tokenizer, messages, turns, reuse=False)
        )
        assert sum(t.cached_tokens for t in turns) < sum(expected_cached(turns))
        wait_idle(base)
    finally:
        serve.delete("conv-off")


# ------------------------------------------------------------------ per-request context cap
def test_request_context_cap(apps):
    base = apps["pd"]
    prompt = list(range(10, 40))  # 30 tokens

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{base}/v1/{path}", json={"model": MODEL, **body}, timeout=60)

    ok = post("completions", {"prompt": prompt, "max_tokens": 4, "max_model_len": 34, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4

    over = post("completions", {"prompt": prompt, "max_tokens": 5, "max_model_len": 34})
    assert over.status_code == 400
    assert over.json()["error"]["code"] == "context_length_exceeded"
    assert over.json()["error"]["param"] == "max_tokens"
    assert "This request's max_model_len is 34 tokens" in over.json()["error"]["message"]

    long_prompt = post("completions", {"prompt": prompt, "max_model_len": 30})
    assert long_prompt.status_code == 400
    assert long_prompt.json()["error"] == {
        "message": "This request's max_model_len is 30 tokens; the prompt has 30 tokens. Shorten the prompt.",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }

    too_big = post("completions", {"prompt": prompt, "max_model_len": 1025})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_model_len"
    assert "1025 exceeds this model's maximum context length of 1024" in too_big.json()["error"]["message"]
    assert post("completions", {"prompt": prompt, "max_model_len": 1}).json()["error"]["param"] == "max_model_len"

    # chat: without max_tokens the answer may take exactly the room the cap leaves
    messages = [{"role": "user", "content": "Hi"}]
    chat = post("chat/completions", {"messages": messages, "max_model_len": 24, "temperature": 0, "ignore_eos": True})
    assert chat.status_code == 200
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 24
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    tight = post("chat/completions", {"messages": messages, "max_model_len": usage["prompt_tokens"]})
    assert tight.status_code == 400 and tight.json()["error"]["code"] == "context_length_exceeded"
    assert f"max_model_len is {usage['prompt_tokens']} tokens" in tight.json()["error"]["message"]
