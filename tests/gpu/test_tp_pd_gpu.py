"""Prefill and decode workers of different tensor-parallel sizes on CUDA (the NCCL versions of
tests/integration/test_tp_pd_workers.py): model collectives over NCCL, KV between rank pairs
over NCCL across GPUs and staged through pinned memory where both ranks share one GPU. Output
equals transformers' greedy output, and each decode rank received exactly its heads."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_tp_pd_workers import check_exact_and_per_rank_bytes, make_pools

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("sizes", [(1, 2), (2, 1), (2, 2)], ids=["p1-d2", "p2-d1", "p2-d2"])
async def test_mixed_tensor_parallel_pools_on_cuda(sizes, tiny_llama):
    if torch.cuda.device_count() < max(sizes):
        pytest.skip(
            f"tensor parallel {max(sizes)} needs {max(sizes)} GPUs; this machine has {torch.cuda.device_count()}"
        )
    async with make_pools(tiny_llama, *sizes, device="cuda") as (prefill, decode):
        await check_exact_and_per_rank_bytes(prefill, decode, tiny_llama)
