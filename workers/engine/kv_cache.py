"""The paged KV cache tensors and how many blocks fit.

One tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V).
The transfer layer relies on this layout (``workers.protocol.KVLayout``).
"""

from __future__ import annotations

import logging

import torch

from workers.engine.config import EngineConfig
from workers.models.config import ModelConfig

logger = logging.getLogger(__name__)


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return block_size * model.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


def plan_num_blocks(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Blocks to allocate: as configured, else what the memory budget holds."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_block(model, config.block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * config.gpu_memory_utilization) - used
        if budget < per_block:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {used / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
                f"in use after loading; raise gpu_memory_utilization or use a smaller model"
            )
    else:
        budget = int(config.kv_cache_memory_gib * 2**30)
    return max(1, budget // per_block)


def allocate_kv_cache(
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
    total = sum(c.numel() * c.element_size() for c in caches)
    logger.info("KV cache: %d blocks x %d tokens, %.1f MiB on %s", num_blocks, block_size, total / 2**20, device)
    return caches
