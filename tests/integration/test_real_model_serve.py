"""SmolLM2-135M-Instruct through the front door: disaggregated (1 prefill + 1 decode) through
the openai client equals transformers' greedy generate on chat prompts, streamed and not; it
answers a question with a known answer; and an app deployed from the GGUF file itself
(`args.model: FILE.gguf`, colocated) serves the same text."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import CHAT_QUESTIONS, chat_prompt_ids
from tests.integration.conftest import deploy, wait_idle
from tests.unit.engine_helpers import hf_greedy

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
NAME = "smollm2"
NEW_TOKENS = 24


def smol_args(model: str, redis_url: str, **overrides) -> dict:
    return {
        "model": model,
        "served_model_name": NAME,
        "redis_url": redis_url,
        "num_kv_blocks": 256,
        "device": "cpu",
        "prefill": {"replicas": 1, "num_cpus": 0.5},
        "decode": {"replicas": 1, "num_cpus": 0.5},
        "colocated": {"replicas": 1, "num_cpus": 0.5},
        "attention_backend": "auto",  # as served by default (paged on CPU); conftest.deploy's is sdpa
        **overrides,
    }


@pytest.fixture(scope="module")
def smol_apps(serve_cluster, smollm2_dir, smollm2_gguf):
    redis_url = serve_cluster.redis.url
    apps = {
        "pd": deploy(serve_cluster, "smol", "/smol", smol_args(smollm2_dir, redis_url)),
        "gguf": deploy(serve_cluster, "smolgguf", "/smolgguf", smol_args(smollm2_gguf, redis_url, mode="colocated")),
    }
    yield apps
    for base in apps.values():
        wait_idle(base)
    from ray import serve

    for name in ("smol", "smolgguf"):  # three replicas of a 135M model: give the memory back
        serve.delete(name)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(base: str, question: str, stream: bool) -> tuple[str, str | None]:
    messages = [{"role": "user", "content": question}]
    c = client(base)
    if not stream:
        out = c.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, finish = [], None
    for chunk in c.chat.completions.create(
        model=NAME, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


def test_a_known_answer_through_http(smol_apps):
    answer, finish = ask(smol_apps["pd"], "What is the capital of France?", stream=False)
    assert "Paris" in answer and finish == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_disaggregated_chat_equals_transformers(smol_apps, smollm2_dir, stream):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    for question in CHAT_QUESTIONS[:4]:
        expected_ids = hf_greedy(smollm2_dir, tuple(chat_prompt_ids(smollm2_dir, question)), NEW_TOKENS)
        expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
        answer, finish = ask(smol_apps["pd"], question, stream)
        assert answer == expected, question
        assert finish == ("length" if len(expected_ids) == NEW_TOKENS else "stop")


def test_the_gguf_app_serves_the_same_text(smol_apps):
    models = client(smol_apps["gguf"]).models.list()
    assert [m.id for m in models.data] == [NAME]
    for question in CHAT_QUESTIONS[:3]:
        assert ask(smol_apps["gguf"], question, stream=False) == ask(smol_apps["pd"], question, stream=False)
