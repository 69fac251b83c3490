"""The paged KV cache: its tensors, how many blocks fit, and writing/reading K and V.

One tensor per layer, ``[2, num_blocks, rows, num_kv_heads, head_dim]`` (0 = K, 1 = V). The
transfer layer moves blocks of these tensors as they are (``workers.protocol.KVLayout``).

``kv_cache_dtype``:

- ``auto``: the model's dtype; ``rows`` = block_size.
- ``int8`` / ``fp8`` (float8_e4m3fn): one byte per value, and one extra row at the end of the
  block (``rows`` = block_size + 1) holding the block's scales, so a block carries them wherever
  it goes: the prefix cache, a transfer, another worker's cache. The granularity was chosen by
  measuring candidates on real weights (docs/decisions/0016-kv-quantization-int8-fp8.md):

  * **K per channel, asymmetric** (KIVI's choice: K has outlier channels, with large offsets that
    RoPE's slow channels keep nearly constant): per block, per head and per channel an offset
    ``m`` and a scale ``s``, ``k = m + s * q``. Offsets are float8_e4m3fn, the K extra row
    (``head_dim`` bytes per head). Scales are log codes (below) kept as one base code per head
    plus a 4-bit step per channel (``s_c = code(base - 2 * step_c)``, so within 2^-3.75 of the
    head's largest), in the V extra row after the V scales.
  * **V per token**: one log-coded scale per token per head (the first ``block_size`` bytes of the
    head's V extra row). V is stored rotated by a fixed orthonormal Hadamard matrix ``R``
    (QuaRot's trick: it spreads a token's outlier channels over all of them, so its scale is
    set by a typical channel, not the largest); attention over the cache multiplies its output
    by ``R^T`` once instead of un-rotating every gathered value (``gather`` does it for callers
    that ask for plain V).

  A scale is a one-byte code ``c``, ``s = 2 ** (c / 8 - 24)`` (steps of 9 %, rounded up from the
  value's needed scale so nothing clips; 6e-8 to 235, i.e. |value| up to ~30,000 for int8).
  Heads too narrow for the K layout (``head_dim < 2 * block_size + 2``, e.g. tiny test models)
  keep symmetric per-channel K scales instead (one code per channel in the K extra row, no
  offsets). ``block_size`` must not exceed ``head_dim`` (the V scales fill one row).

  Writes quantize only the step's new tokens. V never requantizes (each token has its own
  scale). K's per-channel parameters are set by the first tokens written into a block; a later
  token that falls outside a channel's range recomputes that channel's offset and scale from the
  block's values and requantizes that channel's earlier tokens (other channels keep their bytes).
  A block written whole in one prefill chunk is quantized once, from its own range.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from workers.backends.base import Ops
from workers.models.config import ModelConfig
from workers.protocol import SCALE_ROWS, KVCacheDType, KVLayout

_REFERENCE_OPS = Ops()  # writes K/V when the caller gives no backend's ops

logger = logging.getLogger(__name__)

_QMAX = {KVCacheDType.INT8.value: 127.0, KVCacheDType.FP8.value: 448.0}  # the largest code of each
_FP8_MAX = 448.0  # float8_e4m3fn: K offsets
SCALE_CODE_STEPS = 8  # scale code c: s = 2 ** (c / 8 - 24)
SCALE_CODE_BIAS = 24
K_STEP_CODES = 2  # one 4-bit K channel step = 2 scale codes (x 1.19)
K_MAX_STEP = 15


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    kind = KVCacheDType.parse(kv_cache_dtype)
    if not kind.quantized:
        return model_dtype
    return getattr(torch, kind.storage(str(model_dtype).removeprefix("torch.")))


def k_offsets_fit(block_size: int, head_dim: int) -> bool:
    """Whether a head's V extra row holds V's per-token scales plus K's per-channel scale steps
    (one base byte + 4 bits per channel), so that K can be asymmetric (offsets in the K row)."""
    return block_size + 1 + head_dim // 2 <= head_dim


def check_quantized_shape(block_size: int, head_dim: int) -> None:
    if block_size > head_dim or head_dim % 2:
        raise ValueError(
            f"a quantized KV cache keeps one scale byte per token per head in the block's extra row: "
            f"block_size {block_size} must be at most head_dim {head_dim} (and head_dim even); "
            f"use a smaller --block-size or kv_cache_dtype auto"
        )


def scale_granularity(block_size: int, head_dim: int) -> str:
    """One line describing the scales a quantized block of this shape keeps."""
    k = (
        "K per channel with an fp8 offset (asymmetric)"
        if k_offsets_fit(block_size, head_dim)
        else "K per channel (symmetric)"
    )
    return f"{k}, V per token (Hadamard-rotated); one extra row per {block_size}-token block"


def bytes_per_block(model: ModelConfig, block_size: int, kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V, scale row included."""
    storage = kv_storage_dtype(kv_cache_dtype, model_dtype)
    quantized = KVCacheDType.parse(kv_cache_dtype).quantized
    if quantized:
        check_quantized_shape(block_size, model.head_dim)
    rows = block_size + (SCALE_ROWS if quantized else 0)
    element = torch.empty((), dtype=storage).element_size()
    return rows * model.kv_bytes_per_token(element)


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


def decode_scale(codes: torch.Tensor) -> torch.Tensor:
    """Scale codes (any integer dtype, 0..255) -> float32 scales."""
    return _lookup(_table(codes.device, "scale"), codes)


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` (index_select with int32 indices: faster than advanced indexing)."""
    flat = torch.index_select(table, 0, index.reshape(-1).to(torch.int32))
    return flat.view(*index.shape, *table.shape[1:])


def encode_scale(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales -> the smallest codes whose scale is at least as large (int64, 0..255;
    past the largest scale, 255)."""
    return torch.searchsorted(_table(scale.device, "scale"), scale.contiguous()).clamp_(max=255)


@functools.lru_cache(maxsize=16)
def _table(device: torch.device, kind: str) -> torch.Tensor:
    """Lookup tables (an index is cheaper than exp2 or a float8 cast on CPU): "scale": code ->
    scale (256); "e4m3": byte -> its float8_e4m3fn value (256); "steps": a byte of two packed K
    channel steps -> their two scale factors relative to the head's base ([256, 2])."""
    if kind == "scale":
        codes = torch.arange(256, dtype=torch.float64)
        return torch.exp2(codes / SCALE_CODE_STEPS - SCALE_CODE_BIAS).to(torch.float32).to(device)
    if kind == "e4m3":
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        return codes.view(torch.float8_e4m3fn).to(torch.float32).to(device)
    byte = torch.arange(256, dtype=torch.int64)
    steps = torch.stack((byte & 15, byte >> 4), dim=-1).to(torch.float64)
    return torch.exp2(-K_STEP_CODES * steps / SCALE_CODE_STEPS).to(torch.float32).to(device)


@functools.lru_cache(maxsize=8)
def _hadamard(dim: int) -> torch.Tensor:
    """A fixed orthonormal ``[dim, dim]`` float32 matrix: Sylvester-Hadamard blocks along the
    binary expansion of ``dim`` (block-diagonal), rows with pseudo-random fixed signs. The same
    on every worker: it is built from integers, not from a random generator."""
    h = torch.zeros(dim, dim, dtype=torch.float64)
    start, size = 0, 1 << (dim.bit_length() - 1)
    while start < dim:
        while size > dim - start:
            size >>= 1
        block = torch.ones(1, 1, dtype=torch.float64)
        while block.shape[0] < size:
            block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
        h[start : start + size, start : start + size] = block / math.sqrt(size)
        start += size
    signs = torch.tensor([1.0 if ((i * 2654435761) >> 13) & 1 else -1.0 for i in range(dim)], dtype=torch.float64)
    return (signs[:, None] * h).to(torch.float32)


@dataclass(slots=True)
class BlockWrites:
    """The blocks behind a quantized cache's slots: tokens of one sequence are consecutive and
    write only blocks that sequence owns alone (a shared block is full and never written), so
    blocks are listed per token without sorting."""

    ids: torch.Tensor  # [U] distinct blocks written
    token_block: torch.Tensor  # [T] index into ``ids`` of each token's block
    offsets: torch.Tensor  # [T] each token's row in its block
    held: torch.Tensor  # [U] rows the block already holds (0: its old contents are void)


@dataclass(slots=True)
class KVWritePlan:
    """Which slots a step writes, computed once per step on the host and used by every layer."""

    slots: torch.Tensor  # [T] row in the flat ``[2, num_blocks * rows, ...]`` view
    blocks: BlockWrites | None = None  # a quantized cache's; a full-precision one needs slots only

    @classmethod
    def build(
        cls, block_ids: list[int], offsets: list[int], rows: int, device: torch.device, quantized: bool
    ) -> KVWritePlan:
        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)

        slots = tensor([b * rows + o for b, o in zip(block_ids, offsets)])
        if not quantized:
            return cls(slots)
        blocks: list[int] = []
        held: list[int] = []
        token_block: list[int] = []
        position: dict[int, int] = {}
        for block, offset in zip(block_ids, offsets):
            index = position.get(block)
            if index is None:
                index = position[block] = len(blocks)
                blocks.append(block)
                held.append(offset)  # a sequence writes its tokens in order: the first is the lowest
            token_block.append(index)
        return cls(slots, BlockWrites(tensor(blocks), tensor(token_block), tensor(offsets), tensor(held)))


class PagedKVCache:
    """The cache tensors of every layer and the only code that reads or writes their contents."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: str,
        model_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.kv_cache_dtype = KVCacheDType.parse(kv_cache_dtype)
        self.dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
        self.compute_dtype = model_dtype
        self.quantized = self.kv_cache_dtype.quantized
        self.qmax = _QMAX[self.kv_cache_dtype.value] if self.quantized else 0.0
        # A value fits a scale when it quantizes within half a step of it (int8 rounds to 127
        # up to 127.5; e4m3 has no value past 448).
        self.fit_limit = self.qmax + 0.5 if self.dtype == torch.int8 else self.qmax
        self.num_blocks, self.block_size = num_blocks, block_size
        self.rows = block_size + (SCALE_ROWS if self.quantized else 0)
        self.num_kv_heads, self.head_dim = model.num_kv_heads, model.head_dim
        self.k_offsets = False
        self.rotation: torch.Tensor | None = None  # V is stored as V @ rotation
        if self.quantized:
            check_quantized_shape(block_size, self.head_dim)
            self.k_offsets = k_offsets_fit(block_size, self.head_dim)
            self.rotation = _hadamard(self.head_dim).to(device)
        shape = (2, num_blocks, self.rows, self.num_kv_heads, self.head_dim)
        # Bytes ``gather`` has read from the cache tensors (stored bytes, scale rows included), over
        # the cache's life: what attention copied out of the cache (the flex backend reads none).
        self.bytes_gathered = 0
        self.layers = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(model.num_layers)]
        total = sum(c.numel() * c.element_size() for c in self.layers)
        logger.info(
            "KV cache: %d blocks x %d tokens (%s), %.1f MiB on %s",
            num_blocks,
            block_size,
            self.kv_cache_dtype.value if self.quantized else str(self.dtype).removeprefix("torch."),
            total / 2**20,
            device,
        )

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            len(self.layers), self.block_size, self.num_kv_heads, self.head_dim, str(self.dtype).removeprefix("torch.")
        )

    @property
    def granularity(self) -> str:
        return scale_granularity(self.block_size, self.head_dim) if self.quantized else "none (model dtype)"

    def write_plan(self, block_ids: list[int], offsets: list[int], device: torch.device) -> KVWritePlan:
        return KVWritePlan.build(block_ids, offsets, self.rows, device, self.quantized)

    # ------------------------------------------------------------- parameters
    def _k_params(self, k_meta: torch.Tensor, v_meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel K offsets and scale codes ``[..., H, D]`` from the K and V extra rows
        (uint8 ``[..., H, D]``)."""
        if not self.k_offsets:
            return torch.zeros_like(k_meta, dtype=torch.float32), k_meta.to(torch.int64)
        offsets = _lookup(_table(k_meta.device, "e4m3"), k_meta)
        base = v_meta[..., self.block_size : self.block_size + 1].to(torch.int64)
        packed = v_meta[..., self.block_size + 1 : self.block_size + 1 + self.head_dim // 2].to(torch.int64)
        steps = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)
        return offsets, base - K_STEP_CODES * steps

    def _k_offsets_scales(
        self,
        k_meta: torch.Tensor,
        v_meta: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Per-channel K offsets and scales (float32 ``[..., H, D]``; no offsets for symmetric K),
        by table lookups: what a read needs, in few operations."""
        if not self.k_offsets:
            return None, decode_scale(k_meta)
        offsets = _lookup(_table(k_meta.device, "e4m3"), k_meta)
        base = decode_scale(v_meta[..., self.block_size : self.block_size + 1])
        packed = v_meta[..., self.block_size + 1 : self.block_size + 1 + self.head_dim // 2]
        return offsets, _lookup(_table(k_meta.device, "steps"), packed).flatten(-2).mul_(base)

    def _store_k_params(
        self, k_meta: torch.Tensor, v_meta: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor
    ) -> None:
        """Write K's parameters into the extra rows (uint8 views, in place); ``codes`` must be
        representable (``_k_codes``)."""
        if not self.k_offsets:
            k_meta.copy_(codes.to(torch.uint8))
            return
        k_meta.copy_(offsets.to(torch.float8_e4m3fn).view(torch.uint8))
        base = codes.amax(-1, keepdim=True)
        steps = torch.div(base - codes, K_STEP_CODES, rounding_mode="floor")
        v_meta[..., self.block_size : self.block_size + 1] = base.to(torch.uint8)
        packed = steps[..., 0::2] | (steps[..., 1::2] << 4)
        v_meta[..., self.block_size + 1 : self.block_size + 1 + self.head_dim // 2] = packed.to(torch.uint8)

    def _k_codes(self, codes: torch.Tensor, keep: torch.Tensor, old_base: torch.Tensor) -> torch.Tensor:
        """Round per-channel codes ``[U, H, D]`` up to what base + 4-bit steps can hold. The base
        of a block that keeps channels (``keep``) moves by whole steps from ``old_base`` so that
        kept channels stay exactly representable unless they fall more than 15 steps behind."""
        if not self.k_offsets:
            return codes
        base = codes.amax(-1, keepdim=True)
        kept_any = keep.any(-1, keepdim=True)
        aligned = old_base + K_STEP_CODES * torch.div(
            base - old_base + K_STEP_CODES - 1, K_STEP_CODES, rounding_mode="floor"
        )
        base = torch.where(kept_any, torch.maximum(aligned, old_base), base)
        steps = torch.div(base - codes, K_STEP_CODES, rounding_mode="floor").clamp_(0, K_MAX_STEP)
        return base - K_STEP_CODES * steps

    def _k_range_params(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Offsets and needed scale codes for channel ranges ``[lo, hi]``."""
        if self.k_offsets:
            mid = ((lo + hi) / 2).clamp_(-_FP8_MAX, _FP8_MAX)
            offsets = mid.to(torch.float8_e4m3fn).to(torch.float32)
            radius = torch.maximum(hi - offsets, offsets - lo)
        else:
            offsets = torch.zeros_like(lo)
            radius = torch.maximum(hi.abs(), lo.abs())
        return offsets, encode_scale(radius / self.qmax)

    # ------------------------------------------------------------------ write
    def flat(self, layer: int) -> torch.Tensor:
        """A full-precision layer's ``[2, slots, heads, dim]`` view: K's plane, then V's, one row a slot."""
        return self.layers[layer].view(2, -1, self.num_kv_heads, self.head_dim)

    def write(self, layer: int, plan: KVWritePlan, k: torch.Tensor, v: torch.Tensor, ops: Ops | None = None) -> None:
        """Store the step's new K and V (``[T, heads, dim]``) at ``plan.slots`` (a full-precision
        cache through ``ops.kv_write``: the backend's, the reference's by default)."""
        if not self.quantized:
            (ops or _REFERENCE_OPS).kv_write(self.flat(layer), plan.slots, k, v)
            return
        writes, rotation = plan.blocks, self.rotation
        if writes is None or rotation is None:  # a quantized cache has a rotation, its plans blocks
            raise ValueError("a quantized cache writes with a plan from its own write_plan()")
        # Quantized elements are one byte: blocks are read and written back as uint8, which every
        # index op supports (CPU has no index_copy_ for float8), as 16-byte rows where possible.
        raw = self.layers[layer].view(torch.uint8)
        wide = as_wide_rows(raw)
        blocks = (
            wide.index_select(1, writes.ids).view(torch.uint8).view(2, -1, self.rows, self.num_kv_heads, self.head_dim)
        )  # [2, U, rows, H, D], a copy
        bs = self.block_size
        tb, off = writes.token_block, writes.offsets
        k_meta, v_meta = blocks[0, :, bs], blocks[1, :, bs]  # [U, H, D] views into the copy

        # V: one scale per token per head, after the rotation; nothing already stored changes.
        v_rot = v.to(torch.float32) @ rotation
        v_codes = encode_scale(v_rot.abs().amax(-1) / self.qmax)  # [T, H]
        blocks[1, tb, off] = self._quantize(v_rot / decode_scale(v_codes)[..., None])
        blocks[1, tb, bs, :, off] = v_codes.to(torch.uint8)

        # K: per-channel parameters per block; channels whose range a new token leaves are
        # recomputed over the block's values, and their earlier tokens requantized.
        k = k.to(torch.float32)
        old_offsets, old_codes = self._k_params(k_meta, v_meta)  # [U, H, D]
        old_scales = decode_scale(old_codes)
        fresh = (writes.held == 0)[:, None, None]
        misfit = torch.zeros(blocks.shape[1], bs, self.num_kv_heads, self.head_dim, dtype=torch.bool, device=k.device)
        misfit[tb, off] = (k - old_offsets[tb]).abs_() > old_scales[tb] * self.fit_limit
        keep = ~fresh & ~misfit.any(1)
        held = torch.arange(bs, device=k.device)[None, :] < writes.held[:, None]  # [U, bs] rows already there
        values = self._dequantize(blocks[0, :, :bs]).mul_(old_scales[:, None]).add_(old_offsets[:, None])
        held_values = values.clone()
        values[tb, off] = k
        valid = held.clone()
        valid[tb, off] = True
        invalid = ~valid[..., None, None]
        lo = values.masked_fill(invalid, math.inf).amin(1)
        hi = values.masked_fill(invalid, -math.inf).amax(1)
        range_offsets, range_codes = self._k_range_params(lo, hi)
        offsets = torch.where(keep, old_offsets, range_offsets)
        old_base = old_codes.amax(-1, keepdim=True) if self.k_offsets else old_codes
        codes = self._k_codes(torch.where(keep, old_codes, range_codes), keep, old_base)
        scales = decode_scale(codes)
        stale = ~fresh & ((codes != old_codes) | (offsets != old_offsets))  # [U, H, D]
        redo = stale[:, None] & held[..., None, None]
        if raw.device.type != "cpu" or bool(redo.any()):
            requant = self._quantize((held_values - offsets[:, None]) / scales[:, None])
            blocks[0, :, :bs] = torch.where(redo, requant, blocks[0, :, :bs])
        blocks[0, tb, off] = self._quantize((k - offsets[tb]) / scales[tb])
        self._store_k_params(k_meta, v_meta, offsets, codes)
        wide.index_copy_(1, writes.ids, as_wide_rows(blocks))

    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Scaled float32 values -> the storage dtype, returned as its bytes (uint8)."""
        if self.dtype == torch.int8:
            return x.round_().clamp_(-self.qmax, self.qmax).to(torch.int8).view(torch.uint8)
        return x.clamp_(-self.qmax, self.qmax).to(self.dtype).view(torch.uint8)

    def _dequantize(self, raw: torch.Tensor) -> torch.Tensor:
        """Stored bytes (uint8) -> float32 quantized values (before scaling)."""
        if self.dtype == torch.float8_e4m3fn and raw.device.type == "cpu":
            # CPU's float8 -> float32 cast is slow: a 256-entry table lookup is faster
            return _lookup(_table(raw.device, "e4m3"), raw)
        return raw.view(self.dtype).to(torch.float32)

    # ------------------------------------------------------------------- read
    def gather(self, layer: int, block_tables: torch.Tensor, rotated_values: bool = False) -> torch.Tensor:
        """K and V of the blocks in ``block_tables`` (``[..., n]``) as ``[2, ..., n * block_size, H, D]``
        in the compute dtype.

        With ``rotated_values`` a quantized cache returns V as stored, ``V @ rotation``: attention
        then multiplies its output by ``rotation^T`` (``unrotate_values``), which costs far less
        than un-rotating every gathered value.
        """
        cache = self.layers[layer]
        lead = block_tables.shape
        block_shape = (self.rows, self.num_kv_heads, self.head_dim)
        raw = as_wide_rows(cache.view(torch.uint8) if self.quantized else cache)[:, block_tables]
        self.bytes_gathered += raw.numel() * raw.element_size()
        if not self.quantized:
            blocks = raw.view(cache.dtype).view(2, *lead, *block_shape)
            return blocks.reshape(2, *lead[:-1], lead[-1] * self.block_size, self.num_kv_heads, self.head_dim)
        blocks = raw.view(torch.uint8).view(2, *lead, *block_shape)
        bs = self.block_size
        k_meta, v_meta = blocks[0, ..., bs, :, :], blocks[1, ..., bs, :, :]  # [..., n, H, D]
        offsets, scales = self._k_offsets_scales(k_meta, v_meta)
        v_scales = decode_scale(v_meta[..., :bs]).transpose(-1, -2)  # [..., n, bs, H]
        out = self._dequantize(blocks[..., :bs, :, :])  # [2, ..., n, bs, H, D], scales applied in fp32
        out[0].mul_(scales.unsqueeze(-3))
        if offsets is not None:
            out[0].add_(offsets.unsqueeze(-3))
        out[1].mul_(v_scales.unsqueeze(-1))
        if not rotated_values:
            out[1] = self.unrotate_values(out[1])
        return out.to(self.compute_dtype).reshape(2, *lead[:-1], lead[-1] * bs, self.num_kv_heads, self.head_dim)

    def unrotate_values(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output over ``gather(..., rotated_values=True)`` (last dim head_dim) back to
        the model's basis."""
        if self.rotation is None:
            return out
        return (out.to(torch.float32) @ self.rotation.T).to(out.dtype)
