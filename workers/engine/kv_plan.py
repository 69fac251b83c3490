"""KV memory planning from a model's config: bytes per token, blocks that fit, concurrency.

Pure arithmetic over ``config.json`` (no weights, no torch device), so an operator can size
pools before deploying: ``pdserve kv-plan --model DIR --gpu-mem 80 --context 8192 --concurrency 64``.
The figures follow the engine's own allocation (``workers.layers.kv_cache.bytes_per_block``):
a quantized block carries one extra row of scales (K per channel, V per token: one row of
``block_size`` tokens + 1, i.e. 17/16 byte per value at block size 16), and a sliding-window
sequence never holds more than its window's blocks plus one.

With tensor parallelism (``--tp N``) a replica spans N GPUs of ``gpu_mem`` each, Megatron-style:
each GPU holds 1/N of the attention and MLP weights, of the embedding and of the LM head (the
norms whole), and ``num_kv_heads / N`` KV heads of every block (one, replicated, when N exceeds
the KV heads); block ids are the same on every GPU, so a replica holds as many blocks as one
GPU's share of memory fits.

The blocks come from the engine's own memory plan (``workers/engine/memory_plan.py:
plan_memory``) with estimates where the engine measures: the weights from the config, the
largest step's activation peak from the same step the engine profiles
(``estimate_activation_bytes``), and the same staging, CUDA graph and communicator reserves; a
plan the engine would refuse is named in the verdict.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from workers.engine.memory_plan import (
    COMMUNICATOR_MIB,
    GIB,
    MemoryPlan,
    MemorySettings,
    blocks_per_sequence,
    estimate_usage,
    plan_memory,
)
from workers.layers.kv_cache import bytes_per_block, scale_granularity
from workers.models.config import ModelConfig
from workers.models.loader import resolve_dtype
from workers.protocol import KVCacheDType
from workers.transfer.tp_plan import heads_of_rank


@dataclass(frozen=True, slots=True)
class KVPlan:
    kv_cache_dtype: KVCacheDType
    model_dtype: str
    block_size: int
    bytes_per_token: float  # KV of one token over all layers (scale rows spread over the block)
    bytes_per_block: int
    weight_bytes: int  # the parameters (``memory.weight_bytes`` adds the rotary tables loading builds)
    kv_budget_bytes: int  # gpu_mem x utilization - weights, the step's activations and the reserves
    num_blocks: int
    blocks_per_sequence: int  # at the planned context
    max_concurrency: int  # sequences of the planned context that fit at once
    concurrency: int  # what was asked for
    replicas_needed: int  # replicas of this size to hold ``concurrency`` sequences
    tensor_parallel_size: int = 1  # GPUs per replica; weight and block bytes are per GPU
    kv_heads_per_gpu: int = 0
    memory: MemoryPlan | None = None  # the engine's plan with estimates: what the budget is spent on

    @property
    def gpus_needed(self) -> int:
        return self.replicas_needed * self.tensor_parallel_size

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def fits(self) -> bool:
        return self.max_concurrency >= self.concurrency


def kv_heads_per_rank(model: ModelConfig, tensor_parallel_size: int) -> int:
    """KV heads each of ``tensor_parallel_size`` ranks holds (``workers/transfer/tp_plan.py``):
    an equal share, or one (replicated) when there are more ranks than KV heads. Refuses a size
    the heads do not divide."""
    tp = tensor_parallel_size
    if tp < 1 or model.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {model.num_heads} attention heads")
    return len(heads_of_rank(model.num_kv_heads, tp, 0))


def weight_params_per_rank(model: ModelConfig, tensor_parallel_size: int) -> int:
    """Parameters one rank holds: its shard of every projection, embedding and LM head (its KV
    heads' K/V projections, replicated ones included), the norms whole."""
    tp, h, d = tensor_parallel_size, model.hidden_size, model.head_dim
    kv = kv_heads_per_rank(model, tp) * d
    q = model.num_heads * d // tp
    attn = h * q + 2 * h * kv + q * h
    mlp = 3 * h * math.ceil(model.intermediate_size / tp)
    embed = math.ceil(model.vocab_size / tp) * h * (1 if model.tie_word_embeddings else 2)
    return model.num_layers * (attn + mlp + 2 * h) + embed + h


def plan_kv(
    model: ModelConfig,
    gpu_mem_gib: float,
    context: int,
    concurrency: int,
    kv_cache_dtype: str = "auto",
    dtype: str | None = None,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel_size: int = 1,
    *,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 128,
    max_model_len: int | None = None,
    enforce_eager: bool = True,
    compile_batch_sizes: tuple[int, ...] | None = None,
    kv_transfer_slots: int = 0,
    kv_transfer_peers: int = 0,
    communicator_memory_mib: int = COMMUNICATOR_MIB,
    cuda_graph_memory_gib: float | None = None,
) -> KVPlan:
    """How the KV cache of one replica with ``gpu_mem_gib`` of accelerator memory per GPU (and
    ``tensor_parallel_size`` GPUs) is spent; byte figures are per GPU. The keywords are the
    engine's (``EngineConfig``, same defaults); ``max_model_len`` defaults to ``context``."""
    kind = KVCacheDType.parse(kv_cache_dtype)
    for name, value in (
        ("gpu_mem", gpu_mem_gib),
        ("context", context),
        ("concurrency", concurrency),
        ("block_size", block_size),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    local_kv_heads = kv_heads_per_rank(model, tensor_parallel_size)
    torch_dtype = resolve_dtype(model, torch.device("cuda"), dtype)  # what a GPU replica runs
    model_dtype = str(torch_dtype).removeprefix("torch.")
    # one GPU's view of the model, as the engine's rank_model_config makes it
    rank_model = dataclasses.replace(
        model, num_heads=model.num_heads // tensor_parallel_size, num_kv_heads=local_kv_heads
    )
    per_block = bytes_per_block(rank_model, block_size, kv_cache_dtype, torch_dtype)
    weights = weight_params_per_rank(model, tensor_parallel_size) * torch.empty((), dtype=torch_dtype).element_size()
    settings = MemorySettings.build(
        block_size=block_size,
        kv_cache_dtype=kind.value,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len or context,
        cuda_graphs=not enforce_eager,
        compile_batch_sizes=compile_batch_sizes,
        kv_transfer_slots=kv_transfer_slots,
        kv_transfer_peers=kv_transfer_peers,
        communicator_memory_mib=communicator_memory_mib,
        cuda_graph_memory_gib=cuda_graph_memory_gib,
    )
    usage = estimate_usage(settings, rank_model, torch_dtype, int(gpu_mem_gib * GIB), weights)
    memory = plan_memory(settings, rank_model, torch_dtype, usage, f"a GPU of {gpu_mem_gib:g} GiB")
    num_blocks = memory.num_blocks
    per_seq = blocks_per_sequence(context, model.sliding_window, block_size)
    max_concurrency = num_blocks // per_seq
    return KVPlan(
        kv_cache_dtype=kind,
        model_dtype=model_dtype,
        block_size=block_size,
        bytes_per_token=per_block / block_size,
        bytes_per_block=per_block,
        weight_bytes=weights,
        kv_budget_bytes=max(0, memory.kv_bytes),
        num_blocks=num_blocks,
        blocks_per_sequence=per_seq,
        max_concurrency=max_concurrency,
        concurrency=concurrency,
        replicas_needed=math.ceil(concurrency / max_concurrency) if max_concurrency else 0,
        tensor_parallel_size=tensor_parallel_size,
        kv_heads_per_gpu=local_kv_heads,
        memory=memory,
    )


def tensor_parallel_sizes(model: ModelConfig, most: int = 8) -> list[int]:
    """The sizes up to ``most`` (powers of two) the model's heads allow."""
    sizes = []
    for tp in (1, 2, 4, 8, 16):
        if tp > most:
            break
        try:
            kv_heads_per_rank(model, tp)
        except ValueError:
            continue
        sizes.append(tp)
    return sizes


def format_tp_options(plans: list[KVPlan], context: int) -> str:
    """One row per tensor-parallel size: per-GPU weights and KV heads, sequences one replica
    holds, replicas and GPUs the concurrency target needs; the fewest GPUs marked."""
    fitting = [p for p in plans if p.max_concurrency]
    best = min(fitting, key=lambda p: (p.gpus_needed, p.tensor_parallel_size), default=None)
    lines = [
        f"by tensor-parallel size (kv_cache_dtype={plans[0].kv_cache_dtype}, {plans[0].concurrency} "
        f"sequences of {context} tokens):",
        f"{'tp':>4}{'weights/GPU GiB':>17}{'KV heads/GPU':>14}{'blocks':>14}{'max seqs':>12}"
        f"{'replicas':>10}{'GPUs':>8}",
    ]
    for plan in plans:
        replicas, gpus = (
            (str(plan.replicas_needed), str(plan.gpus_needed)) if plan.max_concurrency else ("-", "does not fit")
        )
        mark = "  <- fewest GPUs" if plan is best else ""
        lines.append(
            f"{plan.tensor_parallel_size:>4}{plan.weight_bytes / 2**30:>17.2f}{plan.kv_heads_per_gpu:>14}"
            f"{plan.num_blocks:>14,}{plan.max_concurrency:>12,}{replicas:>10}{gpus:>8}{mark}"
        )
    return "\n".join(lines)


def format_plan(model: ModelConfig, plans: list[KVPlan], context: int, gpu_mem_gib: float) -> str:
    """A table, one row per KV dtype; the first plan is the one asked for."""
    first = plans[0]
    window = f", sliding window {model.sliding_window}" if model.sliding_window else ""
    lines = [
        f"model: {model.architecture}, {model.num_layers} layers x {model.num_kv_heads} KV heads x "
        f"head_dim {model.head_dim}{window}; weights {first.model_dtype} {first.weight_bytes / 2**30:.2f} GiB"
        + (" per GPU (bytes and blocks below are per GPU)" if first.tensor_parallel_size > 1 else ""),
        f"replica: {gpu_mem_gib:g} GiB"
        + (
            f" per GPU x tensor parallel {first.tensor_parallel_size} ({first.kv_heads_per_gpu} KV heads per GPU)"
            if first.tensor_parallel_size > 1
            else ""
        )
        + f", context {context} tokens, block size {first.block_size}",
    ]
    if any(plan.kv_cache_dtype != "auto" for plan in plans):
        lines.append(f"int8/fp8 scales: {scale_granularity(first.block_size, model.head_dim)}")
    memory = first.memory
    if memory is not None:
        s = memory.settings
        lines.append(
            f"per GPU, as a replica plans it (steps of {s.max_num_batched_tokens} tokens over {s.max_num_seqs} "
            f"sequences at context {s.max_model_len}; weights and activations estimated):"
        )
        lines.append(f"  {memory.line()}")
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
    tp = first.tensor_parallel_size
    gpus = f" of tp {tp} ({first.gpus_needed} GPUs)" if tp > 1 and first.replicas_needed else ""
    verdict = (
        f"{first.concurrency} sequences of {context} tokens fit in one replica{f' of tp {tp}' if tp > 1 else ''} with "
        f"kv_cache_dtype={first.kv_cache_dtype}"
        if first.fits
        else f"{first.concurrency} sequences of {context} tokens need {first.replicas_needed or 'more'} "
        f"replicas{gpus} with kv_cache_dtype={first.kv_cache_dtype} (one holds {first.max_concurrency})"
    )
    if not first.num_blocks:
        spent = first.weight_bytes if memory is None else memory.budget_bytes - memory.kv_bytes
        verdict = (
            f"the weights and the largest step ({spent / 2**30:.2f} GiB with the reserves) leave no room for a "
            f"KV block in {gpu_mem_gib:g} GiB at this utilization: give each replica more memory or use a "
            f"smaller model"
        )
    refusal = memory.refusal() if memory is not None else None
    if refusal:
        verdict += f"\na replica would refuse to start: {refusal}"
    return "\n".join(lines + ["", verdict])
