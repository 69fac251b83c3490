"""Structured outputs, tool calls and sampling controls through the front door: SmolLM2 on real
Ray Serve, disaggregated (1 prefill + 1 decode) and colocated, through the openai SDK.

- ``client.chat.completions.parse(response_format=<pydantic model>)`` returns a valid object for
  every one of 30 varied prompts (nested objects, arrays, enums, bounded numbers, optional
  fields), on both layouts, streamed and not;
- a regex and a choice constraint, on chat and completions;
- a named and a ``required`` tool call whose arguments validate against the tool's schema, an
  ``auto`` call parsed from the model's own ``<tool_call>`` format, streamed as deltas the SDK
  assembles, and a follow-up turn carrying the tool's result;
- penalties, ``logit_bias``, ``min_tokens`` and ``bad_words`` give the engine's own tokens;
- and afterwards no replica holds a block.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import deploy, wait_idle
from tests.integration.test_real_model_serve import NAME, client, smol_args

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
Short = Annotated[str, Field(max_length=24)]


class Address(BaseModel):
    street: Short
    city: Short
    country: Literal["France", "Germany", "Japan", "USA", "UK", "Italy"]


class Person(BaseModel):
    name: Short
    age: int = Field(ge=0, le=120)
    address: Address
    hobbies: list[Short] = Field(max_length=3)
    email: Short | None


class Item(BaseModel):
    product: Short
    quantity: int = Field(ge=1, le=100)


class Order(BaseModel):
    order_id: int = Field(ge=1, le=99999)
    items: list[Item] = Field(min_length=1, max_length=3)
    status: Literal["pending", "shipped", "delivered"]
    express: bool


class Weather(BaseModel):
    city: Short
    temperature_c: int = Field(ge=-60, le=60)
    conditions: Literal["sunny", "cloudy", "rain", "snow"]
    wind_kmh: int | None = Field(ge=0, le=300)


class Book(BaseModel):
    title: Short
    author: Short
    year: int = Field(ge=1000, le=2030)
    genres: list[Literal["fiction", "history", "science", "poetry", "mystery"]] = Field(max_length=3)


class Recipe(BaseModel):
    dish: Short
    servings: int = Field(ge=1, le=12)
    vegetarian: bool
    steps: list[Short] = Field(min_length=1, max_length=3)


class Verdict(BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    confidence: Literal["low", "medium", "high"]
    summary: Short


CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "Invent a person who lives in Paris and likes chess."),
    (Person, "Describe a retired teacher from Tokyo."),
    (Person, "Make up a profile for a young musician in London."),
    (Person, "Create a record for a doctor living in Berlin."),
    (Person, "Give details of a chef from Rome with no email."),
    (Order, "A customer bought two books and a pen; the order has shipped."),
    (Order, "Record an express order of 5 apples, pending."),
    (Order, "An order of one laptop was delivered yesterday."),
    (Order, "Write an order for three chairs and a table."),
    (Weather, "It is sunny and 25 degrees in Madrid with light wind."),
    (Weather, "Snow in Oslo, minus 8 degrees."),
    (Weather, "Report cloudy weather in Seattle."),
    (Weather, "Heavy rain in Mumbai, 30 degrees, strong wind."),
    (Book, "Describe the novel Pride and Prejudice."),
    (Book, "A history book about Rome written in 1990."),
    (Book, "Tell me about a poetry collection."),
    (Book, "Invent a mystery novel."),
    (Recipe, "A recipe for pancakes."),
    (Recipe, "How to make a vegetable soup for four people."),
    (Recipe, "Give a recipe for grilled chicken."),
    (Recipe, "A simple salad recipe."),
    (Verdict, "Review: The film was wonderful, I loved every minute."),
    (Verdict, "Review: Terrible service and cold food."),
    (Verdict, "Review: It was fine, nothing special."),
    (Verdict, "Review: Best purchase I have made this year!"),
    (Verdict, "Review: The battery died after two days."),
    (Person, "Invent an astronaut."),
    (Order, "Order number 42: ten pencils, pending."),
    (Weather, "Describe the weather in Cairo today."),
    (Recipe, "A recipe for chocolate cake."),
]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def apps(serve_cluster, smollm2_dir):
    redis_url = serve_cluster.redis.url
    found = {
        "pd": deploy(serve_cluster, "structpd", "/structpd", smol_args(smollm2_dir, redis_url)),
        "colocated": deploy(
            serve_cluster, "structco", "/structco", smol_args(smollm2_dir, redis_url, mode="colocated")
        ),
    }
    yield found
    for base in found.values():
        wait_idle(base)
    from ray import serve

    for name in ("structpd", "structco"):
        serve.delete(name)


def _messages(prompt: str) -> list[dict]:
    return [
        {"role": "system", "content": "You answer with JSON only."},
        {"role": "user", "content": prompt},
    ]


def _parse_one(base: str, case: tuple[type[BaseModel], str]) -> tuple[BaseModel | None, str, str | None]:
    model, prompt = case
    out = client(base).chat.completions.parse(
        model=NAME, messages=_messages(prompt), response_format=model, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = out.choices[0]
    return choice.message.parsed, choice.message.content or "", choice.finish_reason


@pytest.mark.parametrize("layout", ["pd", "colocated"])
def test_thirty_prompts_parse_into_their_pydantic_models(apps, layout):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda case: _parse_one(apps[layout], case), CASES))
    for (model, prompt), (parsed, text, finish) in zip(CASES, results, strict=True):
        assert finish == "stop", (prompt, text)
        assert isinstance(parsed, model), (prompt, text)
        assert model.model_validate_json(text) == parsed


def test_disaggregated_and_colocated_give_the_same_constrained_text(apps):
    for case in CASES[:6]:
        assert _parse_one(apps["pd"], case)[1] == _parse_one(apps["colocated"], case)[1], case[1]


def test_a_constrained_stream_is_the_whole_answer(apps):
    model, prompt = CASES[5]
    whole = _parse_one(apps["pd"], CASES[5])[1]
    schema = {"name": "order", "schema": model.model_json_schema(), "strict": True}
    stream = client(apps["pd"]).chat.completions.create(
        model=NAME,
        messages=_messages(prompt),
        response_format={"type": "json_schema", "json_schema": schema},
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert model.model_validate_json(text) and json.loads(text) == json.loads(whole)


def test_json_object_regex_and_choice_on_chat_and_completions(apps):
    c = client(apps["pd"])
    out = c.chat.completions.create(
        model=NAME,
        messages=_messages("Return a JSON object mapping three colours to their hex codes."),
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    out = c.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "When did the Berlin wall fall?"}],
        max_tokens=32,
        temperature=0,
        extra_body={"guided_regex": date},
    )
    import re

    assert re.fullmatch(date, out.choices[0].message.content)
    choices = ["Paris", "Berlin", "Madrid"]
    for layout in ("pd", "colocated"):
        text = (
            client(apps[layout])
            .completions.create(
                model=NAME,
                prompt="The capital of Germany is",
                max_tokens=8,
                temperature=0.7,
                seed=3,
                extra_body={"structured_outputs": {"choice": choices}},
            )
            .choices[0]
            .text
        )
        assert text in choices


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 32}},
            "required": ["timezone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
ASK_WEATHER = [{"role": "user", "content": "What's the weather like in Paris?"}]


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("layout", ["pd", "colocated"])
def test_a_named_and_a_required_tool_call_have_valid_arguments(apps, layout):
    c = client(apps[layout])
    named = c.chat.completions.create(
        model=NAME,
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0,
    )
    message = named.choices[0].message
    assert [call.function.name for call in message.tool_calls] == ["get_weather"]
    _check_calls(message.tool_calls)
    assert named.choices[0].finish_reason == "stop"  # as OpenAI reports a forced named function
    required = c.chat.completions.create(
        model=NAME,
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,  # at most one call: greedy SmolLM2 would repeat calls to the limit
        max_tokens=96,
        temperature=0,
    )
    _check_calls(required.choices[0].message.tool_calls)
    assert len(required.choices[0].message.tool_calls) == 1
    assert required.choices[0].finish_reason == "tool_calls"


# Two earlier turns show the model its tool-call format (without the tools' results: after a
# result SmolLM2-135M imitates the result instead); it then answers the next question with a
# call of its own, in that format, which the Hermes parser reads.
def _weather_call(city: str, index: int) -> dict:
    arguments = json.dumps({"city": city, "unit": "celsius"})
    call = {"id": f"call_{index}", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


FEW_SHOT = [
    {"role": "user", "content": "Weather in Rome?"},
    _weather_call("Rome", 0),
    {"role": "user", "content": "Weather in Oslo?"},
    _weather_call("Oslo", 1),
    {"role": "user", "content": "Weather in Paris?"},
]
WITH_RESULT = [
    *ASK_WEATHER,
    _weather_call("Paris", 0),
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature": 21, "conditions": "sunny"}'},
]


def test_an_auto_tool_call_is_parsed_from_the_models_format_streamed_and_not(apps):
    c = client(apps["pd"])
    whole = c.chat.completions.create(
        model=NAME, messages=FEW_SHOT, tools=[WEATHER_TOOL], max_tokens=64, temperature=0
    ).choices[0]
    assert whole.finish_reason == "tool_calls", whole.message
    _check_calls(whole.message.tool_calls)
    assert whole.message.tool_calls[0].function.name == "get_weather"

    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(
        model=NAME, messages=FEW_SHOT, tools=[WEATHER_TOOL], max_tokens=64, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(e["name"], json.loads(e["arguments"])) for e in calls.values()] == [
        (call.function.name, json.loads(call.function.arguments)) for call in whole.message.tool_calls
    ]


def test_a_tool_result_turn_is_answered_in_text(apps):
    out = client(apps["pd"]).chat.completions.create(
        model=NAME, messages=WITH_RESULT, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=24, temperature=0
    )
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


def test_sampling_controls_give_the_engines_tokens(apps, smollm2_dir):
    """Penalties, logit_bias, min_tokens and bad_words through HTTP equal the engine's output
    with the same parameters (the formulas themselves: tests/unit/test_logits_processors.py)."""
    from transformers import AutoTokenizer

    from tests.conftest import chat_prompt_ids
    from workers.engine import LLMEngine, SamplingParams
    from workers.engine.logits_processors import bad_words_token_ids

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    question = "Write a short poem about the sea."
    prompt = chat_prompt_ids(smollm2_dir, question)
    paris = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    controls = {
        "frequency_penalty": 1.5,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.3,
        "logit_bias": {str(paris): 8.0},
        "min_tokens": 20,
        "bad_words": ["sea", "waves"],
    }
    engine = LLMEngine(smollm2_dir, load_progress=False, num_kv_blocks=64)
    params = SamplingParams(
        max_tokens=40,
        temperature=0.0,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias=((paris, 8.0),),
        min_tokens=20,
        bad_words_ids=bad_words_token_ids(tokenizer, ["sea", "waves"]),
        logprobs=0,
    )
    expected = engine.generate([prompt], params)[0]
    plain = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert expected.token_ids != plain.token_ids
    for layout in ("pd", "colocated"):
        out = client(apps[layout]).chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": question}],
            max_tokens=40,
            temperature=0,
            logprobs=True,
            extra_body={k: v for k, v in controls.items() if k not in ("frequency_penalty", "presence_penalty")},
            frequency_penalty=1.5,
            presence_penalty=0.5,
        )
        assert out.choices[0].message.content == expected.text, layout
        # logprobs stay the model's own: the raw distribution's, not the penalized one's
        assert expected.logprobs is not None
        reported = [entry.logprob for entry in out.choices[0].logprobs.content]
        assert reported == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-4)


def test_every_unknown_or_unsupported_field_is_a_400_naming_it(apps):
    c = client(apps["pd"])
    cases = [
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"extra_body": {"guided_decoding_backend": "outlines"}}, "guided_decoding_backend"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"store": True}, "store"),
        ({"extra_body": {"min_tokens": 50}, "max_tokens": 10}, "min_tokens"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            c.chat.completions.create(model=NAME, messages=ASK_WEATHER, **{"max_tokens": 8, **kwargs})
        assert caught.value.status_code == 400
        body = caught.value.body if isinstance(caught.value.body, dict) else {}
        assert body.get("error", body).get("param") == param, (kwargs, body)
    ok = c.chat.completions.create(
        model=NAME, messages=ASK_WEATHER, max_tokens=4, user="u1", metadata={"k": "v"}, store=False
    )
    assert ok.choices[0].message.content is not None
