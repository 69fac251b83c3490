"""The paged KV cache: its tensors, how many blocks fit, and writing/reading K and V.

One tensor per layer, ``[2, num_blocks, rows, num_kv_heads, head_dim]`` (0 = K, 1 = V). The
transfer layer moves blocks of these tensors as they are (``workers.protocol.KVLayout``).

``kv_cache_dtype``:

- ``auto``: the model's dtype; ``rows`` = block_size.
- ``int8`` / ``fp8`` (float8_e4m3fn): one scale per block, per head, for K and for V, kept in an
  extra row at the end of the block (``rows`` = block_size + 1; the scale is the first four bytes
  of the head's slot, as float32). A block therefore carries its scales wherever it goes: the
  prefix cache, a transfer, another worker's cache. Writing tokens into a block raises its scale
  to cover their absolute maximum; when the scale grows, the tokens already in the block are
  requantized to it (a block written in one prefill chunk is quantized once, exactly).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from workers.engine.config import EngineConfig
from workers.models.config import ModelConfig
from workers.protocol import KV_CACHE_DTYPES, SCALE_ROWS, KVLayout

logger = logging.getLogger(__name__)

_QUANTIZED = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
_MIN_SCALE = 1e-12  # an all-zero block still divides safely


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _QUANTIZED:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
    return _QUANTIZED[kv_cache_dtype][0]


def bytes_per_block(model: ModelConfig, block_size: int, kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V, scale row included."""
    storage = kv_storage_dtype(kv_cache_dtype, model_dtype)
    rows = block_size + (SCALE_ROWS if kv_cache_dtype != "auto" else 0)
    element = torch.empty((), dtype=storage).element_size()
    return rows * model.kv_bytes_per_token(element)


def plan_num_blocks(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Blocks to allocate: as configured, else what the memory budget holds."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_block(model, config.block_size, config.kv_cache_dtype, dtype)
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


def as_wide_rows(blocks: torch.Tensor) -> torch.Tensor:
    """View ``[2, n, rows, heads, dim]`` as ``[2, n, row]`` of the widest element that tiles a
    block exactly.

    Indexing copies one element at a time: moving 16-byte elements instead of 1- to 4-byte ones
    makes gathering and scattering blocks several times faster on CPU. Only bytes are copied,
    never converted, so the result is bit-exact whatever the KV dtype.
    """
    rows = blocks.view(blocks.shape[0], blocks.shape[1], -1)
    row_bytes = rows.shape[-1] * rows.element_size()
    offset_bytes = rows.storage_offset() * rows.element_size()
    for wide in (torch.complex128, torch.int64):
        if row_bytes % wide.itemsize == 0 and offset_bytes % wide.itemsize == 0:
            return rows.view(wide)
    return rows


@dataclass(slots=True)
class KVWritePlan:
    """Which slots a step writes, computed once per step on the host and used by every layer.

    A quantized cache also needs the blocks behind them: tokens of one sequence are consecutive
    and write only blocks that sequence owns alone (a shared block is full and never written),
    so blocks are listed per token without sorting. A full-precision cache needs ``slots`` only.
    """

    slots: torch.Tensor  # [T] row in the flat ``[2, num_blocks * rows, ...]`` view
    blocks: torch.Tensor | None = None  # [U] distinct blocks written
    token_block: torch.Tensor | None = None  # [T] index into ``blocks`` of each token's block
    fresh: torch.Tensor | None = None  # [U] bool: the step writes the block's first slot (old contents void)
    stale: torch.Tensor | None = None  # [S] index into ``blocks`` of blocks that already hold tokens

    @classmethod
    def build(cls, block_ids: list[int], offsets: list[int], rows: int, device: torch.device,
              quantized: bool) -> KVWritePlan:
        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)

        slots = tensor([b * rows + o for b, o in zip(block_ids, offsets)])
        if not quantized:
            return cls(slots)
        blocks: list[int] = []
        fresh: list[bool] = []
        token_block: list[int] = []
        position: dict[int, int] = {}
        for block, offset in zip(block_ids, offsets):
            index = position.get(block)
            if index is None:
                index = position[block] = len(blocks)
                blocks.append(block)
                fresh.append(offset == 0)
            token_block.append(index)
        stale = [i for i, f in enumerate(fresh) if not f]
        return cls(slots, blocks=tensor(blocks), token_block=tensor(token_block),
                   fresh=tensor(fresh, torch.bool), stale=tensor(stale))


class PagedKVCache:
    """The cache tensors of every layer and the only code that reads or writes their contents."""

    def __init__(
        self, model: ModelConfig, num_blocks: int, block_size: int, kv_cache_dtype: str,
        model_dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
        self.compute_dtype = model_dtype
        self.quantized = kv_cache_dtype != "auto"
        self.qmax = _QUANTIZED[kv_cache_dtype][1] if self.quantized else 0.0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.rows = block_size + (SCALE_ROWS if self.quantized else 0)
        self.num_kv_heads, self.head_dim = model.num_kv_heads, model.head_dim
        if self.quantized and self.head_dim < 4:
            raise ValueError(f"a quantized KV cache keeps a float32 scale per head: head_dim {self.head_dim} < 4")
        shape = (2, num_blocks, self.rows, self.num_kv_heads, self.head_dim)
        self.layers = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(model.num_layers)]
        # [2, num_blocks, heads] float32 views onto each layer's scale row (written in place).
        self.scales = [layer[:, :, block_size, :, :4].view(torch.float32)[..., 0] for layer in self.layers] \
            if self.quantized else []
        total = sum(c.numel() * c.element_size() for c in self.layers)
        logger.info("KV cache: %d blocks x %d tokens (%s), %.1f MiB on %s", num_blocks, block_size,
                    kv_cache_dtype if self.quantized else str(self.dtype).removeprefix("torch."),
                    total / 2**20, device)

    @property
    def layout(self) -> KVLayout:
        return KVLayout(len(self.layers), self.block_size, self.num_kv_heads, self.head_dim,
                        str(self.dtype).removeprefix("torch."))

    def write_plan(self, block_ids: list[int], offsets: list[int], device: torch.device) -> KVWritePlan:
        return KVWritePlan.build(block_ids, offsets, self.rows, device, self.quantized)

    # ------------------------------------------------------------------ write
    def write(self, layer: int, plan: KVWritePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new K and V (``[T, heads, dim]``) at ``plan.slots``."""
        if not self.quantized:
            flat = self.layers[layer].view(2, -1, self.num_kv_heads, self.head_dim)
            flat[0].index_copy_(0, plan.slots, k.to(self.dtype))
            flat[1].index_copy_(0, plan.slots, v.to(self.dtype))
            return
        # Quantized elements are one byte: copy them as uint8, which every index op supports
        # (CPU has no index_copy_ for float8).
        raw, scales = self.layers[layer].view(torch.uint8), self.scales[layer]
        kv = torch.stack((k, v)).float()  # [2, T, H, D]
        num_blocks = plan.blocks.shape[0]
        token_amax = kv.abs().amax(-1)  # [2, T, H]
        block_amax = token_amax.new_zeros(2, num_blocks, self.num_kv_heads).scatter_reduce_(
            1, plan.token_block[None, :, None].expand_as(token_amax), token_amax, "amax")
        old = scales.index_select(1, plan.blocks).masked_fill_(plan.fresh[None, :, None], 0.0)
        new = torch.maximum(old, block_amax / self.qmax).clamp_min_(_MIN_SCALE)
        if plan.stale.numel():
            # Tokens already in a partly filled block: rescale them to the block's new scale.
            # Where no scale grew this is a no-op (q * 1.0 rounds back to q): on CPU, where the
            # check costs no device sync, it is skipped.
            ratio = old.index_select(1, plan.stale) / new.index_select(1, plan.stale)  # [2, S, H]
            if raw.device.type != "cpu" or bool((ratio < 1).any()):
                self._requantize(raw, plan.blocks.index_select(0, plan.stale), ratio)
        scales.index_copy_(1, plan.blocks, new)
        q = self._quantize(kv / new.index_select(1, plan.token_block)[..., None])
        flat = raw.view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, plan.slots, q[0])
        flat[1].index_copy_(0, plan.slots, q[1])

    def _requantize(self, raw: torch.Tensor, blocks: torch.Tensor, ratio: torch.Tensor) -> None:
        """Multiply the stored values of ``blocks`` by ``ratio`` ([2, S, H]) in place."""
        wide = as_wide_rows(raw)
        held = wide[:, blocks].view(torch.uint8).view(2, blocks.shape[0], self.rows, self.num_kv_heads, self.head_dim)
        values = held[:, :, : self.block_size].view(self.dtype).to(torch.float32)
        held[:, :, : self.block_size] = self._quantize(values.mul_(ratio[:, :, None, :, None]))
        wide.index_copy_(1, blocks, as_wide_rows(held))

    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Scaled values -> the storage dtype, returned as its bytes (uint8)."""
        if self.dtype == torch.int8:
            return x.round_().clamp_(-self.qmax, self.qmax).to(torch.int8).view(torch.uint8)
        return x.clamp_(-self.qmax, self.qmax).to(self.dtype).view(torch.uint8)

    # ------------------------------------------------------------------- read
    def gather(self, layer: int, block_tables: torch.Tensor) -> torch.Tensor:
        """K and V of the blocks in ``block_tables`` (``[..., n]``) as ``[2, ..., n * block_size, H, D]``
        in the compute dtype."""
        cache = self.layers[layer]
        lead = block_tables.shape
        block_shape = (self.rows, self.num_kv_heads, self.head_dim)
        blocks = as_wide_rows(cache)[:, block_tables].view(cache.dtype).view(2, *lead, *block_shape)
        if self.quantized:
            scales = blocks[..., self.block_size, :, :4].contiguous().view(torch.float32)  # [2, ..., n, H, 1]
            values = blocks[..., : self.block_size, :, :].to(torch.float32)  # scales applied in fp32
            blocks = values.mul_(scales.unsqueeze(-3)).to(self.compute_dtype)
        return blocks.reshape(2, *lead[:-1], lead[-1] * self.block_size, self.num_kv_heads, self.head_dim)
