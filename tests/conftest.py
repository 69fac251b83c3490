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
