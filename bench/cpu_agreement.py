"""Greedy agreement with transformers on CPU in bf16: SmolLM2-135M-Instruct's 8 chat questions
(``tests/conftest.py``), 32 new tokens, the engine against transformers' ``generate`` in the same
dtype, with the C++ paged decode kernel (``decode_kernel``, the default) and without it (decodes
then take inductor's paged kernel or gather + SDPA), in one run.

    python bench/cpu_agreement.py
    python bench/cpu_agreement.py --dtype float32 --new-tokens 16
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import CHAT_QUESTIONS, chat_prompt_ids  # noqa: E402
from workers.backends.cpu.options import CPUOptions  # noqa: E402
from workers.engine import LLMEngine, SamplingParams  # noqa: E402
from workers.models.source import resolve_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = str(resolve_model(args.model))
    prompts = [chat_prompt_ids(model_dir, q) for q in CHAT_QUESTIONS]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False)
            expected.append(out[0, len(p) :].tolist())
    del hf
    print(f"command: python {' '.join(sys.argv)}\n")
    print("| decode attention | completions identical | tokens at equal positions | generate s |")
    print("|---|---|---|---|")
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    for kernel in (True, False):
        engine = LLMEngine(
            model_dir,
            device="cpu",
            dtype=args.dtype,
            num_kv_blocks=512,
            max_num_seqs=8,
            load_progress=False,
            cpu=dataclasses.replace(CPUOptions(), decode_kernel=kernel),
        )
        start = time.perf_counter()
        outs = [o.token_ids for o in engine.generate(prompts, params)]
        seconds = time.perf_counter() - start
        same = sum(o == e for o, e in zip(outs, expected))
        tokens = sum(sum(a == b for a, b in zip(o, e)) for o, e in zip(outs, expected))
        name = "C++ paged kernel" if kernel else "without it"
        print(f"| {name} | {same}/{len(prompts)} | {tokens}/{sum(map(len, expected))} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
