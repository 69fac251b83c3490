"""OpenAI tool calling, as vLLM serves it: request models, the plan of a request's tools
(validation and the output constraint of the forced modes), rendering of tool messages for
chat templates, and parsers of the model's own tool-call formats (streaming and not).

Three modes, by ``tool_choice`` (``plan_tools``):

- ``"auto"`` (the default when tools are given): the model writes freely; its output is parsed
  for calls in its own format (``choose_parser``: Hermes ``<tool_call>`` tags or Llama 3.1's
  JSON). Text outside calls is the message's content.
- ``"required"``: the output is forced (``ToolPlan.constraint``, a JSON schema) to be a JSON
  array of ``{"name", "parameters"}`` objects, one per call; ``forced_tool_calls`` reads it.
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is forced
  to be that function's arguments object.
- ``"none"``: no plan; tools are neither rendered into the prompt nor parsed.

The ingress's part (``chat_template_inputs``, ``new_stream_parser``, ``parse_tool_calls`` and
``finish_reason_with_tools``):

1. ``plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)``;
2. ``messages, tools = chat_template_inputs(tokenizer, body_messages, plan)``, then
   ``tokenizer.apply_chat_template(messages, tools=tools, ...)``; ``plan.constraint`` goes to the
   engine as the request's structured-output constraint;
3. per choice, ``parser = new_stream_parser(plan, parser_cls)`` (``parser_cls =
   choose_parser(tokenizer)``, once) fed each text delta, ``finish()`` at the end; or, without
   streaming, ``parse_tool_calls(plan, parser_cls, text)``;
4. ``finish_reason_with_tools(finish_reason, parser.has_calls)``.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from deploy.api.openai_protocol import RequestError

FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ToolMode = Literal["named", "required", "auto"]


# ------------------------------------------------------------------ request models
class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME_PATTERN, description="a-z, A-Z, 0-9, _ and -; at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description='a JSON schema of the arguments; absent: {"type": "object", "properties": {}}'
    )
    strict: bool | None = None

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else copy.deepcopy(EMPTY_PARAMETERS)


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    """A call in an assistant message of the request: ``arguments`` is a JSON string."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"]
    function: ToolCallFunction


_TOOLS = TypeAdapter(list[ToolDefinition])
_TOOL_CHOICE: TypeAdapter[ToolChoice] = TypeAdapter(ToolChoice)


# ------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its output constraint and its parsing."""

    mode: ToolMode
    # (kind, spec) for the engine's structured outputs; None in "auto" mode
    constraint: tuple[str, str] | None
    # for tokenizer.apply_chat_template(..., tools=...): {"type": "function", "function": {...}}
    template_tools: list[dict[str, Any]]
    tool_names: tuple[str, ...]
    function_name: str | None = None  # "named" mode: the function forced
    parallel_tool_calls: bool = True

    @property
    def max_calls(self) -> int | None:
        """At most one call when ``parallel_tool_calls`` is false (vLLM keeps the first)."""
        return None if self.parallel_tool_calls else 1


def _request_error(exc: ValidationError, param: str) -> RequestError:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return RequestError(f"invalid {param}{'.' + where if where else ''}: {first['msg']}", param)


def _hoisted_defs(schemas: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pop the ``$defs`` / ``definitions`` of each tool's parameters (their ``$ref``s point at
    the document's root, which is no longer theirs inside the array schema): the root's."""
    hoisted: dict[str, dict[str, Any]] = {}
    for schema in schemas:
        for key in ("$defs", "definitions"):
            defs = schema.pop(key, None)
            if not defs:
                continue
            if not isinstance(defs, dict):
                raise RequestError(f"tools: {key} must be an object", "tools")
            into = hoisted.setdefault(key, {})
            for name, definition in defs.items():
                if name in into and into[name] != definition:
                    raise RequestError(
                        f"tools: the definition {key}/{name} differs between tools; "
                        'tool_choice "required" needs one schema per name',
                        "tools",
                    )
                into[name] = definition
        schema.pop("$schema", None)  # only at a document's root
    return hoisted


def required_schema(functions: Sequence[FunctionDefinition], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``'s output: an array of calls, each
    ``{"name": <a tool's name>, "parameters": <that tool's arguments>}``."""
    parameters = [copy.deepcopy(f.parameters_schema) for f in functions]
    hoisted = _hoisted_defs(parameters)
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "const": f.name}, "parameters": params},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for f, params in zip(functions, parameters)
            ],
        },
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update(hoisted)
    return schema


def _template_tool(tool: ToolDefinition) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = tool.function.parameters_schema
    return {"type": "function", "function": function}


def plan_tools(
    tools: Sequence[ToolDefinition | Mapping[str, Any]] | None,
    tool_choice: ToolChoice | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = True,
) -> ToolPlan | None:
    """The plan of a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; None when
    there are no tools (None or ``[]``) or ``tool_choice`` is ``"none"``.

    Raises ``RequestError`` (400) naming ``tool_choice`` (given without tools; a named function
    that is not among the tools) or ``tools`` (duplicate names; ``parameters`` that is no valid
    JSON schema; a malformed definition)."""
    # jsonschema: a dependency of Ray's (no type stubs here, hence the import by name)
    validators: Any = importlib.import_module("jsonschema.validators")
    schema_error: type[Exception] = importlib.import_module("jsonschema.exceptions").SchemaError
    try:
        definitions = _TOOLS.validate_python(list(tools or []))
    except ValidationError as exc:
        raise _request_error(exc, "tools") from exc
    try:
        choice = _TOOL_CHOICE.validate_python(tool_choice) if tool_choice is not None else None
    except ValidationError as exc:
        raise _request_error(exc, "tool_choice") from exc
    if not definitions:
        if choice is not None:
            raise RequestError("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    names = [t.function.name for t in definitions]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RequestError(f"tools: duplicate function names {duplicates}", "tools")
    for tool in definitions:
        schema = tool.function.parameters
        if schema is None:
            continue
        try:
            validators.validator_for(schema).check_schema(schema)
        except schema_error as exc:
            message = getattr(exc, "message", str(exc))
            raise RequestError(
                f"tools: the parameters of {tool.function.name!r} are not a valid JSON schema: {message}", "tools"
            ) from exc
    choice = choice if choice is not None else "auto"
    if choice == "none":
        return None
    parallel = parallel_tool_calls is not False
    template_tools = [_template_tool(t) for t in definitions]
    by_name = {t.function.name: t.function for t in definitions}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in by_name:
            raise RequestError(f"tool_choice: the function {name!r} is not among the tools {names}", "tool_choice")
        constraint = ("json_schema", json.dumps(by_name[name].parameters_schema))
        return ToolPlan("named", constraint, template_tools, tuple(names), name, parallel)
    if choice == "required":
        schema = required_schema([t.function for t in definitions], parallel)
        return ToolPlan("required", ("json_schema", json.dumps(schema)), template_tools, tuple(names), None, parallel)
    return ToolPlan("auto", None, template_tools, tuple(names), None, parallel)


# ----------------------------------------------------------------------- rendering
def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        part = part.model_dump() if isinstance(part, BaseModel) else part
        if part.get("type") != "text":
            raise RequestError(f"unsupported content part type {part.get('type')!r}", "messages")
        parts.append(part.get("text") or "")
    return "".join(parts)


def _arguments_object(arguments: Any, where: str) -> Any:
    if not isinstance(arguments, str):
        return arguments  # already an object (a client that sends one)
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise RequestError(f"{where}: function.arguments is not valid JSON: {exc}", "messages") from exc


def render_messages(messages: Sequence[Mapping[str, Any] | BaseModel]) -> list[dict[str, Any]]:
    """The request's messages as Hugging Face chat templates take them: ``developer`` becomes
    ``system``; content is text ("" for none: templates concatenate it); an assistant's
    ``tool_calls`` keep ``id``/``type`` and get ``function.arguments`` as an object (parsed from
    the JSON string; RequestError "messages" when it is not JSON); a ``tool`` message keeps
    ``tool_call_id`` (and ``name``)."""
    rendered: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        m = message.model_dump(exclude_none=True) if isinstance(message, BaseModel) else dict(message)
        role = m.get("role")
        out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _text_of(m.get("content"))}
        if m.get("name") is not None:
            out["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                call = call.model_dump() if isinstance(call, BaseModel) else call
                function = call.get("function") or {}
                entry: dict[str, Any] = {
                    "type": "function",
                    "function": {
                        "name": function.get("name"),
                        "arguments": _arguments_object(function.get("arguments"), f"messages[{i}].tool_calls[{j}]"),
                    },
                }
                if call.get("id") is not None:
                    entry["id"] = call["id"]
                calls.append(entry)
            out["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id") is not None:
            out["tool_call_id"] = m["tool_call_id"]
        rendered.append(out)
    return rendered


def _template_texts(tokenizer) -> list[str]:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return [template]
    if isinstance(template, Mapping):  # named templates ("default", "tool_use", ...)
        return [t for t in template.values() if isinstance(t, str)]
    return []


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (refers to the variable)."""
    return any(re.search(r"\btools\b", text) for text in _template_texts(tokenizer))


def tool_system_prompt(template_tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes-style tools preamble, as Qwen2.5's chat template writes it."""
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in template_tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    body = json.dumps({"name": function.get("name"), "arguments": function.get("arguments")}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def flatten_tool_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rendered messages (``render_messages``) for a template that knows no tools, as text, the
    way Qwen2.5's template writes them: an assistant's calls become ``<tool_call>`` blocks after
    its content; a run of ``tool`` messages becomes one user message of ``<tool_response>``
    blocks."""
    flat: list[dict[str, Any]] = []
    responses: list[str] = []

    def close_responses() -> None:
        if responses:
            flat.append({"role": "user", "content": "\n".join(responses)})
            responses.clear()

    for m in messages:
        if m["role"] == "tool":
            responses.append(f"<tool_response>\n{m.get('content') or ''}\n</tool_response>")
            continue
        close_responses()
        out = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            parts += [_call_text(call) for call in m["tool_calls"]]
            out["content"] = "\n".join(parts)
        flat.append(out)
    close_responses()
    return flat


def with_tool_prompt(
    messages: Sequence[Mapping[str, Any]], template_tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """For a template that knows no tools: ``flatten_tool_messages``, with the tools preamble
    (``tool_system_prompt``) prepended to the first message when it is a system message (a
    blank line between), else as a new first system message."""
    flat = flatten_tool_messages(messages)
    preamble = tool_system_prompt(template_tools)
    if flat and flat[0]["role"] == "system":
        existing = flat[0].get("content") or ""
        flat[0] = {**flat[0], "content": f"{preamble}\n\n{existing}" if existing else preamble}
    else:
        flat.insert(0, {"role": "system", "content": preamble})
    return flat


def chat_template_inputs(
    tokenizer, messages: Sequence[Mapping[str, Any] | BaseModel], plan: ToolPlan | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` for ``tokenizer.apply_chat_template(messages, tools=tools, ...)``:
    a template that renders tools gets them (and structured tool messages); any other gets the
    tools preamble in its system message and tool messages as text (``with_tool_prompt``)."""
    rendered = render_messages(messages)
    if template_supports_tools(tokenizer):
        return rendered, (plan.template_tools if plan is not None else None)
    if plan is not None:
        return with_tool_prompt(rendered, plan.template_tools), None
    return flatten_tool_messages(rendered), None


# ------------------------------------------------------------------------- parsers
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def message_tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """An OpenAI message ``tool_calls`` entry."""
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_of(obj: Any, arguments_keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """``(name, arguments object)`` of a parsed call object, or None if it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments: Any = {}
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, arguments


@dataclass
class ToolDeltas:
    """What one ``feed``/``finish`` releases: text for ``delta.content`` and OpenAI streaming
    ``delta.tool_calls`` entries (each call whole: index, id, type, name and arguments)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class StreamingToolParser:
    """One choice's parser: ``feed`` each text delta, ``finish`` once at the end. Text that may
    still become part of a call is held back; content already released is never retracted.
    ``max_calls`` (1 when ``parallel_tool_calls`` is false): later calls are dropped."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.tool_calls: list[dict[str, Any]] = []  # message entries, in order
        self.finished = False
        self._buf = ""  # text fed and not yet released

    @property
    def has_calls(self) -> bool:
        return bool(self.tool_calls)

    def feed(self, text: str) -> ToolDeltas:
        out = ToolDeltas()
        self._buf += text
        self._advance(out, final=False)
        return out

    def finish(self) -> ToolDeltas:
        out = ToolDeltas()
        if not self.finished:
            self.finished = True
            self._advance(out, final=True)
        return out

    def _advance(self, out: ToolDeltas, final: bool) -> None:
        """Release from ``_buf`` what is decided (``final``: everything)."""
        raise NotImplementedError

    def _emit_call(self, out: ToolDeltas, name: str, arguments: str) -> None:
        if self.max_calls is not None and len(self.tool_calls) >= self.max_calls:
            return
        call = message_tool_call(name, arguments)
        out.calls.append({"index": len(self.tool_calls), **call, "function": dict(call["function"])})
        self.tool_calls.append(call)

    @classmethod
    def parse(cls, text: str, max_calls: int | None = None) -> tuple[str, list[dict[str, Any]]]:
        """Non-streaming: ``(content, message tool_calls)`` of a whole output."""
        parser = cls(max_calls)
        first, last = parser.feed(text), parser.finish()
        return first.content + last.content, parser.tool_calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(StreamingToolParser):
    """Hermes calls (Qwen2.5/3, SmolLM2-style, our fallback prompt): any number of
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (a JSON list of such
    objects inside one block is several calls). Text outside the blocks is content, less the
    whitespace that only separates it from a call; a block whose body is no call (invalid JSON,
    no name) stays content as written; an unterminated block at the end is a call when its body
    parses."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._buf = ""  # undecided text: a possible tag's beginning, or a call's body
        self._in_call = False
        self._ws = ""  # whitespace after the last released content (dropped if a call follows)
        self._after_call = False  # dropping whitespace after a call

    def _advance(self, out: ToolDeltas, final: bool) -> None:
        while True:
            if self._in_call:
                end = self._buf.find(self.END)
                if end < 0:
                    if final:
                        body, self._buf, self._in_call = self._buf, "", False
                        self._close(out, body, terminated=False)
                    return
                body, self._buf, self._in_call = self._buf[:end], self._buf[end + len(self.END) :], False
                self._close(out, body, terminated=True)
                continue
            start = self._buf.find(self.START)
            if start >= 0:
                self._text(out, self._buf[:start])
                self._buf, self._in_call = self._buf[start + len(self.START) :], True
                continue
            keep = 0 if final else _partial_suffix(self._buf, self.START)
            self._text(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            if final:
                out.content += self._ws
                self._ws = ""
            return

    def _text(self, out: ToolDeltas, text: str) -> None:
        """Release text outside calls, holding its trailing whitespace back."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        stripped = text.rstrip()
        if stripped:
            out.content += self._ws + stripped
            self._ws = text[len(stripped) :]
        else:
            self._ws += text

    def _close(self, out: ToolDeltas, body: str, terminated: bool) -> None:
        calls = self._calls_in(body)
        if calls is None:
            self._text(out, self.START + body + (self.END if terminated else ""))
            return
        self._ws = ""
        self._after_call = True
        for name, arguments in calls:
            self._emit_call(out, name, _dumps(arguments))

    @staticmethod
    def _calls_in(body: str) -> list[tuple[str, Any]] | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        objs = obj if isinstance(obj, list) and obj else [obj]
        calls = [_call_of(o, ("arguments", "parameters")) for o in objs]
        if any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]


def _json_object_end(text: str, pos: int) -> int | None:
    """The index after the ``}`` that closes the object opening at ``text[pos]``, or None when
    the text ends first (strings and escapes respected; validity is json.loads's to judge)."""
    depth, in_string, escaped = 0, False, False
    for i in range(pos, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class Llama3JsonToolParser(StreamingToolParser):
    """Llama 3.1/3.2's JSON calls: the whole output is ``{"name": ..., "parameters": {...}}``
    (or ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``.

    An output that does not begin (after whitespace) with ``{`` or ``<|python_tag|>`` is plain
    content, released as it comes; one that does is held back while its objects complete, each
    released as a call; if the first object is no call, the whole output is content; text after
    the last call that is no further call is content."""

    TAG = "<|python_tag|>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._buf = ""
        self._state: Literal["start", "calls", "text"] = "start"
        self._pos = 0  # "calls": where the next call may begin
        self._found = 0  # call objects parsed (the ones max_calls dropped included)

    def _to_text(self, out: ToolDeltas, start: int) -> None:
        self._state = "text"
        out.content += self._buf[start:]
        self._buf = ""

    def _advance(self, out: ToolDeltas, final: bool) -> None:
        if self._state == "text":
            out.content += self._buf
            self._buf = ""
            return
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(self.TAG) or head.startswith("{"):
                self._state, self._pos = "calls", len(self._buf) - len(head)
            elif not final and (not head or self.TAG.startswith(head)):
                return
            else:
                self._to_text(out, 0)
                return
        buf = self._buf
        while True:
            pos = self._pos
            while pos < len(buf) and (buf[pos].isspace() or (buf[pos] == ";" and self._found)):
                pos += 1
            if pos == len(buf):
                if final:
                    self._buf = ""
                    if not self._found:  # nothing but whitespace after the tag
                        out.content += buf
                return
            if buf.startswith(self.TAG, pos):
                self._pos = pos + len(self.TAG)
                continue
            if not final and self.TAG.startswith(buf[pos:]):
                return
            end = _json_object_end(buf, pos) if buf[pos] == "{" else -1
            if end is None and not final:
                return
            call = None
            if end is not None and end > 0:
                try:
                    call = _call_of(json.loads(buf[pos:end]), ("parameters", "arguments"))
                except json.JSONDecodeError:
                    call = None
            if call is None or end is None:
                self._to_text(out, pos if self._found else 0)
                return
            self._found += 1
            self._emit_call(out, call[0], _dumps(call[1]))
            self._pos = end


class ForcedToolParser(StreamingToolParser):
    """The "named" and "required" modes: the output is held and read whole at the end
    (``forced_tool_calls``); if it yields no call, it is content."""

    def __init__(self, plan: ToolPlan) -> None:
        super().__init__(plan.max_calls)
        self.plan = plan
        self._text = ""

    def feed(self, text: str) -> ToolDeltas:
        self._text += text
        return ToolDeltas()

    def finish(self) -> ToolDeltas:
        out = ToolDeltas()
        if self.finished:
            return out
        self.finished = True
        calls = forced_tool_calls(self.plan, self._text)
        if not calls:
            out.content = self._text
        for call in calls:
            self._emit_call(out, call["function"]["name"], call["function"]["arguments"])
        return out


def choose_parser(tokenizer) -> type[StreamingToolParser]:
    """The parser of the model's own call format, by its chat template: ``<tool_call>``: Hermes;
    ``<|python_tag|>``, ``ipython`` or ``"parameters"``: Llama 3 JSON; else (our fallback
    prompt asks for Hermes) Hermes."""
    texts = _template_texts(tokenizer) if template_supports_tools(tokenizer) else []
    if any("<tool_call>" in t for t in texts):
        return HermesToolParser
    if any("<|python_tag|>" in t or "ipython" in t or '"parameters"' in t for t in texts):
        return Llama3JsonToolParser
    return HermesToolParser


def new_stream_parser(plan: ToolPlan, parser_cls: type[StreamingToolParser]) -> StreamingToolParser:
    """A choice's parser: ``parser_cls`` in "auto" mode, ``ForcedToolParser`` in the others."""
    if plan.mode == "auto":
        return parser_cls(plan.max_calls)
    return ForcedToolParser(plan)


def forced_tool_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]]:
    """The calls of a "named" or "required" output (message ``tool_calls`` entries).

    named: the text is the arguments object: one call of the plan's function (if the text is
    no JSON, e.g. cut by max_tokens, the call carries it as written, as vLLM does). required:
    the text is the array of ``{"name", "parameters"}``: one call each; [] if it is not one."""
    if plan.mode == "named":
        assert plan.function_name is not None
        try:
            arguments = _dumps(json.loads(text))
        except json.JSONDecodeError:
            arguments = text
        return [message_tool_call(plan.function_name, arguments)]
    if plan.mode != "required":
        raise ValueError(f"forced_tool_calls: mode {plan.mode!r} is not forced")
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(items, list):
        return []
    calls = [_call_of(item, ("parameters",)) for item in items]
    if any(c is None for c in calls):
        return []
    found = [message_tool_call(c[0], _dumps(c[1])) for c in calls if c is not None]
    return found[: plan.max_calls] if plan.max_calls is not None else found


def parse_tool_calls(
    plan: ToolPlan | None, parser: type[StreamingToolParser], text: str
) -> tuple[str | None, list[dict[str, Any]]]:
    """Non-streaming: ``(content, tool_calls)`` of a whole output: the message's ``content``
    (None when there are calls and no other text) and its ``tool_calls`` entries."""
    if plan is None:
        return text, []
    if plan.mode == "auto":
        content, calls = parser.parse(text, plan.max_calls)
    else:
        calls = forced_tool_calls(plan, text)
        content = "" if calls else text
    return (content or None) if calls else content, calls


def finish_reason_with_tools(finish_reason: str | None, parser: StreamingToolParser) -> str | None:
    """The finish_reason to report: a choice that produced at least one tool call and ended by
    "stop" (EOS, a stop token or string) reports ``"tool_calls"``; any other ("length", ...) is
    kept. As OpenAI's server does, a forced named function keeps "stop"."""
    named = isinstance(parser, ForcedToolParser) and parser.plan.mode == "named"
    if parser.has_calls and finish_reason == "stop" and not named:
        return "tool_calls"
    return finish_reason
