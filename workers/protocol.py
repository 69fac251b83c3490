"""Typed messages that cross process boundaries between ingress, prefill and decode workers.

Every message is a frozen dataclass of plain data (ints, floats, strs, tuples, nested messages),
never a tensor, so it can travel as a Ray argument, or as JSON (the KV control channel, the
benchmarks' pipes) through one generic codec, ``encode``/``decode``: pydantic validates the
JSON against the dataclass's own annotations (and runs its ``__post_init__`` checks), so there
is no hand-written field list to drift and no pickle. This module imports no torch and no Ray.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, fields
from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, PlainSerializer, TypeAdapter

M = TypeVar("M")

# A block hash (16 bytes, kvstore.hashing): bytes in every message, hex only in JSON (and, in
# kvstore, in Redis keys, the one place a string is needed).
HashBytes = Annotated[
    bytes,
    BeforeValidator(lambda v: bytes.fromhex(v) if isinstance(v, str) else v),
    PlainSerializer(lambda b: b.hex(), return_type=str, when_used="json"),
]

# Element sizes of the KV dtypes a worker may run with, by torch's short dtype name.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
# Quantized KV dtypes: each block carries one extra row holding its per-head scales (K and V),
# so a block is self-contained wherever it is cached, gathered or transferred.
QUANTIZED_DTYPES = frozenset({"int8", "float8_e4m3fn", "float8_e5m2"})
SCALE_ROWS = 1


class Transport(str, enum.Enum):
    """How blocks move between a prefill and a decode worker (the one list of transports).

    AUTO: gloo for CPU tensors; NCCL for CUDA tensors unless both ranks sit on the same GPU (NCCL
    refuses that), then GLOO_STAGED. GLOO_STAGED: gather on the GPU, copy to pinned host memory,
    gloo send, copy back. OBJECT_STORE: ``ray.put``/``ray.get`` of the gathered buffer, between
    Ray actors that pass the buffer's ref to each other (the library level and the transfer
    benchmark's baseline); pdserve's pools do not offer it, since their control path is not a
    Ray call (``workers/transfer/control.py``).
    """

    AUTO = "auto"
    NCCL = "nccl"
    GLOO = "gloo"
    GLOO_STAGED = "gloo_staged"
    OBJECT_STORE = "object_store"


TRANSPORTS = tuple(t.value for t in Transport)


class KVCacheDType(str, enum.Enum):
    """``--kv-cache-dtype``, parsed once where it enters (the CLI, ``PDServeArgs``, ``EngineConfig``).

    AUTO keeps the model's dtype; INT8 and FP8 (float8_e4m3fn) store one byte per value with the
    block's scales in one extra row (``workers/layers/kv_cache.py``).
    """

    AUTO = "auto"
    INT8 = "int8"
    FP8 = "fp8"

    def __str__(self) -> str:  # the option as written, in messages and f-strings (as StrEnum does)
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value: str) -> KVCacheDType:
        """``value`` as the enum; ValueError naming the choices for anything else."""
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={value!r} must be one of {KV_CACHE_DTYPES}")
        return cls(value)

    @property
    def quantized(self) -> bool:
        return self is not KVCacheDType.AUTO

    def storage(self, model_dtype: str) -> str:
        """The dtype the cache stores, by torch's short name (``model_dtype`` for AUTO)."""
        return {KVCacheDType.INT8: "int8", KVCacheDType.FP8: "float8_e4m3fn"}.get(self, model_dtype)


KV_CACHE_DTYPES = tuple(d.value for d in KVCacheDType)


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def encode(message: Any) -> bytes:
    """A message (any dataclass of this module, or plain data) as JSON bytes."""
    return _adapter(type(message)).dump_json(message)  # type: ignore[arg-type]  # types hash: python/mypy#11470


def decode(cls: type[M], data: bytes | str) -> M:
    """The ``cls`` message ``encode`` wrote; ValueError (pydantic's ValidationError) naming the
    field for anything else."""
    return _adapter(cls).validate_json(data)  # type: ignore[arg-type]  # types hash: python/mypy#11470


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
                "KV layouts differ: "
                + "; ".join(diffs)
                + ": start both pools with the same model, --block-size and --kv-cache-dtype"
            )


@dataclass(frozen=True, slots=True)
class TransferAddress:
    """Where a prefill worker's pair-group rendezvous store (``port``) and its KV control server
    (``control_port``) listen, and what device it sends from.

    ``generation`` is drawn afresh each time a worker starts: a peer that sees a new generation
    at a known worker id knows the process restarted, so any pair group with the old one is dead.
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
    control_port: int = 0  # 0: no control server (a library-level sender)
    generation: int = 0


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
    layout: KVLayout
    lease_expires_at: float
    # A tensor-parallel prefill replica: its size, and each rank's rendezvous store (index =
    # rank; empty at size 1). ``layout`` is then the whole model's: every KV head, all ranks.
    tensor_parallel_size: int = 1
    rank_addresses: tuple[TransferAddress, ...] = ()

    def __post_init__(self) -> None:
        if self.tensor_parallel_size > 1 and len(self.rank_addresses) != self.tensor_parallel_size:
            raise ValueError(
                f"KVHandle of a tensor-parallel size {self.tensor_parallel_size} replica names "
                f"{len(self.rank_addresses)} rank addresses; it needs one per rank"
            )


@dataclass(frozen=True, slots=True)
class PairTransfer:
    """One (prefill rank, decode rank) pair's part of a transfer between tensor-parallel replicas
    (``workers/transfer/tp_transfer.py``): the pair group's epoch and transport (the decode side
    chooses both, per pair), and the prefill rank's local KV heads ``[head_start, head_stop)``
    that the decode rank receives."""

    prefill_rank: int
    decode_rank: int
    epoch: int
    transport: str
    head_start: int
    head_stop: int

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not one of {TRANSPORTS}")
        if not 0 <= self.head_start < self.head_stop:
            raise ValueError(f"pair heads [{self.head_start}, {self.head_stop}) are not a run of heads")


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Decode -> prefill: send these blocks of ``request_id`` to me over pair ``epoch``.

    The decode side (the receiver) chooses ``epoch``; the prefill side creates or reuses the pair
    group ``pair/{decode_worker_id}/{epoch}`` to match. ``tag`` is the gloo message tag both sides
    use, so a send can never land in a recv posted for another request.

    ``pairs`` (tensor-parallel replicas on either side): the transfer is one message per
    (prefill rank, decode rank) pair instead, each over its own group (``epoch`` and
    ``transport`` are then the pairs'); ``layout`` is the whole model's.
    """

    request_id: str
    decode_worker_id: str
    epoch: int
    src_block_ids: tuple[int, ...]
    layout: KVLayout
    transport: str
    tag: int
    pairs: tuple[PairTransfer, ...] = ()
    checksum: bool = True  # each block's checksum follows the blocks (workers/transfer/checksum.py)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not one of {TRANSPORTS}")


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
    rank_bytes: tuple[int, ...] = ()  # tensor-parallel decode replica: bytes each rank received


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Ingress -> worker: one sequence to generate (one choice of an OpenAI request).

    ``sampling`` holds ``SamplingParams`` fields as plain data. ``block_hashes`` are the
    prompt's chained block hashes, computed once by the ingress for routing, as the bytes the
    prefix index takes (the routers pass them on as they are).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: dict[str, Any]
    cache_salt: str | None = None
    block_hashes: tuple[HashBytes, ...] = ()
    arrival_time: float = 0.0  # wall clock at the ingress, for queue-time metrics
    # decode workers the decode router ranks last: those a continuation left because they retire
    avoid_workers: tuple[str, ...] = ()
    # host:port of the ingress's output sink: the worker sends this request's chunks there, with
    # the same step's chunks of that ingress's other requests (workers/output_channel.py); None:
    # on the call's own stream
    output_address: str | None = None


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
    worker_id: str | None = None  # the replica that produced it (the ingress knows whom it lost)
    # the stream's last chunk from a decode replica Serve is stopping: no tokens; the rest of the
    # request resumes elsewhere (a chunk, not an error: Serve logs a failed call's traceback)
    retiring: bool = False
    # the stream's last chunk from a decode replica that moved it live: no tokens; another decode
    # replica pulls the KV named here and goes on from its first token (the last one sent)
    handoff: PrefillResult | None = None
