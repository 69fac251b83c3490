"""Tool calling (deploy/api/tools.py): validation, the forced modes' constraints, rendering into
chat templates, and the Hermes / Llama 3.1 parsers on recorded model outputs, streamed in
random chunkings."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import jsonschema
import pytest
from pydantic import ValidationError

from deploy.api.openai_protocol import RequestError
from deploy.api.tools import (
    EMPTY_PARAMETERS,
    ForcedToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolChoice,
    StreamingToolParser,
    ToolCall,
    ToolDefinition,
    chat_template_inputs,
    choose_parser,
    finish_reason_with_tools,
    flatten_tool_messages,
    forced_tool_calls,
    new_stream_parser,
    parse_tool_calls,
    plan_tools,
    render_messages,
    template_supports_tools,
    tool_system_prompt,
    with_tool_prompt,
)

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_PARAMS},
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
TOOLS = [WEATHER, TIME]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def _param(exc_info) -> str | None:
    return exc_info.value.param


# ------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "tools, choice, param",
    [
        (None, "auto", "tool_choice"),
        ([], "required", "tool_choice"),
        (None, {"type": "function", "function": {"name": "get_weather"}}, "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "get_stock_price"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        ([WEATHER, WEATHER], "auto", "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"required": "city"}}}], None, "tools"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools"),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools"),
        ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "unknown": 1}}], None, "tools"),
    ],
)
def test_invalid_tools_name_the_parameter(tools, choice, param):
    with pytest.raises(RequestError) as exc_info:
        plan_tools(tools, choice)
    assert _param(exc_info) == param
    assert exc_info.value.status == 400


def test_models_refuse_unknown_fields():
    with pytest.raises(ValidationError):
        ToolDefinition.model_validate({**WEATHER, "extra": True})
    with pytest.raises(ValidationError):
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "f", "x": 1}})
    with pytest.raises(ValidationError):
        ToolCall.model_validate({"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}})
    ToolDefinition.model_validate({"type": "function", "function": {"name": "a-Z_09", "strict": True}})


def test_no_plan_without_tools_or_with_choice_none():
    assert plan_tools(None, None) is None
    assert plan_tools([], None) is None
    assert plan_tools(TOOLS, "none") is None


def test_auto_is_the_default_and_renders_every_tool():
    plan = plan_tools(TOOLS, None)
    assert plan is not None and plan.mode == "auto" and plan.constraint is None
    assert plan.tool_names == ("get_weather", "get_time")
    assert plan.template_tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city",
                "parameters": WEATHER_PARAMS,
            },
        },
        {"type": "function", "function": {"name": "get_time", "parameters": EMPTY_PARAMETERS}},
    ]
    assert plan_tools([ToolDefinition.model_validate(t) for t in TOOLS], "auto") == plan


# ------------------------------------------------------------------ constraints
def test_named_choice_forces_the_arguments_object():
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert plan is not None and plan.mode == "named" and plan.function_name == "get_weather"
    assert plan.constraint == ("json_schema", json.dumps(WEATHER_PARAMS))
    plan = plan_tools(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}}))
    assert plan is not None and plan.constraint == ("json_schema", json.dumps(EMPTY_PARAMETERS))


def _required_schema(tools, parallel=True) -> dict:
    plan = plan_tools(tools, "required", parallel)
    assert plan is not None and plan.mode == "required" and plan.constraint is not None
    kind, spec = plan.constraint
    assert kind == "json_schema"
    schema = json.loads(spec)
    jsonschema.validators.validator_for(schema).check_schema(schema)
    return schema


def _valid(schema: dict, instance) -> bool:
    return jsonschema.validators.validator_for(schema)(schema).is_valid(instance)


def test_required_choice_forces_an_array_of_calls():
    schema = _required_schema(TOOLS)
    paris = {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}
    assert _valid(schema, [paris])
    assert _valid(schema, [paris, {"name": "get_time", "parameters": {}}])
    assert not _valid(schema, [])  # at least one call
    assert not _valid(schema, [{"name": "get_stock", "parameters": {"city": "Paris"}}])  # no such tool
    assert not _valid(schema, [{"name": "get_weather", "parameters": {}}])  # city is required
    assert not _valid(schema, [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}])
    assert not _valid(schema, [{**paris, "id": 1}])  # no other keys
    assert not _valid(schema, [{"name": "get_weather"}])  # both keys required
    assert not _valid(schema, paris)  # an array
    assert "maxItems" not in schema


def test_required_without_parallel_calls_allows_one():
    schema = _required_schema(TOOLS, parallel=False)
    paris = {"name": "get_weather", "parameters": {"city": "Paris"}}
    assert schema["maxItems"] == 1
    assert _valid(schema, [paris])
    assert not _valid(schema, [paris, paris])


def test_required_hoists_definitions_to_the_root():
    unit_params = {
        "$defs": {"Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
    }
    tools = [{"type": "function", "function": {"name": "set_unit", "parameters": unit_params}}]
    schema = _required_schema(tools)
    assert "Unit" in schema["$defs"]
    assert _valid(schema, [{"name": "set_unit", "parameters": {"unit": "celsius"}}])
    assert not _valid(schema, [{"name": "set_unit", "parameters": {"unit": "kelvin"}}])
    assert "$defs" in unit_params  # the request's schema is left as it was
    clash = {**unit_params, "$defs": {"Unit": {"type": "integer"}}}
    with pytest.raises(RequestError) as exc_info:
        plan_tools(tools + [{"type": "function", "function": {"name": "other", "parameters": clash}}], "required")
    assert _param(exc_info) == "tools"


def test_xgrammar_compiles_the_constraints():
    """The engine's XGrammar takes the schemas and enforces them (where it is installed)."""
    xgr = pytest.importorskip("xgrammar")
    accepts = getattr(getattr(xgr, "testing", None), "_is_grammar_accept_string", None)
    if accepts is None:
        pytest.skip("this xgrammar has no testing._is_grammar_accept_string")
    single = plan_tools(TOOLS, "required", parallel_tool_calls=False)
    assert single is not None and single.constraint is not None
    grammar = xgr.Grammar.from_json_schema(single.constraint[1])
    assert accepts(grammar, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    assert not accepts(grammar, '[{"name": "get_stock", "parameters": {"city": "Paris"}}]')
    assert not accepts(grammar, '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]')
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named is not None and named.constraint is not None
    grammar = xgr.Grammar.from_json_schema(named.constraint[1])
    assert accepts(grammar, '{"city": "Paris", "unit": "celsius"}')
    assert not accepts(grammar, '{"unit": "celsius"}')


# -------------------------------------------------------------------- rendering
CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris "}, {"type": "text", "text": "and Rome?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 24}'},
]


def test_render_messages_for_hugging_face_templates():
    rendered = render_messages(CONVERSATION)
    assert rendered[0] == {"role": "system", "content": "Be brief."}
    assert rendered[1] == {"role": "user", "content": "Weather in Paris and Rome?"}
    assert rendered[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "call_1"},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}, "id": "call_2"},
        ],
    }
    assert rendered[3] == {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "call_1"}
    bad = [
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}],
        }
    ]
    with pytest.raises(RequestError) as exc_info:
        render_messages(bad)
    assert _param(exc_info) == "messages"


def test_flattened_tool_messages_are_hermes_text():
    flat = flatten_tool_messages(render_messages(CONVERSATION))
    assert [m["role"] for m in flat] == ["system", "user", "assistant", "user"]
    assert flat[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    }
    assert flat[3]["content"] == (
        '<tool_response>\n{"temp": 18}\n</tool_response>\n<tool_response>\n{"temp": 24}\n</tool_response>'
    )
    plan = plan_tools(TOOLS, "auto")
    assert plan is not None
    merged = with_tool_prompt(render_messages(CONVERSATION), plan.template_tools)
    preamble = tool_system_prompt(plan.template_tools)
    assert merged[0] == {"role": "system", "content": preamble + "\n\nBe brief."}
    new_system = with_tool_prompt(render_messages(CONVERSATION[1:]), plan.template_tools)
    assert new_system[0] == {"role": "system", "content": preamble} and new_system[1]["role"] == "user"
    assert preamble.startswith("# Tools\n\nYou may call one or more functions to assist with the user query.")
    assert "\n<tools>\n" + json.dumps(plan.template_tools[0]) + "\n" + json.dumps(plan.template_tools[1]) in preamble
    assert preamble.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    from workers.models.gguf import is_converted
    from workers.models.source import pulled_dir

    path = pulled_dir("smollm2")
    if not is_converted(path):
        pytest.skip(f"SmolLM2 is not pulled into {path} (pdserve pull)")
    return AutoTokenizer.from_pretrained(str(path))


def test_smollm2_template_gets_the_tools_in_its_system_message():
    tok = _smollm2_tokenizer()
    assert not template_supports_tools(tok)  # it renders role + content, nothing else
    assert choose_parser(tok) is HermesToolParser
    plan = plan_tools(TOOLS, "auto")
    messages, tools = chat_template_inputs(tok, CONVERSATION, plan)
    assert tools is None
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert "<tools>\n" in text and "\n</tools>" in text
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text
    assert "Be brief.<|im_end|>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response>\n<tool_response>' in text
    assert "<|im_start|>tool" not in text and "None" not in text
    assert text.endswith("<|im_start|>assistant\n")
    # without tools, tool messages of the history are still text the template can render
    plain, _ = chat_template_inputs(tok, CONVERSATION, None)
    text = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert "<tools>" not in text and "<tool_response>" in text


TOOL_TEMPLATE = (
    "{% for tool in tools or [] %}TOOL {{ tool.function.name }} {{ tool.function.parameters | tojson }}\n{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}({{ c.function.arguments.city }})"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "<tool_call>"
)


def _tiny_tokenizer(template: str):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.chat_template = template
    return tok


def test_a_template_that_renders_tools_gets_them_as_they_are():
    tok = _tiny_tokenizer(TOOL_TEMPLATE)
    assert template_supports_tools(tok)
    assert choose_parser(tok) is HermesToolParser
    plan = plan_tools(TOOLS, "required")
    assert plan is not None
    messages, tools = chat_template_inputs(tok, CONVERSATION, plan)
    assert tools == plan.template_tools
    assert messages == render_messages(CONVERSATION)
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert "TOOL get_weather " + json.dumps(WEATHER_PARAMS) in text and "TOOL get_time" in text
    assert "<assistant>CALL get_weather(Paris)CALL get_weather(Rome)" in text
    assert '<tool>{"temp": 18}[call_1]' in text
    assert "# Tools" not in text


@pytest.mark.parametrize(
    "template, parser",
    [
        ("{{ tools }}<tool_call>\n{{ messages }}", HermesToolParser),
        ("{% if tools %}<|python_tag|>{% endif %}", Llama3JsonToolParser),
        ('{% if tools %}Respond as {"name": function name, "parameters": ...}{% endif %}', Llama3JsonToolParser),
        ("{% for tool in tools %}{% endfor %}<|start_header_id|>ipython", Llama3JsonToolParser),
        ("{% for tool in tools %}{{ tool }}{% endfor %}", HermesToolParser),
        ("{{ messages }} <|python_tag|>", HermesToolParser),  # no tools rendered: our Hermes prompt
        (None, HermesToolParser),
    ],
)
def test_choose_parser_by_template(template, parser):
    assert choose_parser(SimpleNamespace(chat_template=template)) is parser


def test_named_templates_count():
    tok = SimpleNamespace(chat_template={"default": "{{ messages }}", "tool_use": "{{ tools }}<|python_tag|>"})
    assert template_supports_tools(tok) and choose_parser(tok) is Llama3JsonToolParser


# ---------------------------------------------------------------------- parsers
def _call(name: str, arguments: dict) -> tuple[str, dict]:
    return name, arguments


# (output as the model wrote it, expected content, expected calls as (name, arguments))
HERMES_OUTPUTS = {
    "qwen_single": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "",
        [_call("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    "qwen_leading_text": (
        "I'll check the current weather in Paris for you.\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "I'll check the current weather in Paris for you.",
        [_call("get_weather", {"city": "Paris"})],
    ),
    "qwen_parallel": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>',
        "",
        [_call("get_weather", {"city": "Paris"}), _call("get_weather", {"city": "Rome", "unit": "celsius"})],
    ),
    "call_then_text": (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\nI asked for the time; one moment.\n',
        "I asked for the time; one moment.\n",
        [_call("get_time", {})],
    ),
    "malformed_json": (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        [],
    ),
    "malformed_then_valid": (
        '<tool_call>\n{"name": get_weather}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        '<tool_call>\n{"name": get_weather}\n</tool_call>',
        [_call("get_weather", {"city": "Oslo"})],
    ),
    "mentions_tool_tags": (
        "The <tools> list names what I can use, and a <toolbox> is something else; "
        "calls go inside <tool_call></tool_call> tags. <tool",
        "The <tools> list names what I can use, and a <toolbox> is something else; "
        "calls go inside <tool_call></tool_call> tags. <tool",
        [],
    ),
    "plain_answer": (
        "The capital of France is Paris.\n\n",
        "The capital of France is Paris.\n\n",
        [],
    ),
    "smollm2_list": (
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]</tool_call>',
        "",
        [_call("get_weather", {"city": "Paris"}), _call("get_time", {"timezone": "Europe/Paris"})],
    ),
    "unterminated_call": (
        'Sure.<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n',
        "Sure.",
        [_call("get_time", {"timezone": "Asia/Tokyo"})],
    ),
    "cut_inside_a_call": (
        'Sure.\n<tool_call>\n{"name": "get_time", "argu',
        'Sure.\n<tool_call>\n{"name": "get_time", "argu',
        [],
    ),
    "string_arguments_and_unicode": (
        '<tool_call>\n{"name": "translate", "arguments": '
        '"{\\"text\\": \\"Grüße {aus} Köln\\", \\"to\\": \\"日本語\\"}"}\n</tool_call>',
        "",
        [_call("translate", {"text": "Grüße {aus} Köln", "to": "日本語"})],
    ),
}

LLAMA_OUTPUTS = {
    "python_tag": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [_call("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    "bare_json": (
        '{"name": "get_weather", "parameters": {"city": "San Francisco, CA"}}',
        "",
        [_call("get_weather", {"city": "San Francisco, CA"})],
    ),
    "two_calls": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "run_sql", "parameters": {"query": "SELECT \\"}\\" FROM t WHERE a = \'{\'"}}',
        "",
        [_call("get_weather", {"city": "Paris"}), _call("run_sql", {"query": "SELECT \"}\" FROM t WHERE a = '{'"})],
    ),
    "plain_answer": ("The capital of France is Paris.", "The capital of France is Paris.", []),
    "json_answer": (' {"answer": 42}', ' {"answer": 42}', []),
    "call_then_text": (
        '{"type": "function", "name": "get_time", "parameters": {}}\nThat is all.',
        "That is all.",
        [_call("get_time", {})],
    ),
    "cut_inside": ('<|python_tag|>{"name": "get_weather", "param', '<|python_tag|>{"name": "get_weather", "param', []),
}


def _calls_of(entries: list[dict]) -> list[tuple[str, dict]]:
    return [(e["function"]["name"], json.loads(e["function"]["arguments"])) for e in entries]


def _chunks(text: str, rng: random.Random) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, 7)
        out.append(text[pos : pos + size])
        pos += size
    return out


CASES = [(HermesToolParser, name, *case) for name, case in HERMES_OUTPUTS.items()] + [
    (Llama3JsonToolParser, name, *case) for name, case in LLAMA_OUTPUTS.items()
]


@pytest.mark.parametrize(
    "parser_cls, name, output, content, calls", CASES, ids=[f"{c[0].__name__}-{c[1]}" for c in CASES]
)
def test_parser_on_recorded_output(parser_cls, name, output, content, calls):
    got_content, got_calls = parser_cls.parse(output)
    assert got_content == content
    assert _calls_of(got_calls) == calls
    for entry in got_calls:
        assert CALL_ID.match(entry["id"]) and entry["type"] == "function"
        assert set(entry) == {"id", "type", "function"}
    assert len({e["id"] for e in got_calls}) == len(got_calls)
    assert all(a["function"]["arguments"] == json.dumps(c[1], ensure_ascii=False) for a, c in zip(got_calls, calls))


@pytest.mark.parametrize(
    "parser_cls, name, output, content, calls", CASES, ids=[f"{c[0].__name__}-{c[1]}" for c in CASES]
)
@pytest.mark.parametrize("seed", range(8))
def test_streaming_matches_whole_parsing(parser_cls, name, output, content, calls, seed):
    whole_content, whole_calls = parser_cls.parse(output)
    parser = parser_cls()
    streamed, deltas = "", []
    for chunk in _chunks(output, random.Random(f"{name}-{seed}")):
        out = parser.feed(chunk)
        streamed += out.content
        deltas += out.calls
        # released content is never taken back: it is always the start of the final content
        assert whole_content.startswith(streamed), (streamed, whole_content)
        assert '<tool_call>\n{"name": "get' not in streamed or not calls
    out = parser.finish()
    streamed += out.content
    deltas += out.calls
    assert parser.finish().content == "" and not parser.finish().calls  # finish is once
    assert streamed == whole_content == content
    assert _calls_of(deltas) == _calls_of(whole_calls) == calls
    assert [d["index"] for d in deltas] == list(range(len(deltas)))
    assert all(CALL_ID.match(d["id"]) and d["type"] == "function" for d in deltas)
    assert parser.has_calls == bool(calls)
    assert [(c["id"], c["function"]) for c in parser.tool_calls] == [(d["id"], d["function"]) for d in deltas]


def test_a_possible_tag_is_held_back_until_it_is_decided():
    parser = HermesToolParser()
    assert parser.feed("Let me look. <to").content == "Let me look."
    assert parser.feed("ol_c").content == ""
    out = parser.feed('all>{"name": "get_time", "arguments": {}}</tool_call>')
    assert out.content == "" and _calls_of(out.calls) == [("get_time", {})]
    parser = HermesToolParser()
    assert parser.feed("I like <to").content == "I like"
    assert parser.feed("ols>").content == " <tools>"


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = plan_tools(TOOLS, "auto", parallel_tool_calls=False)
    assert plan is not None and plan.max_calls == 1
    output, _, calls = HERMES_OUTPUTS["qwen_parallel"]
    content, got = parse_tool_calls(plan, HermesToolParser, output)
    assert content is None and _calls_of(got) == calls[:1]
    parser = new_stream_parser(plan, HermesToolParser)
    deltas = parser.feed(output).calls + parser.finish().calls
    assert _calls_of(deltas) == calls[:1] and deltas[0]["index"] == 0


def test_parse_tool_calls_in_auto_mode():
    plan = plan_tools(TOOLS, None)
    output, content, calls = HERMES_OUTPUTS["qwen_leading_text"]
    got_content, got = parse_tool_calls(plan, HermesToolParser, output)
    assert got_content == content and _calls_of(got) == calls
    assert parse_tool_calls(plan, HermesToolParser, "Hello!") == ("Hello!", [])
    assert parse_tool_calls(None, HermesToolParser, "<tool_call>{}</tool_call>") == ("<tool_call>{}</tool_call>", [])
    assert parse_tool_calls(plan, Llama3JsonToolParser, LLAMA_OUTPUTS["bare_json"][0])[0] is None


def test_forced_named_call():
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert plan is not None
    calls = forced_tool_calls(plan, '{ "city" : "Zürich" }')
    assert len(calls) == 1 and CALL_ID.match(calls[0]["id"])
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Zürich"}'}
    cut = forced_tool_calls(plan, '{"city": "Zü')  # max_tokens cut it: kept as written, as vLLM does
    assert cut[0]["function"]["arguments"] == '{"city": "Zü'
    content, calls = parse_tool_calls(plan, HermesToolParser, '{"city": "Paris"}')
    assert content is None and _calls_of(calls) == [("get_weather", {"city": "Paris"})]
    parser = new_stream_parser(plan, HermesToolParser)
    assert isinstance(parser, ForcedToolParser)
    assert not parser.feed('{"city": ') and not parser.feed('"Paris"}')
    out = parser.finish()
    assert out.content == "" and _calls_of(out.calls) == [("get_weather", {"city": "Paris"})]
    assert out.calls[0]["index"] == 0 and parser.has_calls


def test_forced_required_calls():
    plan = plan_tools(TOOLS, "required")
    assert plan is not None
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    assert _calls_of(forced_tool_calls(plan, text)) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert forced_tool_calls(plan, '[{"name": "get_weather", "param') == []
    content, calls = parse_tool_calls(plan, HermesToolParser, '[{"name": "get_weather"')
    assert content == '[{"name": "get_weather"' and calls == []
    parser = new_stream_parser(plan, Llama3JsonToolParser)
    for chunk in _chunks(text, random.Random(0)):
        assert not parser.feed(chunk)
    out = parser.finish()
    assert [d["index"] for d in out.calls] == [0, 1] and out.content == ""
    single = plan_tools(TOOLS, "required", parallel_tool_calls=False)
    assert single is not None and len(forced_tool_calls(single, text)) == 1


def test_finish_reason_rule():
    """A call ended by "stop" reports "tool_calls", but a forced named function keeps "stop"
    (OpenAI's server does so); "length" and unfinished are kept."""
    auto = plan_tools(TOOLS, "auto")
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    required = plan_tools(TOOLS, "required")
    assert auto is not None and named is not None and required is not None
    calling = new_stream_parser(auto, HermesToolParser)
    calling.feed('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    calling.finish()
    silent = new_stream_parser(auto, HermesToolParser)
    silent.feed("no call")
    silent.finish()
    assert finish_reason_with_tools("stop", calling) == "tool_calls"
    assert finish_reason_with_tools("stop", silent) == "stop"
    assert finish_reason_with_tools("length", calling) == "length"
    assert finish_reason_with_tools(None, calling) is None
    for plan, expected in ((named, "stop"), (required, "tool_calls")):
        forced = new_stream_parser(plan, HermesToolParser)
        forced.feed("{}" if plan is named else '[{"name": "get_time", "parameters": {}}]')
        forced.finish()
        assert forced.has_calls and finish_reason_with_tools("stop", forced) == expected


def test_base_parser_is_abstract():
    with pytest.raises(NotImplementedError):
        StreamingToolParser().feed("x")
