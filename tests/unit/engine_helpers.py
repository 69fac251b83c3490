"""Reference outputs from transformers and prompt sets shared by the engine tests."""

from __future__ import annotations

import functools
import random

import torch

PROMPT_LENGTHS = (1, 7, 16, 33, 64, 129, 200, 300)
MAX_NEW_TOKENS = 64


def random_prompts(lengths=PROMPT_LENGTHS, seed: int = 0, low: int = 10, high: int = 1000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(n)] for n in lengths]


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=256)
def hf_greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt (EOS stops it, as in the engine)."""
    model = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process, to show that nothing compiles mid-request
    (its "frames" counter stays empty for torch.compile'd functions in torch 2.13)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
