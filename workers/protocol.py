"""Typed messages that cross process boundaries between ingress, prefill and decode workers.

Every message is a frozen dataclass of plain data (ints, floats, strs, tuples, nested messages),
never a tensor, so it can travel as a Ray argument, or as JSON over HTTP/Redis through
``to_dict``/``from_dict`` without pickle. This module imports no torch and no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# Element sizes of the KV dtypes a worker may run with, by torch's short dtype name.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
# Quantized KV dtypes: each block carries one extra row holding its per-head scales (K and V),
# so a block is self-contained wherever it is cached, gathered or transferred.
QUANTIZED_DTYPES = frozenset({"int8", "float8_e4m3fn", "float8_e5m2"})
SCALE_ROWS = 1

TRANSPORTS = ("auto", "nccl", "gloo", "gloo_staged", "object_store")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # the model's dtype | int8 / float8_e4m3fn with block scales


def _require(data: dict[str, Any], cls: type) -> None:
    missing = [f.name for f in fields(cls) if f.name not in data]
    if missing:
        raise ValueError(f"{cls.__name__} message is missing fields {missing}")


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of a worker's paged KV cache: per layer ``[2, num_blocks, rows_per_block, heads, dim]``.

    ``rows_per_block`` is ``block_size`` tokens, plus ``SCALE_ROWS`` for a quantized dtype.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def rows_per_block(self) -> int:
        return self.block_size + (SCALE_ROWS if self.quantized else 0)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block of one layer: ``[2 (K/V), rows_per_block, heads, head_dim]``."""
        return (2, self.rows_per_block, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies summed over all layers, K and V (scales included)."""
        k_and_v = 2 * self.rows_per_block * self.num_kv_heads * self.head_dim
        return self.num_layers * k_and_v * DTYPE_SIZES[self.dtype]

    def check_matches(self, other: KVLayout, ours: str = "decode", theirs: str = "prefill") -> None:
        """Raise ValueError naming every field where ``other`` differs from this layout."""
        diffs = [
            f"{f.name} {getattr(self, f.name)} on {ours} but {getattr(other, f.name)} on {theirs}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise ValueError(
                "KV layouts differ: " + "; ".join(diffs)
                + ": start both pools with the same model, --block-size and --kv-cache-dtype"
            )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        _require(data, cls)
        return cls(
            num_layers=int(data["num_layers"]), block_size=int(data["block_size"]),
            num_kv_heads=int(data["num_kv_heads"]), head_dim=int(data["head_dim"]),
            dtype=str(data["dtype"]),
        )


@dataclass(frozen=True, slots=True)
class TransferAddress:
    """Where a prefill worker's pair-group rendezvous store listens, and what device it sends from.

    ``node_id`` plus ``device_uuid`` (or ``device_index`` when no uuid is known) identify the
    sender's GPU, so a receiver on the same GPU picks gloo staging instead of NCCL.
    """

    host: str
    port: int
    worker_id: str
    node_id: str = ""
    device_type: str = "cpu"
    device_index: int = 0
    device_uuid: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferAddress:
        return cls(
            host=str(data["host"]), port=int(data["port"]), worker_id=str(data["worker_id"]),
            node_id=str(data.get("node_id", "")), device_type=str(data.get("device_type", "cpu")),
            device_index=int(data.get("device_index", 0)),
            device_uuid=str(data.get("device_uuid", "")),
        )


@dataclass(frozen=True, slots=True)
class KVHandle:
    """A prefill worker's promise: these blocks hold the request's KV until ``lease_expires_at``.

    ``lease_expires_at`` is wall-clock seconds (``time.time()``); after it the prefill worker may
    free the blocks, so a decode worker must pull and ack before then.
    """

    request_id: str
    prefill_worker_id: str
    address: TransferAddress
    block_ids: tuple[int, ...]
    num_tokens: int
    block_hashes: tuple[str, ...]
    layout: KVLayout
    lease_expires_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prefill_worker_id": self.prefill_worker_id,
            "address": self.address.to_dict(),
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "block_hashes": list(self.block_hashes),
            "layout": self.layout.to_dict(),
            "lease_expires_at": self.lease_expires_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVHandle:
        _require(data, cls)
        return cls(
            request_id=str(data["request_id"]),
            prefill_worker_id=str(data["prefill_worker_id"]),
            address=TransferAddress.from_dict(data["address"]),
            block_ids=_ints(data["block_ids"]),
            num_tokens=int(data["num_tokens"]),
            block_hashes=tuple(str(h) for h in data["block_hashes"]),
            layout=KVLayout.from_dict(data["layout"]),
            lease_expires_at=float(data["lease_expires_at"]),
        )


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Decode -> prefill: send these blocks of ``request_id`` to me over pair ``epoch``.

    The decode side (the receiver) chooses ``epoch``; the prefill side creates or reuses the pair
    group ``pair/{decode_worker_id}/{epoch}`` to match. ``tag`` is the gloo message tag both sides
    use, so a send can never land in a recv posted for another request.
    """

    request_id: str
    decode_worker_id: str
    epoch: int
    src_block_ids: tuple[int, ...]
    layout: KVLayout
    transport: str
    tag: int

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not one of {TRANSPORTS}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "decode_worker_id": self.decode_worker_id,
            "epoch": self.epoch,
            "src_block_ids": list(self.src_block_ids),
            "layout": self.layout.to_dict(),
            "transport": self.transport,
            "tag": self.tag,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferRequest:
        _require(data, cls)
        return cls(
            request_id=str(data["request_id"]),
            decode_worker_id=str(data["decode_worker_id"]),
            epoch=int(data["epoch"]),
            src_block_ids=_ints(data["src_block_ids"]),
            layout=KVLayout.from_dict(data["layout"]),
            transport=str(data["transport"]),
            tag=int(data["tag"]),
        )


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """Prefill -> ingress/decode: the first token and where the prompt's KV can be pulled from.

    ``kv_handle`` is None when the request finished at its first token (nothing to decode).
    """

    request_id: str
    first_token_id: int
    prompt_token_ids: tuple[int, ...]
    kv_handle: KVHandle | None
    num_cached_tokens: int
    finish_reason: str | None = None
    first_token_logprob: float | None = None
    first_token_top_logprobs: tuple[tuple[int, float], ...] = ()
    timing: dict[str, float] | None = None  # prefill_queue_s, prefill_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "first_token_id": self.first_token_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "kv_handle": None if self.kv_handle is None else self.kv_handle.to_dict(),
            "num_cached_tokens": self.num_cached_tokens,
            "finish_reason": self.finish_reason,
            "first_token_logprob": self.first_token_logprob,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefillResult:
        handle = data.get("kv_handle")
        logprob = data.get("first_token_logprob")
        return cls(
            request_id=str(data["request_id"]),
            first_token_id=int(data["first_token_id"]),
            prompt_token_ids=_ints(data["prompt_token_ids"]),
            kv_handle=None if handle is None else KVHandle.from_dict(handle),
            num_cached_tokens=int(data["num_cached_tokens"]),
            finish_reason=data.get("finish_reason"),
            first_token_logprob=None if logprob is None else float(logprob),
        )


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one transfer moved and how long it took, for metrics and per-request usage."""

    request_id: str
    peer_id: str
    transport: str
    epoch: int
    num_blocks: int
    num_bytes: int
    seconds: float
    created_pair: bool

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferStats:
        _require(data, cls)
        return cls(**{f.name: data[f.name] for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Ingress -> worker: one sequence to generate (one choice of an OpenAI request).

    ``sampling`` holds ``SamplingParams`` fields as plain data. ``block_hashes`` (hex) are the
    prompt's chained block hashes, computed once by the ingress for routing. ``target_replica``
    pins the call to one replica (used for calls that must reach the worker holding a lease).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: dict[str, Any]
    cache_salt: str | None = None
    block_hashes: tuple[str, ...] = ()
    arrival_time: float = 0.0  # wall clock at the ingress, for queue-time metrics

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
            "sampling": dict(self.sampling), "cache_salt": self.cache_salt,
            "block_hashes": list(self.block_hashes), "arrival_time": self.arrival_time,
        }


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Worker -> ingress: tokens generated since the last chunk of one sequence."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    timing: dict[str, float] | None = None  # set on the last chunk: per-request phases
