"""Structured outputs in the engine (workers/engine/structured.py): greedy constrained output
equals transformers' greedy generate under XGrammar's own logits processor, token for token;
the same output whether the first token was sampled elsewhere (disaggregation) or the stream
resumes mid-way (migration); every kind of constraint holds; a spec that is no grammar is
refused by name."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from tests.conftest import chat_prompt_ids
from tests.unit.engine_helpers import hf_model
from workers.engine import LLMEngine, SamplingParams
from workers.engine.structured import GrammarError, check_spec

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
}
SCHEMA = ("json_schema", json.dumps(PERSON))
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return LLMEngine(smollm2_dir, load_progress=False, num_kv_blocks=128)


def _prompt(model_dir: str, question: str) -> list[int]:
    return chat_prompt_ids(model_dir, question)


def _hf_constrained(model_dir: str, prompt: list[int], structured: tuple[str, str], max_new: int) -> list[int]:
    """transformers' greedy generate with XGrammar's Hugging Face logits processor: the
    reference for what a constrained greedy decode must produce."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = hf_model(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    compiler = xgr.GrammarCompiler(info)
    kind, spec = structured
    if kind == "json_schema":
        compiled = compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
    else:
        compiled = compiler.compile_regex(spec)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)],
        )
    return out[0, len(prompt) :].tolist()


QUESTIONS = (
    "Describe a fictional person as JSON.",
    "Give me a JSON record for a retired teacher who loves gardening.",
)


@pytest.mark.parametrize("question", QUESTIONS)
def test_constrained_greedy_equals_transformers_with_the_same_grammar(engine, smollm2_dir, question):
    prompt = _prompt(smollm2_dir, question)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured=SCHEMA)
    (out,) = engine.generate([prompt], params)
    expected = _hf_constrained(smollm2_dir, prompt, SCHEMA, MAX_TOKENS)
    assert out.token_ids == expected
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    assert set(value) == set(PERSON["properties"]) and value["city"] in ("Paris", "London", "Tokyo")
    assert 0 <= value["age"] <= 120
    engine.check_idle()


def test_the_unconstrained_answer_is_not_json(engine, smollm2_dir):
    """The constraint does the work: without it the same prompt answers in prose."""
    prompt = _prompt(smollm2_dir, QUESTIONS[0])
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_first_token_sampled_elsewhere_and_a_resumed_stream_give_the_same_tokens(engine, smollm2_dir):
    """Disaggregation (a prefill engine samples the first token; the decode side continues from
    it) and migration (the stream resumes after k tokens, which end the prompt) both rebuild
    the matcher from the tokens generated so far: the output is the uninterrupted one."""
    prompt = _prompt(smollm2_dir, QUESTIONS[1])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured=SCHEMA)
    (whole,) = engine.generate([prompt], params)

    first = engine.generate([prompt], replace(params, max_tokens=1))[0].token_ids
    assert first == whole.token_ids[:1]
    engine.add_request("continued", prompt, params, first_token_id=first[0])
    tokens = _run(engine, "continued")
    assert tokens == whole.token_ids

    for k in (5, 17):
        done = whole.token_ids[:k]
        resumed = replace(params, max_tokens=MAX_TOKENS - k, output_position_offset=k)
        engine.add_request(f"resumed-{k}", prompt + done, resumed)
        assert done + _run(engine, f"resumed-{k}") == whole.token_ids
    engine.check_idle()


def _run(engine: LLMEngine, request_id: str) -> list[int]:
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return list(output.token_ids)


def test_regex_choice_grammar_and_json_object_hold_in_one_batch_with_sampling(engine, smollm2_dir):
    """Four kinds of constraint in one batch, two of them sampled at temperature 1 (seeded),
    beside an unconstrained row: each output follows its own grammar."""
    prompt = _prompt(smollm2_dir, "Answer briefly: what is the capital of France?")
    cases = {
        "regex": (("regex", r"[A-Z][a-z]{2,8}, [0-9]{4}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}, [0-9]{4}", t)),
        "choice": (
            ("choice", json.dumps(["Paris", "Lyon", "Marseille"])),
            lambda t: t in ("Paris", "Lyon", "Marseille"),
        ),
        "grammar": (
            ("grammar", 'root ::= "The answer is " ("yes" | "no") "."'),
            lambda t: t in ("The answer is yes.", "The answer is no."),
        ),
        "json_object": (("json_object", ""), lambda t: isinstance(json.loads(t), dict)),
    }
    params = []
    for i, (structured, _) in enumerate(cases.values()):
        temperature = 1.0 if i % 2 else 0.0
        params.append(SamplingParams(max_tokens=48, temperature=temperature, seed=7, structured=structured))
    params.append(SamplingParams(max_tokens=8, temperature=0.0))
    outs = engine.generate([prompt] * len(params), params)
    for (name, (_, valid)), out in zip(cases.items(), outs):
        assert out.finish_reason == "stop", (name, out.text)
        assert valid(out.text), (name, out.text)
    engine.check_idle()


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", '{"type": "nope"}', "Unsupported type"),
        ("json_schema", "{not json", "Failed to parse JSON"),
        ("regex", "[a-", "Unclosed"),
        ("grammar", "root ::= missing", "missing"),
        ("choice", "[]", "non-empty"),
        ("choice", '"yes"', "list"),
        ("yaml", "a: 1", "unknown constraint kind"),
    ],
)
def test_a_spec_that_is_no_grammar_is_refused_with_the_reason(kind, spec, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        check_spec(kind, spec)


def test_the_engine_refuses_a_bad_grammar_at_add_request_and_keeps_nothing(engine, smollm2_dir):
    prompt = _prompt(smollm2_dir, QUESTIONS[0])
    with pytest.raises(GrammarError):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=4, structured=("regex", "(")))
    engine.check_idle()
