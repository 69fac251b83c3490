"""KV memory planning from a model's config: bytes per token, blocks that fit, concurrency.

Pure arithmetic over ``config.json`` (no weights, no torch device), so an operator can size
pools before deploying: ``pdserve kv-plan --model DIR --gpu-mem 80 --context 8192 --concurrency 64``.
The figures follow the engine's own allocation (``workers.layers.kv_cache.bytes_per_block``):
a quantized block carries one extra row of scales (K per channel, V per token: one row of
``block_size`` tokens + 1, i.e. 17/16 byte per value at block size 16), and a sliding-window
sequence never holds more than its window's blocks plus one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.layers.kv_cache import bytes_per_block, scale_granularity
from workers.models.config import ModelConfig
from workers.models.loader import resolve_dtype
from workers.protocol import KVCacheDType


@dataclass(frozen=True, slots=True)
class KVPlan:
    kv_cache_dtype: KVCacheDType
    model_dtype: str
    block_size: int
    bytes_per_token: float  # KV of one token over all layers (scale rows spread over the block)
    bytes_per_block: int
    weight_bytes: int
    kv_budget_bytes: int  # gpu_mem x utilization - weights
    num_blocks: int
    blocks_per_sequence: int  # at the planned context
    max_concurrency: int  # sequences of the planned context that fit at once
    concurrency: int  # what was asked for
    replicas_needed: int  # replicas of this size to hold ``concurrency`` sequences

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def fits(self) -> bool:
        return self.max_concurrency >= self.concurrency


def plan_kv(
    model: ModelConfig,
    gpu_mem_gib: float,
    context: int,
    concurrency: int,
    kv_cache_dtype: str = "auto",
    dtype: str | None = None,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
) -> KVPlan:
    """How the KV cache of one replica with ``gpu_mem_gib`` of accelerator memory is spent."""
    kind = KVCacheDType.parse(kv_cache_dtype)
    for name, value in (
        ("gpu_mem", gpu_mem_gib),
        ("context", context),
        ("concurrency", concurrency),
        ("block_size", block_size),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    torch_dtype = resolve_dtype(model, torch.device("cuda"), dtype)  # what a GPU replica runs
    model_dtype = str(torch_dtype).removeprefix("torch.")
    per_block = bytes_per_block(model, block_size, kv_cache_dtype, torch_dtype)
    weights = model.num_params * torch.empty((), dtype=torch_dtype).element_size()
    budget = int(gpu_mem_gib * 2**30 * gpu_memory_utilization) - weights
    num_blocks = max(0, budget // per_block)
    per_seq = math.ceil(context / block_size)
    if model.sliding_window and model.sliding_window < context:
        per_seq = min(per_seq, math.ceil(model.sliding_window / block_size) + 1)
    max_concurrency = num_blocks // per_seq
    return KVPlan(
        kv_cache_dtype=kind,
        model_dtype=model_dtype,
        block_size=block_size,
        bytes_per_token=per_block / block_size,
        bytes_per_block=per_block,
        weight_bytes=weights,
        kv_budget_bytes=max(0, budget),
        num_blocks=num_blocks,
        blocks_per_sequence=per_seq,
        max_concurrency=max_concurrency,
        concurrency=concurrency,
        replicas_needed=math.ceil(concurrency / max_concurrency) if max_concurrency else 0,
    )


def format_plan(model: ModelConfig, plans: list[KVPlan], context: int, gpu_mem_gib: float) -> str:
    """A table, one row per KV dtype; the first plan is the one asked for."""
    first = plans[0]
    window = f", sliding window {model.sliding_window}" if model.sliding_window else ""
    lines = [
        f"model: {model.architecture}, {model.num_layers} layers x {model.num_kv_heads} KV heads x "
        f"head_dim {model.head_dim}{window}; weights {first.model_dtype} {first.weight_bytes / 2**30:.2f} GiB",
        f"replica: {gpu_mem_gib:g} GiB, context {context} tokens, block size {first.block_size}",
    ]
    if any(plan.kv_cache_dtype != "auto" for plan in plans):
        lines.append(f"int8/fp8 scales: {scale_granularity(first.block_size, model.head_dim)}")
    lines += [
        "",
        f"{'kv dtype':<16}{'bytes/token':>12}{'KV budget GiB':>15}{'blocks':>14}{'tokens':>16}"
        f"{'blocks/seq':>12}{'max seqs':>12}{'replicas for ' + str(first.concurrency):>20}",
    ]
    for plan in plans:
        name = plan.kv_cache_dtype if plan.kv_cache_dtype != "auto" else f"auto({plan.model_dtype})"
        replicas = str(plan.replicas_needed) if plan.max_concurrency else "does not fit"
        lines.append(
            f"{name:<16}{plan.bytes_per_token:>12,.0f}{plan.kv_budget_bytes / 2**30:>15.2f}{plan.num_blocks:>14,}"
            f"{plan.tokens:>16,}{plan.blocks_per_sequence:>12,}{plan.max_concurrency:>12,}{replicas:>20}"
        )
    verdict = (
        f"{first.concurrency} sequences of {context} tokens fit in one replica with "
        f"kv_cache_dtype={first.kv_cache_dtype}"
        if first.fits
        else f"{first.concurrency} sequences of {context} tokens need {first.replicas_needed or 'more'} "
        f"replicas with kv_cache_dtype={first.kv_cache_dtype} (one holds {first.max_concurrency})"
    )
    if not first.num_blocks:
        verdict = (
            f"the weights ({first.weight_bytes / 2**30:.2f} GiB) leave no room for a KV block in "
            f"{gpu_mem_gib:g} GiB at this utilization: give each replica more memory or use a smaller model"
        )
    return "\n".join(lines + ["", verdict])
