"""XGrammar vs LLGuidance: per-decode-step grammar mask cost on SmolLM2's 49,152-token vocabulary.

For each engine this builds its tokenizer info once, compiles four JSON schemas (pdserve's
settings: XGrammar ``any_whitespace=False, strict_mode=True``; LLGuidance configured to the same
compact JSON: ``", "``/``": "`` separators, ``whitespace_flexible: false``), then replays a fixed
valid token stream per schema (a hand-written instance, HF-tokenized, plus EOS) through a batch of
B matchers (row i on schema i mod 4, rows staggered, a finished row restarts). Per step it times
filling the whole batch's bitmask (XGrammar ``BatchGrammarMatcher.batch_fill_next_token_bitmask``,
LLGuidance ``fill_next_token_bitmask_par``), applying it to [B, 49152] float32 CPU logits, and
accepting every row's token; it asserts every replayed token is allowed and accepted. Repeats
interleave the engines (a noisy neighbour hits both alike). --threads sizes both engines' pools
and torch's (default min(8, cores), as pdserve). A batch-1 pass compares the masks token for token.

    python bench/grammar_engines.py --batches 1 32 --repeats 3 [--tokens 64] [--threads 1] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 49152
LLG_JSON = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
COUNTS = ("count_differs", "set_differs", "llg_subset", "forced", "extras", "other")
STEP_PARTS = ("fill", "apply", "accept", "total")
_S, _I, _N = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def _obj(props: dict, required: list) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


ZIP = {"type": "string", "pattern": "^[0-9]{5}$"}
ADDRESS = _obj({"street": _S, "city": _S, "zip": ZIP}, ["street", "city", "zip"])
ROLE = {"type": "string", "enum": ["admin", "editor", "viewer"]}
TAGS = {"type": "array", "items": _S, "maxItems": 5}
PERSON = {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "email": _S, "role": ROLE}
ITEM = _obj({"sku": _S, "qty": {"type": "integer", "minimum": 1, "maximum": 99}, "price": _N}, ["sku", "qty", "price"])
ITEMS = {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 10}
FLAT = ["title", "author", "publisher", "isbn"]
UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER = {"location": _S, "unit": UNIT, "days": {"type": "integer", "minimum": 1, "maximum": 14}}
# name -> (schema, a valid instance; key order follows the schema, as both engines require)
SCHEMAS = {
    "person": (
        _obj({**PERSON, "tags": TAGS, "address": ADDRESS}, ["name", "age", "role", "tags", "address"]),
        {"name": "Ada Lovelace", "age": 36, "role": "editor", "tags": ["math", "poetry"],
         "address": {"street": "12 St James's Square", "city": "London", "zip": "10115"}},
    ),
    "order": (
        _obj({"order_id": _S, "customer": _S, "items": ITEMS, "total": _N, "paid": {"type": "boolean"}},
             ["order_id", "customer", "items", "total", "paid"]),
        {"order_id": "A-1042", "customer": "Grace Hopper",
         "items": [{"sku": "KB-01", "qty": 1, "price": 29.5}, {"sku": "MS-7", "qty": 2, "price": 6.0}],
         "total": 41.5, "paid": True},
    ),
    "flat8": (
        _obj({**{k: _S for k in FLAT}, "year": _I, "pages": _I, "price": _N, "rating": _N},
             [*FLAT, "year", "pages", "price", "rating"]),
        {"title": "Dune", "author": "Frank Herbert", "publisher": "Chilton Books", "isbn": "978-0441013593",
         "year": 1965, "pages": 412, "price": 9.99, "rating": 4.6},
    ),
    "tool_call": (
        _obj({"name": {"enum": ["get_weather", "get_time"]}, "arguments": _obj(WEATHER, ["location", "unit"])},
             ["name", "arguments"]),
        {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius", "days": 3}},
    ),
}  # fmt: skip


class XGrammar:
    """pdserve's calls (workers/engine/structured.py); ``compile`` precomputes token masks, cached by schema."""

    name = "xgrammar"

    def __init__(self, tok, eos: int, threads: int) -> None:
        import xgrammar as xgr

        self.setup_ms, info = _ms(xgr.TokenizerInfo.from_huggingface, tok, vocab_size=VOCAB, stop_token_ids=[eos])
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.compile = lambda s: compiler.compile_json_schema(json.dumps(s), any_whitespace=False, strict_mode=True)
        self.matcher = xgr.GrammarMatcher
        self.fill = batch.batch_fill_next_token_bitmask
        self.apply = lambda logits, bitmask: xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=VOCAB)
        self.accept = lambda m, token: m.accept_token(token)


class PdServe(XGrammar):
    """What pdserve runs: XGrammar's masks, applied by the CPU backend's op (a C++ kernel that skips
    the words allowing every token: workers/backends/cpu/csrc/fused_bitmask.cpp)."""

    name = "pdserve"

    def __init__(self, tok, eos: int, threads: int) -> None:
        super().__init__(tok, eos, threads)
        from workers.backends.cpu.backend import CPUOps

        ops = CPUOps()
        self.apply = lambda logits, bitmask: ops.apply_token_bitmask(logits, bitmask, list(range(len(logits))), VOCAB)


class LLGuidance:
    """LLGuidance 1.9: no compiled-grammar cache (``compile`` returns the grammar string; every
    ``LLMatcher`` builds its parser from it); batch fill on an ``LLExecutor`` thread pool."""

    name = "llguidance"

    def __init__(self, tok, eos: int, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        self.setup_ms, self.tok = _ms(llguidance.hf.from_tokenizer, tok, VOCAB, eos)
        executor = llguidance.LLExecutor(num_threads=threads)
        self.new = llguidance.LLMatcher
        self.fill = lambda ms, bitmask: lt.fill_next_token_bitmask_par(executor, list(zip(ms, range(len(ms)))), bitmask)
        self.apply = lt.apply_token_bitmask_inplace  # a torch.compile'd kernel (warmed up before timing)
        self.accept = lambda m, token: m.consume_token(token)

    def compile(self, schema: dict) -> str:
        grammar = self.new.grammar_from_json_schema(schema, overrides=LLG_JSON)
        self.matcher(grammar)
        return grammar

    def matcher(self, grammar: str):
        m = self.new(self.tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m


def _ms(fn, *args, **kw) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return (time.perf_counter() - t0) * 1e3, out


def _bits(bitmask: torch.Tensor) -> np.ndarray:
    return np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little").astype(bool)


def run_repeat(eng, compiled: dict, streams: dict, batch: int, steps: int, times: dict) -> None:
    """One repeat: fresh matchers, ``steps`` decode steps; appends per-step ns to ``times``."""
    names = list(streams)
    rows = [names[i % len(names)] for i in range(batch)]
    bitmask = torch.full((batch, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    base, logits, arange = torch.randn(batch, VOCAB), torch.empty(batch, VOCAB), torch.arange(batch)
    ms = [eng.matcher(compiled[n]) for n in rows]
    pos = [(i // len(names)) * 3 % (len(streams[n]) - 1) for i, n in enumerate(rows)]  # stagger rows
    for m, n, p in zip(ms, rows, pos):
        assert all(eng.accept(m, t) for t in streams[n][:p])
    for _ in range(steps):
        toks = [streams[n][p] for n, p in zip(rows, pos)]
        logits.copy_(base)
        t0 = time.perf_counter_ns()
        eng.fill(ms, bitmask)
        t1 = time.perf_counter_ns()
        eng.apply(logits, bitmask)
        t2 = time.perf_counter_ns()
        ok = [eng.accept(m, t) for m, t in zip(ms, toks)]
        t3 = time.perf_counter_ns()
        assert all(ok), f"{eng.name} rejected a replayed token: {list(zip(rows, pos, toks, ok))}"
        tt = torch.tensor(toks)  # the replayed token's bit is set and its logit survived the apply
        assert ((bitmask[arange, tt >> 5] >> (tt & 31)) & 1).all(), f"{eng.name} mask disallows a replayed token"
        assert torch.isfinite(logits[arange, tt]).all()
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[k].append(dt)
        for i, n in enumerate(rows):
            pos[i] += 1
            if pos[i] == len(streams[n]):  # EOS accepted: the row restarts its stream
                ms[i], pos[i] = eng.matcher(compiled[n]), 0


def summarize(times: dict, batch: int) -> dict:
    us = {k: np.array(v) / 1e3 for k, v in times.items()}
    us["total"] = us["fill"] + us["apply"] + us["accept"]
    stats = {k: {"mean": v.mean(), "p50": np.percentile(v, 50), "p99": np.percentile(v, 99)} for k, v in us.items()}
    stats["per_row_token_us"] = {k: stats["total"][k] / batch for k in ("mean", "p50")}
    return stats


def cross_check(engines: list, compiled: dict, streams: dict, tok) -> dict:
    """Batch-1 replay of every schema through both engines, comparing allowed-token sets per step.
    Differing steps are sorted into: llguidance allows a single token (the canonical one, where the
    grammar forces the text) while XGrammar also allows tokens covering a prefix of it; the sets
    differ only in the tokenizer's added tokens and the DEL byte (XGrammar lets them into JSON
    strings); other (an example is kept)."""
    extra = np.zeros(VOCAB, dtype=bool)
    extra[[*tok.added_tokens_decoder, tok.convert_tokens_to_ids("ġ")]] = True  # ids 0-16, byte 0x7f
    out = {}
    for n, stream in streams.items():
        ms = [e.matcher(compiled[e.name][n]) for e in engines]
        masks = [torch.zeros((1, VOCAB // 32), dtype=torch.int32) for _ in engines]
        c = dict.fromkeys(COUNTS, 0) | {"steps": len(stream)}
        for step, t in enumerate(stream):
            for e, m, b in zip(engines, ms, masks):
                e.fill([m], b)
            xb, lb = (_bits(b) for b in masks)
            c["count_differs"] += int(xb.sum()) != int(lb.sum())
            diff = xb != lb
            if diff.any():
                subset = not (lb & ~xb).any()
                kind = "forced" if subset and lb.sum() == 1 else "extras" if not (diff & ~extra).any() else "other"
                c["set_differs"] += 1
                c["llg_subset"] += subset
                c[kind] += 1
                if kind == "other" and "example" not in c:
                    only = [
                        tok.convert_ids_to_tokens(np.flatnonzero(x & ~y)[:4].tolist()) for x, y in [(xb, lb), (lb, xb)]
                    ]
                    c["example"] = {"step": step, "prefix": tok.decode(stream[:step])[-20:], "only_xgrammar": only[0],
                                    "only_llguidance": only[1], "counts": [int(xb.sum()), int(lb.sum())]}  # fmt: skip
            for e, m in zip(engines, ms):
                assert e.accept(m, t), f"{e.name} rejected token {t} at step {step} of {n}"
        out[n] = c
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/pdserve/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="fresh matchers each repeat; all steps pooled")
    ap.add_argument("--threads", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="engine pools and torch")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # llguidance's apply kernel runs on torch's pool

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    eos = tok.eos_token_id
    text = {n: json.dumps(inst, separators=(", ", ": ")) for n, (_, inst) in SCHEMAS.items()}
    streams = {n: tok.encode(t, add_special_tokens=False) + [eos] for n, t in text.items()}
    lens = {n: len(t) for n, t in streams.items()}
    engines = [XGrammar(tok, eos, args.threads), LLGuidance(tok, eos, args.threads), PdServe(tok, eos, args.threads)]
    compiled: dict[str, dict] = {}
    res: dict = {"engines": {}, "batches": {}}
    for e in engines:
        comp = {n: [_ms(e.compile, s) for _ in range(2)] for n, (s, _) in SCHEMAS.items()}
        compiled[e.name] = {n: c[0][1] for n, c in comp.items()}
        zeros = [(torch.randn(b, VOCAB), torch.zeros((b, VOCAB // 32), dtype=torch.int32)) for b in args.batches]
        warm = sum(_ms(e.apply, *z)[0] for z in zeros for _ in range(2))  # llguidance's torch.compile
        res["engines"][e.name] = {"tokenizer_info_ms": e.setup_ms, "apply_warmup_ms": warm,
                                  "compile_first_ms": {n: c[0][0] for n, c in comp.items()},
                                  "compile_cached_ms": {n: c[1][0] for n, c in comp.items()}}  # fmt: skip
    res["cross_check"] = cross_check(engines[:2], compiled, streams, tok)
    times = {(e.name, b): {"fill": [], "apply": [], "accept": []} for b in args.batches for e in engines}
    for _ in range(args.repeats):  # engines interleaved, so that a noisy neighbour hits both alike
        for b in args.batches:
            for e in engines:
                run_repeat(e, compiled[e.name], streams, b, args.tokens, times[e.name, b])
    res["batches"] = {f"{e}/{b}": summarize(t, b) for (e, b), t in times.items()}
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    v = {"cpu": cpu, "cores": os.cpu_count(), "threads": args.threads, "torch_threads": torch.get_num_threads()}
    v.update({p: md.version(p) for p in ("torch", "xgrammar", "llguidance")}, command=shlex.join(["python", *sys.argv]))
    res["env"] = v | {"date": datetime.datetime.now().isoformat(timespec="seconds"), "stream_tokens": lens}
    report(res, args, engines)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2, default=float)


def report(res: dict, args, engines: list) -> None:
    v = res["env"]
    print(f"CPU: {v['cpu']} ({v['cores']} cores visible; engine threads {v['threads']}, torch {v['torch_threads']})")
    print(f"date: {v['date']}  torch {v['torch']}  xgrammar {v['xgrammar']}  llguidance {v['llguidance']}")
    print(f"command: {v['command']}")
    print(f"vocab {VOCAB}; streams (tokens incl. EOS): {v['stream_tokens']}; {args.tokens} steps x {args.repeats}")
    print("\ncells: mean (p50/p99) µs per decode step for the whole batch\n")
    print("| engine | batch | fill µs/step | apply µs/step | accept µs/step | total µs/step | µs per row-token (p50) "
          "| compile ms first/cached |\n|---|" + "---:|" * 7)  # fmt: skip
    for b in args.batches:
        for e in engines:
            s, r = res["batches"][f"{e.name}/{b}"], res["engines"][e.name]
            cell = [f"{s[k]['mean']:.1f} ({s[k]['p50']:.1f}/{s[k]['p99']:.1f})" for k in STEP_PARTS]
            comp = [np.mean(list(r[k].values())) for k in ("compile_first_ms", "compile_cached_ms")]
            cell += ["{mean:.2f} ({p50:.2f})".format(**s["per_row_token_us"]), f"{comp[0]:.2f} / {comp[1]:.2f}"]
            print(f"| {e.name} | {b} | {' | '.join(cell)} |")
    print("\ncompile ms first/cached per schema (llguidance has no compiled-grammar cache: 'cached' = a new LLMatcher")
    print("from the cached grammar string); tokenizer info ms; apply warm-up ms (first calls, both batch shapes):")
    for e in engines:
        r = res["engines"][e.name]
        per = ", ".join(f"{n} {r['compile_first_ms'][n]:.2f}/{r['compile_cached_ms'][n]:.2f}" for n in SCHEMAS)
        print(f"  {e.name}: {per}; tokenizer info {r['tokenizer_info_ms']:.0f}; warm-up {r['apply_warmup_ms']:.0f}")
    print(f"\nmask cross-check, batch 1 (llguidance options {LLG_JSON}):")
    for n, c in res["cross_check"].items():
        print(f"  {n}: {c['steps']} steps; allowed count differs at {c['count_differs']}, set at {c['set_differs']}")
        print(f"    llguidance's set a subset at {c['llg_subset']}; llguidance forces the canonical token at "
              f"{c['forced']}; only added tokens/DEL differ at {c['extras']}; other {c['other']}")  # fmt: skip
        if "example" in c:
            print(f"    first other difference: {c['example']}")


if __name__ == "__main__":
    main()
