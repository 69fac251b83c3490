"""The boundary between the model/engine and everything device-specific.

The model (``workers/models/llama.py``) computes through a backend's ``Ops`` (the elementwise
ops) and the attention object the backend makes for each step; the engine asks the backend how
to prepare the linears, whether a fast decode path exists, which torch threads a step runs on
and how its device's memory is measured for the KV cache's plan. Nothing above this layer
names a device kernel.

Lifetime: a backend is chosen once per engine (``workers.backends.select``) and logged once; it
is immutable afterwards. Its ``Ops`` are shared by every module of the model and hold no state
of a step.

Contract: every backend computes what ``reference`` computes. Where a backend claims bit-exactness
with the reference (the CPU backend's elementwise kernels do), the conformance tests check bits;
elsewhere they check greedy tokens against transformers.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch import nn

    from workers.engine.config import EngineConfig
    from workers.engine.memory_plan import MemoryProbe
    from workers.layers.kv_cache import PagedKVCache
    from workers.layers.paged_attention import AttentionMetadata, PagedAttention

logger = logging.getLogger(__name__)


class Ops:
    """The model's elementwise ops in plain torch, in transformers' order of operations (fp32
    norms and rotary tables): the specification. Backends override what they run faster."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # one op, bit for bit transformers' arithmetic in fp32 (tests/unit/test_engine_parity.py)
            return F.rms_norm(x, weight.shape, weight, eps)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)  # transformers' rounding: to the input's dtype, then the weight

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, rms_norm(x + residual))``: a residual add and the norm after it."""
        h = x + residual
        return h, self.rms_norm(h, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x`` ``[T, heads, D]`` with ``cos``/``sin`` ``[T, 1, D]``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the gate and up projections side by side ``[T, 2 * inner]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def kv_write(self, flat: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k`` and ``v`` ``[T, heads, dim]`` at ``slots`` of a full-precision layer's
        ``[2, slots, heads, dim]`` view."""
        flat[0].index_copy_(0, slots, k.to(flat.dtype))
        flat[1].index_copy_(0, slots, v.to(flat.dtype))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximal index, ``[N]`` int64 on the CPU."""
        return logits.argmax(dim=-1).cpu()

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
        """Structured outputs' mask, in place: ``logits[r, t] = -inf`` for each row ``r`` of
        ``rows`` where bit ``t % 32`` of ``bitmask[r, t // 32]`` (int32, on the CPU) is clear,
        and for every ``t >= vocab`` (padding past the grammar's vocabulary)."""
        index = torch.tensor(rows, device=logits.device)
        words = bitmask[torch.tensor(rows)].to(logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        width = min(logits.shape[1], vocab)
        banned = ((words[:, :, None] >> shifts) & 1).eq(0).flatten(1)[:, :width]
        block = logits[index]
        block[:, :width].masked_fill_(banned, float("-inf"))
        block[:, width:] = float("-inf")
        logits[index] = block


class LinearImpl(Protocol):
    """A backend's implementation of one linear layer's product (``ParallelLinear.impl``)."""

    def applies(self, x: torch.Tensor) -> bool:
        """Whether ``__call__`` takes ``x`` (else the layer runs ``F.linear``)."""
        ...

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class FusedLinear(Protocol):
    """Linears that read the same input (a layer's q/k/v, or gate/up) multiplied as one: their
    outputs side by side. Set by a backend on the module that names them (``fused_inputs``)."""

    def applies(self, x: torch.Tensor) -> bool: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class FastDecode(ABC):
    """A backend's own way to run a whole decode step (for example without the module tree);
    it must return exactly what the model's forward returns (checked by the conformance tests)."""

    @abstractmethod
    def takes(self, input_ids: torch.Tensor, attn: PagedAttention) -> bool:
        """Whether this step runs here."""

    @abstractmethod
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        """Hidden states after the final norm, ``[rows, hidden]``."""


@dataclass(frozen=True)
class StepThreads:
    """The torch threads of a step by its kind; None anywhere: the process's own count."""

    prefill: int | None = None
    small_batch: int | None = None
    small_batch_max_seqs: int = 4

    @property
    def switches(self) -> bool:
        """Whether some step runs on a count of its own."""
        return self.prefill is not None or self.small_batch is not None

    def for_step(self, num_prefills: int, num_decodes: int) -> int | None:
        """``prefill`` for a step with prompt tokens, ``small_batch`` for a decode-only step of at
        most ``small_batch_max_seqs`` sequences; else None."""
        if num_prefills:
            return self.prefill
        if num_decodes <= self.small_batch_max_seqs:
            return self.small_batch
        return None


AttentionFactory = Callable[["PagedKVCache | None", "AttentionMetadata", float], "PagedAttention"]


class Backend:
    """One device's implementation of everything under the model (module docstring)."""

    name: ClassVar[str]
    # The attention implementations this backend offers ("auto" picks ``default_attention``).
    attention_kinds: ClassVar[tuple[str, ...]] = ("sdpa",)

    def __init__(self, device: torch.device, config: EngineConfig) -> None:
        self.device = device
        self.config = config
        self.ops = self.make_ops()

    # -------------------------------------------------------------- what the model computes with
    def make_ops(self) -> Ops:
        return Ops()

    def attention_kind(self, kv: PagedKVCache) -> str:
        """The attention implementation for ``kv``: the configured one, or this backend's choice."""
        kind = self.config.attention_backend
        if kind == "auto":
            return self.default_attention(kv)
        if kind not in self.attention_kinds:
            raise ValueError(
                f"attention_backend={kind!r} is not offered by the {self.name} backend: "
                f"choose one of auto, {', '.join(self.attention_kinds)}"
            )
        return kind

    def default_attention(self, kv: PagedKVCache) -> str:
        return "sdpa"

    def attention(self, kind: str, kv: PagedKVCache, window: int | None) -> AttentionFactory:
        """What makes a step's attention object for ``kind`` (one of ``attention_kinds``) over
        ``kv`` with sliding ``window`` (None: full attention). Here the kinds every device runs
        the same way: "flex" (FlexAttention over the cache) and "sdpa" (gather + SDPA, the
        reference); backends add their own."""
        from workers.layers.paged_attention import FlexPagedAttention, PagedAttention

        return functools.partial(FlexPagedAttention if kind == "flex" else PagedAttention, ops=self.ops)

    def warm_up_attention(
        self, kind: str, kv: PagedKVCache, scale: float, num_q_heads: int, window: int | None
    ) -> None:
        """Build or compile what ``kind`` runs now, not in the first request."""
        if kind == "flex":
            from workers.layers.paged_attention import warm_up_flex

            warm_up_flex(kv, scale, num_q_heads, window)

    # -------------------------------------------------------------- what the engine asks
    def prepare_process(self) -> None:
        """Once per process, before the model's first allocation."""
        return None

    def prepare_model(self, model: nn.Module, dtype: torch.dtype) -> None:
        """After the weights are loaded: prepare the linears (``prepare_linears``) and build and
        check what steps will run, at load rather than in the first request."""
        self.prepare_linears(model)

    def prepare_linears(self, model: nn.Module) -> None:
        """Give the model's linears this backend's implementation (log what was chosen)."""
        return None

    def linears_summary(self) -> str:
        """How the prepared linears multiply, for the replica's ready line ("" when plain)."""
        return ""

    def fast_decode(self, model: nn.Module) -> FastDecode | None:
        """A whole-step decode path for ``model``, or None: steps run the modules."""
        return None

    def step_threads(self) -> StepThreads:
        return StepThreads()

    def memory_probe(self) -> MemoryProbe | None:
        """How the engine's memory plan measures this device (workers/engine/memory_plan.py): on
        a GPU through its allocator and driver (a profile run sizes the KV cache from
        ``gpu_memory_utilization``); None elsewhere: the KV cache gets ``kv_cache_memory_gib`` of
        host memory, nothing profiled."""
        if self.device.type == "cuda":
            from workers.backends.cuda.backend import CUDAMemoryProbe

            return CUDAMemoryProbe(self.device)
        return None

    def describe(self) -> str:
        """The one line logged when the engine chooses this backend."""
        return f"{self.name} backend on {self.device}"
