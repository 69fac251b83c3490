"""One engine assembly for every rank: backend, model, KV cache and runner, built in one order.

Rank 0 (``LLMEngine``) and each tensor-parallel worker rank (``tensor_parallel.run_worker``) call
``assemble``; they differ only in how the ranks agree (``agree_num_blocks``: the smallest
count any rank can hold, so block ids mean the same everywhere) and who settles the context
plan (``settle``: rank 0 computes it from the block count and tells the workers, who wait for
it). The collectives inside happen in the same order on every rank.

Unless ``num_kv_blocks`` is set, every rank plans its memory (``workers/engine/memory_plan.py``):
on a GPU from a profile run of the largest step after the weights load (each rank runs the same
step, so the model's collectives match), elsewhere against ``kv_cache_memory_gib``. The ranks
agree on the fewest blocks; rank 0 logs the plan in one line, and a plan that cannot hold one
sequence is refused on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers import backends
from workers.backends.base import Backend
from workers.engine.compiled import CompiledDecode
from workers.engine.config import EngineConfig
from workers.engine.memory_plan import (
    MemoryPlan,
    MemorySettings,
    budget_usage,
    plan_memory,
    profile_memory,
    start_profile,
)
from workers.engine.model_runner import ModelRunner
from workers.layers.kv_cache import PagedKVCache
from workers.models.config import ModelConfig
from workers.models.llama import LlamaForCausalLM
from workers.models.loader import load_model, resolve_dtype
from workers.models.parallel import TPGroup, rank_model_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ContextPlan:
    """What the KV cache's size allows: the longest context, the sliding window kept (None: full
    attention), and the most prompt tokens one step computes for one sequence (None: no cap)."""

    max_model_len: int
    sliding_window: int | None
    max_chunk: int | None


def plan_context(config: EngineConfig, model_config: ModelConfig, num_blocks: int) -> ContextPlan:
    """The context plan for a cache of ``num_blocks`` blocks (rank 0 settles it for every rank)."""
    max_len = config.max_model_len or model_config.max_position_embeddings
    window = model_config.sliding_window
    # A window at least as long as the context never cuts anything: plain causal attention.
    sliding_window = window if window and window < max_len else None
    max_chunk = None
    if sliding_window is not None:
        # A windowed sequence holds the window's blocks plus those of the chunk it computes:
        # chunks are capped so that both fit, and any context length runs.
        window_blocks = sliding_window // config.block_size + 2
        if num_blocks > window_blocks:
            max_chunk = (num_blocks - window_blocks) * config.block_size
        else:
            sliding_window = None  # the cache cannot hold one window: no context past it
    capacity = num_blocks * config.block_size
    if capacity < max_len and sliding_window is None:
        logger.info("KV cache holds %d tokens: max_model_len lowered from %d", capacity, max_len)
        max_len = capacity
    return ContextPlan(max_len, sliding_window, max_chunk)


@dataclass(frozen=True, slots=True)
class EngineParts:
    backend: Backend
    model: LlamaForCausalLM
    model_config: ModelConfig
    dtype: torch.dtype
    kv: PagedKVCache
    plan: ContextPlan
    runner: ModelRunner
    memory: MemoryPlan | None = None  # None: num_kv_blocks was given


def choose_backend(config: EngineConfig, device: torch.device, log: bool = True) -> Backend:
    """The engine's backend (``config.backend`` on ``device``), its process settings applied;
    logged once (``log``: rank 0; worker ranks choose the same silently)."""
    backend = backends.select(config.backend, device, config)
    backend.prepare_process()
    if log:
        logger.info("%s", backend.describe())
    return backend


def assemble(
    config: EngineConfig,
    device: torch.device,
    tp: TPGroup,
    agree_num_blocks: Callable[[int], int],
    settle: Callable[[ModelConfig, int], ContextPlan],
    rank0: bool = True,
) -> EngineParts:
    """Build one rank's engine parts (module docstring). Decode graphs are compiled on rank 0
    only (``enforce_eager=False`` refuses tensor parallelism)."""
    backend = choose_backend(config, device, log=rank0)
    model_config = ModelConfig.from_dir(config.model_dir)
    dtype = resolve_dtype(model_config, device, config.dtype)
    max_len = config.max_model_len or model_config.max_position_embeddings
    probe = backend.memory_probe() if config.num_kv_blocks is None else None
    start = start_profile(probe) if probe is not None else None  # before this replica allocates
    model = load_model(
        config.model_dir,
        device,
        config.dtype,
        tp,
        backend,
        max_positions=max_len,
        progress=config.load_progress,
        random_weights=config.load_format == "dummy",
    )
    rank_config = rank_model_config(model_config, tp)  # this rank's KV heads: what its cache holds
    memory: MemoryPlan | None = None
    if config.num_kv_blocks is not None:
        num_blocks = agree_num_blocks(config.num_kv_blocks)
    else:
        if probe is not None and start is not None:
            usage, _ = profile_memory(config, model, backend, rank_config, dtype, device, probe, start, rank0)
        else:
            usage = budget_usage(config.kv_cache_memory_gib)
        settings = MemorySettings.from_config(config, device)
        memory = plan_memory(settings, rank_config, dtype, usage, str(device))
        num_blocks = agree_num_blocks(memory.num_blocks)
        memory = memory.agreed(num_blocks)
        if rank0:
            logger.info("%s", memory.line())
        else:
            logger.debug("rank %d: %s", tp.rank, memory.line())
        memory.check()
    plan = settle(model_config, num_blocks)
    kv = PagedKVCache(rank_config, num_blocks, config.block_size, config.kv_cache_dtype, dtype, device)
    compiled = None
    if rank0 and not config.enforce_eager:
        compiled = CompiledDecode(model, config.max_num_seqs, device, config.compile_batch_sizes)
    runner = ModelRunner(model, kv, backend, plan.sliding_window, compiled, config.load_progress and rank0)
    return EngineParts(backend, model, model_config, dtype, kv, plan, runner, memory)
