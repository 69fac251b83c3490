"""Structured decoding's cost: output tokens a second with a JSON schema against the same
requests unconstrained, in one engine (SmolLM2 by default), at each ``--concurrency``.

Each round runs the constrained batch first (``--concurrency`` chat prompts, all asking for the
schema's JSON, greedy), then the unconstrained batch with each request's ``max_tokens`` set to
the length its constrained answer had and ``ignore_eos``: both batches produce the same number
of tokens per request, so their rates compare the grammar's work alone (compile, mask fill and
apply, matcher advance). The grammars are compiled before the first round (a server compiles
each schema once). Rounds alternate; the table gives each side's median rate and their ratio.

    .venv/bin/python bench/structured.py --concurrency 1 8 --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine import LLMEngine, SamplingParams  # noqa: E402
from workers.models.source import resolve_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "skills", "employed"],
    "additionalProperties": False,
}
TOPICS = ("a pilot", "a baker", "a student", "a painter", "a nurse", "a farmer", "a coder", "a judge")


def _prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        messages = [
            {"role": "system", "content": "You answer with JSON only."},
            {"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as JSON."},
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def _rate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    return sum(len(o.token_ids) for o in outs) / seconds, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a model directory, a .gguf file or smollm2")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(str(resolve_model(args.model)), load_progress=False, num_kv_blocks=512)
    structured = ("json_schema", json.dumps(SCHEMA))
    engine.compile_grammar(SamplingParams(structured=structured))
    rows = []
    for concurrency in args.concurrency:
        prompts = _prompts(engine.tokenizer, concurrency)
        constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=structured)] * concurrency
        _rate(engine, prompts, constrained)  # warm-up: first steps at this batch size
        with_schema, without = [], []
        valid = True
        for _ in range(args.rounds):
            rate, outs = _rate(engine, prompts, constrained)
            with_schema.append(rate)
            for out in outs:
                try:
                    json.loads(out.text)
                except json.JSONDecodeError:
                    valid = False
            free = [SamplingParams(max_tokens=len(o.token_ids), temperature=0.0, ignore_eos=True) for o in outs]
            without.append(_rate(engine, prompts, free)[0])
        a, b = statistics.median(with_schema), statistics.median(without)
        tokens = sum(len(o.token_ids) for o in outs) / concurrency
        rows.append((concurrency, tokens, a, b, a / b, valid))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"machine: {cpu}, {torch.get_num_threads()} torch threads, {platform.python_version()}")
    print(f"date: {datetime.date.today()}; command: {shlex.join(sys.argv)}")
    print("| concurrency | tokens / request | JSON schema tok/s | unconstrained tok/s | ratio | all valid JSON |")
    print("|---:|---:|---:|---:|---:|---|")
    for concurrency, tokens, a, b, ratio, valid in rows:
        print(f"| {concurrency} | {tokens:.0f} | {a:.1f} | {b:.1f} | {ratio:.3f} | {'yes' if valid else 'NO'} |")


if __name__ == "__main__":
    main()
