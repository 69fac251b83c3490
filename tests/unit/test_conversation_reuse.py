"""Conversation reuse without Ray or Redis: the turn digest, the in-process store, which earlier
turn a chat request extends, which answer ids are recorded, and the per-request context cap."""

from __future__ import annotations

import asyncio

import pytest

from deploy.api.context_limit import fit_to_context
from deploy.api.conversation import (
    ConversationCache,
    ConversationTurn,
    answer_token_ids,
    history_candidates,
)
from deploy.api.openai_protocol import RequestError
from deploy.api.output import ChoiceAssembler
from kvstore.conversation import (
    ConversationConfig,
    LocalConversationStore,
    conversation_key,
    pack_token_ids,
    unpack_token_ids,
)

EOT = 4  # the tiny tokenizer's <|eot_id|> (special, an EOS of the tiny models)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def render(tokenizer, messages, add_generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def finished(tokenizer, token_ids, finish_reason, stop=(), skip_special_tokens=True) -> ChoiceAssembler:
    assembler = ChoiceAssembler(tokenizer, [0], tuple(stop), skip_special_tokens=skip_special_tokens)
    assembler.add(token_ids, None, finish_reason)
    return assembler


# ------------------------------------------------------------------- digest and encoding
def test_key_separates_model_salt_and_text():
    base = conversation_key("m", None, "hello")
    assert base == conversation_key("m", None, "hello")
    assert len(base) == 32
    others = {
        conversation_key("m2", None, "hello"),
        conversation_key("m", "tenant", "hello"),
        conversation_key("m", None, "hello!"),
        conversation_key("m", "a", "bc"),
        conversation_key("m", "ab", "c"),
    }
    assert base not in others and len(others) == 5
    assert conversation_key("m", None, "x") == conversation_key("m", "", "x")  # no salt is the empty salt


def test_token_ids_round_trip():
    ids = [0, 1, 127, 128, 65_535, 2**31 - 1]
    assert pack_token_ids(ids) == b"".join(i.to_bytes(4, "little") for i in ids)
    assert unpack_token_ids(pack_token_ids(ids)) == ids


# ------------------------------------------------------------------------ local store
def test_local_store_ttl_and_entry_cap():
    now = [100.0]
    store = LocalConversationStore(ConversationConfig(ttl_s=10.0, max_entry_tokens=4), clock=lambda: now[0])
    assert run(store.put(b"a", [1, 2, 3])) is True
    assert run(store.put(b"long", [1, 2, 3, 4, 5])) is False  # over max_entry_tokens: not kept
    assert run(store.get_many([b"a", b"long", b"zz"])) == [[1, 2, 3], None, None]
    now[0] = 109.9
    assert run(store.get_many([b"a"])) == [[1, 2, 3]]
    now[0] = 110.0
    assert run(store.get_many([b"a"])) == [None]
    assert len(store) == 0 and store.num_tokens == 0


def test_local_store_evicts_least_recently_used_by_entries_and_tokens():
    store = LocalConversationStore(ConversationConfig(local_max_entries=3, local_max_tokens=10))
    for key, n in ((b"a", 3), (b"b", 3), (b"c", 3)):
        run(store.put(key, list(range(n))))
    run(store.get_many([b"a"]))  # a is now the most recently used
    run(store.put(b"d", [7]))  # 4 entries > 3: b (least recent) goes
    assert run(store.get_many([b"a", b"b", b"c", b"d"])) == [[0, 1, 2], None, [0, 1, 2], [7]]
    assert store.num_tokens == 7
    # the lookup above refreshed a, c, d in that order; with e's 7 tokens, 14 fit the 10-token
    # bound only after dropping the two least recent (a, then c)
    run(store.put(b"e", list(range(7))))
    assert run(store.get_many([b"a", b"c", b"d", b"e"])) == [None, None, [7], list(range(7))]
    assert len(store) == 2 and store.num_tokens == 8
    run(store.put(b"d", [1, 2]))  # replacing an entry replaces its tokens
    assert len(store) == 2 and store.num_tokens == 9


# ------------------------------------------------------------------ history candidates
def test_candidates_latest_first_with_trimmed_answers(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " padded answer "},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "Again"},
    ]
    text = render(tokenizer, messages)
    found = history_candidates(lambda m: render(tokenizer, m), messages, text)
    head4, head2 = render(tokenizer, messages[:4]), render(tokenizer, messages[:2])
    assert [c.recorded_text for c in found] == [head4 + "second", head2 + " padded answer "]
    assert found[0].rest_start == len(head4) + len("second")
    # the template trims the first answer: the rest starts after the trimmed text
    assert found[1].rest_start == len(head2) + len("padded answer")
    assert text[found[1].rest_start :].startswith("<|eot_id|>")
    assert len(history_candidates(lambda m: render(tokenizer, m), messages, text, max_candidates=1)) == 1


def test_no_candidate_when_the_history_changed(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]
    text = render(tokenizer, messages)
    other = [{"role": "user", "content": "Hi!"}, *messages[1:]]  # an earlier message edited
    assert history_candidates(lambda m: render(tokenizer, m), other, text) == []
    assert history_candidates(lambda m: render(tokenizer, m), messages[:1], render(tokenizer, messages[:1])) == []


# ----------------------------------------------------------------- recorded answer ids
def test_answer_ids_drop_a_trailing_special_stop_token(tokenizer):
    assert answer_token_ids(finished(tokenizer, [300, 301, EOT], "stop"), frozenset(tokenizer.all_special_ids)) == [
        300,
        301,
    ]
    assert answer_token_ids(finished(tokenizer, [300, 301, 302], "length"), frozenset(tokenizer.all_special_ids)) == [
        300,
        301,
        302,
    ]
    # a non-special stop token is part of the text, and so is EOS when special tokens are shown
    assert answer_token_ids(finished(tokenizer, [300, 301], "stop"), frozenset(tokenizer.all_special_ids)) == [300, 301]
    shown = finished(tokenizer, [300, EOT], "stop", skip_special_tokens=False)
    assert answer_token_ids(shown, frozenset(tokenizer.all_special_ids)) == [300, EOT]


def test_answer_cut_by_a_stop_string_or_unfinished_is_not_recorded(tokenizer):
    ids = [300, 301, 302, 303]
    text = tokenizer.decode(ids)
    cut = finished(tokenizer, ids, None, stop=(text[2:4],))
    assert cut.finish_reason == "stop" and cut.stopped_by_string
    assert answer_token_ids(cut, frozenset()) is None
    running = ChoiceAssembler(tokenizer, [0])
    running.add([300], None, None)
    assert answer_token_ids(running, frozenset()) is None


# ------------------------------------------------------------------- record and reuse
def test_next_turn_is_recorded_ids_plus_the_new_text(tokenizer):
    cache = ConversationCache(tokenizer, "model-a", LocalConversationStore())
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text1 = render(tokenizer, turn1)
    prompt1 = tokenizer.encode(text1, add_special_tokens=False)
    assert run(cache.prompt_ids(turn1, text1, None)) is None  # no assistant message: nothing to look up
    generated = [300, 301, 302, 50, 60, 70, EOT]
    answer = finished(tokenizer, generated, "stop")
    assert run(cache.remember(ConversationTurn(text1, None), prompt1, answer)) is True

    turn2 = [*turn1, {"role": "assistant", "content": answer.text}, {"role": "user", "content": "more"}]
    text2 = render(tokenizer, turn2)
    stitched = run(cache.prompt_ids(turn2, text2, None))
    rest = text2[len(text1) + len(answer.text.strip()) :]
    assert rest.startswith("<|eot_id|><|start_header_id|>user")
    assert stitched.token_ids == prompt1 + generated[:-1] + tokenizer.encode(rest, add_special_tokens=False)
    assert stitched.num_reused_tokens == len(prompt1) + len(generated) - 1
    # re-tokenizing the text would not have given the generated ids back
    assert (
        tokenizer.encode(text2, add_special_tokens=False)[: stitched.num_reused_tokens]
        != stitched.token_ids[: stitched.num_reused_tokens]
    )
    # another tenant, or an answer the client edited, does not match
    assert run(cache.prompt_ids(turn2, text2, "tenant-b")) is None
    edited = [*turn1, {"role": "assistant", "content": answer.text + "x"}, {"role": "user", "content": "more"}]
    assert run(cache.prompt_ids(edited, render(tokenizer, edited), None)) is None
    assert cache.stats() == {"lookups": 3, "hits": 1, "reused_tokens": stitched.num_reused_tokens, "recorded": 1}


def test_turn_cut_by_stop_string_is_not_recorded(tokenizer):
    store = LocalConversationStore()
    cache = ConversationCache(tokenizer, "model-a", store)
    ids = [300, 301, 302, 303]
    cut = finished(tokenizer, ids, None, stop=(tokenizer.decode(ids)[2:4],))
    assert run(cache.remember(ConversationTurn("prompt", None), [1, 2], cut)) is False
    assert len(store) == 0


# ------------------------------------------------------------------ per-request context cap
def test_request_cap_limits_the_context():
    prompt = list(range(10, 40))  # 30 tokens
    assert fit_to_context(prompt, None, 1000, 2048) == 2018
    assert fit_to_context(prompt, None, 1000, 2048, request_limit=64) == 34
    assert fit_to_context(prompt, 34, 1000, 2048, request_limit=64) == 34
    with pytest.raises(RequestError) as over:
        fit_to_context(prompt, 35, 1000, 2048, request_limit=64)
    assert (over.value.param, over.value.code) == ("max_tokens", "context_length_exceeded")
    assert over.value.message.startswith("This request's max_model_len is 64 tokens. However, you requested 65")
    with pytest.raises(RequestError) as long_prompt:
        fit_to_context(prompt, None, 1000, 2048, request_limit=30)
    assert (long_prompt.value.param, long_prompt.value.code) == ("prompt", "context_length_exceeded")
    assert long_prompt.value.message == (
        "This request's max_model_len is 30 tokens; the prompt has 30 tokens. Shorten the prompt."
    )
    with pytest.raises(RequestError) as too_big:
        fit_to_context(prompt, None, 1000, 2048, request_limit=4096)
    assert (too_big.value.param, too_big.value.status) == ("max_model_len", 400)
    assert "4096 exceeds this model's maximum context length of 2048" in too_big.value.message
    with pytest.raises(RequestError) as model_limit:
        fit_to_context(prompt, None, 1000, 30)
    assert model_limit.value.message.startswith("This model's maximum context length is 30 tokens;")
