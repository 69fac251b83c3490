"""The memory plan: what a replica's device holds beside the KV cache, and the blocks left for it.

One function, ``plan_memory``, does the arithmetic for the engine and for ``pdserve kv-plan``
(``workers/engine/kv_plan.py``); they differ only in where the usage comes from:

- **The engine on a GPU** measures it (``profile_memory``, vLLM's ``profile_run``): after the
  weights load it runs the largest step the configuration allows (``profile_step``) over a
  temporary KV cache and reads the allocator's peak through a ``MemoryProbe``. The temporary
  cache is allocated before the peak is reset, so it never counts as activations, and freed
  before the plan is made.
- **kv-plan** estimates it from the config (``estimate_usage``), no device.
- **The engine on a CPU** plans against ``kv_cache_memory_gib`` (``budget_usage``): that budget
  is the KV cache's alone, so nothing is subtracted from it and nothing is profiled.

The budget on a GPU is ``gpu_memory_utilization`` of the device (capped at what was free before
this replica loaded anything: a replica sharing the GPU gets its own share, as in vLLM), and the
KV cache gets what is left of it after

- the weights (what loading allocated, rotary tables included),
- the activation peak of the largest step,
- KV transfer staging (``staging_bytes``),
- CUDA graphs (``graph_bytes``, with ``enforce_eager=False``),
- NCCL communicators made after the plan (``communicator_bytes``: the pair groups of KV
  transfers; the tensor-parallel group's is made by the profile's first collective and measured
  in "other"),
- other memory the profile grew outside torch's allocator (library workspaces, communicators).

A plan with fewer blocks than one sequence needs is refused (``MemoryPlan.check``): an engine
that starts but cannot hold the longest request it accepts fails later, under load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from workers.layers.kv_cache import bytes_per_block
from workers.models.config import ModelConfig
from workers.protocol import KVCacheDType

if TYPE_CHECKING:
    from workers.backends.base import Backend
    from workers.engine.config import EngineConfig
    from workers.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

GIB = 2**30
MIB = 2**20
KIB = 2**10

# KV transfers a replica's transfer threads run at once (workers/prefill.py, workers/decode.py,
# workers/transfer/tp_transfer.py): the most staging copies that can exist together.
TRANSFER_THREADS = 16
# NCCL's device memory for one communicator (buffers per channel and peer, its device state):
# an estimate; ``EngineConfig.communicator_memory_mib`` replaces it where it was measured.
COMMUNICATOR_MIB = 256
# One CUDA graph's own device memory beyond its tensors (kernel parameters, the capture's
# workspaces): an estimate, per decode bucket.
CUDA_GRAPH_BYTES_PER_BUCKET = 16 * MIB
# Prompt rows scored at once for prompt logprobs (workers/engine/model_runner.py).
PROMPT_LOGITS_ROWS = 512


class MemoryProbe(Protocol):
    """A device's memory as the plan reads it (CUDA: ``workers/backends/cuda/backend.py``)."""

    def total(self) -> int:
        """Bytes of device memory."""
        ...

    def used(self) -> int:
        """Bytes in use on the device by anything (this process, the driver, other processes),
        after this process's allocator has returned what it caches unused."""
        ...

    def allocated(self) -> int:
        """Bytes of this process's live tensors on the device."""
        ...

    def peak(self) -> int:
        """The most ``allocated()`` has been since ``reset_peak``."""
        ...

    def reset_peak(self) -> None: ...


class MemoryPlanError(RuntimeError):
    """The device cannot hold what the configuration asks for; the message says what to change."""


# ------------------------------------------------------------------------------- the inputs
@dataclass(frozen=True, slots=True)
class MemorySettings:
    """What the plan reads of an engine's configuration (``EngineConfig``'s fields and defaults;
    ``from_config``). kv-plan builds the same from its flags, so the two plan alike."""

    block_size: int = 16
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's own, lowered to what the cache holds
    cuda_graphs: bool = False  # decode steps run as CUDA graphs (enforce_eager=False on a GPU)
    graph_batch_sizes: tuple[int, ...] = ()  # their buckets
    kv_transfer_slots: int = 0
    kv_transfer_peers: int = 0
    communicator_bytes: int = COMMUNICATOR_MIB * MIB  # one NCCL communicator
    cuda_graph_bytes: int | None = None  # None: estimated (``graph_bytes``)

    @classmethod
    def build(
        cls,
        *,
        block_size: int,
        kv_cache_dtype: str,
        gpu_memory_utilization: float,
        tensor_parallel_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int | None,
        cuda_graphs: bool,
        compile_batch_sizes: tuple[int, ...] | None,
        kv_transfer_slots: int,
        kv_transfer_peers: int,
        communicator_memory_mib: int,
        cuda_graph_memory_gib: float | None,
    ) -> MemorySettings:
        """From ``EngineConfig``'s fields, in its units (the engine and kv-plan both come here)."""
        from workers.engine.compiled import decode_buckets

        buckets = tuple(compile_batch_sizes or decode_buckets(max_num_seqs)) if cuda_graphs else ()
        return cls(
            block_size=block_size,
            kv_cache_dtype=KVCacheDType.parse(kv_cache_dtype).value,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            cuda_graphs=cuda_graphs,
            graph_batch_sizes=buckets,
            kv_transfer_slots=kv_transfer_slots,
            kv_transfer_peers=kv_transfer_peers,
            communicator_bytes=communicator_memory_mib * MIB,
            cuda_graph_bytes=None if cuda_graph_memory_gib is None else int(cuda_graph_memory_gib * GIB),
        )

    @classmethod
    def from_config(cls, config: EngineConfig, device: torch.device) -> MemorySettings:
        """An engine's settings on ``device`` (CUDA graphs only on a GPU)."""
        return cls.build(
            block_size=config.block_size,
            kv_cache_dtype=config.kv_cache_dtype,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=config.tensor_parallel_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            cuda_graphs=not config.enforce_eager and device.type == "cuda",
            compile_batch_sizes=config.compile_batch_sizes,
            kv_transfer_slots=config.kv_transfer_slots,
            kv_transfer_peers=config.kv_transfer_peers,
            communicator_memory_mib=config.communicator_memory_mib,
            cuda_graph_memory_gib=config.cuda_graph_memory_gib,
        )

    def context(self, model: ModelConfig) -> int:
        """The longest sequence the engine plans for (``max_model_len``, else the model's)."""
        return self.max_model_len or model.max_position_embeddings


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """What the device holds or needs beside the KV cache: measured (``profile_memory``),
    estimated (``estimate_usage``) or, for a KV-only budget, nothing (``budget_usage``)."""

    source: str  # "profile", "estimate" or "budget"
    budget_bytes: int  # what the weights, the step, the reserves and the KV cache share
    budget: str  # how that budget was set, for the plan's line
    weight_bytes: int = 0
    activation_bytes: int = 0
    other_bytes: int = 0
    reserves: bool = True  # staging, graphs and communicators come out of the budget
    capped: bool = False  # the device had less free than the share asked for (``device_budget``)


def device_budget(total_bytes: int, utilization: float, free_at_start: int | None = None) -> tuple[int, str]:
    """``utilization`` of the device, capped at what was free before this replica allocated
    anything (other processes' memory is not this replica's to plan)."""
    share = int(total_bytes * utilization)
    label = f"{utilization:.2f} x {_size(total_bytes)}"
    if free_at_start is not None and free_at_start < share:
        return free_at_start, f"{label} capped at {_size(free_at_start)} free at start"
    return share, label


def budget_usage(kv_cache_memory_gib: float) -> DeviceUsage:
    """A CPU replica's budget: ``kv_cache_memory_gib`` of host memory for the KV cache alone."""
    budget = int(kv_cache_memory_gib * GIB)
    return DeviceUsage("budget", budget, "kv_cache_memory_gib (the KV cache alone)", reserves=False)


# ------------------------------------------------------------------------------- the step
@dataclass(frozen=True, slots=True)
class ProfileStep:
    """The largest step the scheduler can form: ``decodes`` sequences adding one token each and
    one prompt ``chunk`` (0: none), all at the end of a ``context``-token sequence, plus
    ``fresh`` prompts computed from their start when one chunk cannot take the token budget."""

    context: int
    decodes: int
    chunk: int
    fresh: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.decodes + self.chunk + sum(self.fresh)

    @property
    def num_seqs(self) -> int:
        return self.decodes + (1 if self.chunk else 0) + len(self.fresh)

    def new_tokens(self) -> list[tuple[int, int]]:
        """(context after the step, new tokens) of each sequence: decodes, the chunk, fresh prompts."""
        seqs = [(self.context, 1)] * self.decodes
        if self.chunk:
            seqs.append((self.context, self.chunk))
        return seqs + [(n, n) for n in self.fresh]

    def written_blocks(self, block_size: int) -> int:
        """Blocks the step's new tokens fall in (each sequence its own)."""
        return sum((ctx - 1) // block_size - (ctx - new) // block_size + 1 for ctx, new in self.new_tokens())


def profile_step(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> ProfileStep:
    """Every slot the step has (``max_num_seqs``, at most one per token) and every token of its
    budget, arranged for the most memory: each sequence samples (the most logit rows), one chunk
    takes all the tokens the others leave (the longest prompt attention), and it and the decodes
    read a whole ``max_model_len`` context (the longest gathers). Tokens one chunk cannot take
    turn decodes into fresh prompts."""
    n = min(max_num_seqs, max_num_batched_tokens)
    chunk = min(max_model_len, max_num_batched_tokens - (n - 1))
    spare = max_num_batched_tokens - (n - 1) - chunk
    others, fresh = n - 1, []
    while spare > 0 and others > 0:
        take = min(max_model_len, spare + 1)
        fresh.append(take)
        spare -= take - 1
        others -= 1
    if chunk == 1:  # one token after a context is a decode
        return ProfileStep(max_model_len, others + 1, 0, tuple(fresh))
    return ProfileStep(max_model_len, others, chunk, tuple(fresh))


# ------------------------------------------------------------------------------- rules
def blocks_per_sequence(context: int, sliding_window: int | None, block_size: int) -> int:
    """Blocks one sequence of ``context`` tokens holds: all of them, or with a sliding window
    shorter than it its window's and the one being written (earlier blocks are freed)."""
    blocks = math.ceil(context / block_size)
    if sliding_window and sliding_window < context:
        blocks = min(blocks, math.ceil(sliding_window / block_size) + 1)
    return blocks


def min_blocks(context: int, sliding_window: int | None, block_size: int) -> int:
    """Blocks the cache needs so that a sequence of ``context`` tokens runs: all of its blocks,
    or with a shorter sliding window the window's plus one chunk's (``assemble.plan_context``
    keeps the window only past ``window // block_size + 2`` blocks)."""
    blocks = math.ceil(context / block_size)
    if sliding_window and sliding_window < context:
        blocks = min(blocks, sliding_window // block_size + 3)
    return blocks


def staging_bytes(settings: MemorySettings, model: ModelConfig, dtype: torch.dtype) -> int:
    """KV transfer staging: a transfer holds one device copy of the blocks it moves (the gather
    before an NCCL send, the buffer an NCCL receive lands in, the device copy of a host-staged
    one: workers/transfer/pair.py), at most one sequence's blocks. The plan reserves
    ``kv_transfer_slots`` such sequences in flight at once (bounded by the transfer threads);
    more at once, or longer, is not covered."""
    slots = min(settings.kv_transfer_slots, TRANSFER_THREADS)
    window = _window(model, settings)
    blocks = blocks_per_sequence(settings.context(model), window, settings.block_size)
    return slots * blocks * _block_bytes(settings, model, dtype)


def graph_bytes(settings: MemorySettings, model: ModelConfig, dtype: torch.dtype) -> int:
    """CUDA graphs of the decode buckets (built after the cache, so reserved here): the
    configured figure, else a bound: the largest bucket's rows through every layer's dense
    pieces (each captured piece's outputs kept in the graphs' pool), its fp32 logits, and a
    fixed cost per graph."""
    if not settings.cuda_graphs:
        return 0
    if settings.cuda_graph_bytes is not None:
        return settings.cuda_graph_bytes
    e = _element(dtype)
    tp = settings.tensor_parallel_size
    h, d, hq, hkv = model.hidden_size, model.head_dim, model.num_heads, model.num_kv_heads
    inner = math.ceil(model.intermediate_size / tp)
    layer_row = e * (2 * h + (hq + 2 * hkv) * d + hq * d + 3 * inner)
    row = model.num_layers * layer_row + 4 * model.vocab_size
    buckets = settings.graph_batch_sizes or (settings.max_num_seqs,)
    return max(buckets) * row + len(buckets) * CUDA_GRAPH_BYTES_PER_BUCKET


def communicator_bytes(settings: MemorySettings) -> int:
    """NCCL communicators made after the plan: one pair group per KV transfer peer."""
    return settings.kv_transfer_peers * settings.communicator_bytes


# ------------------------------------------------------------------------------- the plan
@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """One rank's plan (``plan_memory``): the budget, what is spent of it, the blocks left for
    the KV cache and the fewest one sequence needs (``refusal``)."""

    source: str  # "profile", "estimate" or "budget"
    device: str
    budget_bytes: int
    budget: str  # how the budget was set
    weight_bytes: int
    activation_bytes: int
    staging_bytes: int
    graph_bytes: int
    communicator_bytes: int
    other_bytes: int
    bytes_per_block: int
    block_size: int
    num_blocks: int  # what this plan's budget holds, or the fewest any rank holds (``agreed``)
    min_blocks: int  # what one sequence of ``min_context`` needs
    min_context: int
    settings: MemorySettings
    budget_capped: bool = False  # other processes held part of this replica's share at the start
    limited_by_another_rank: bool = False

    @property
    def kv_bytes(self) -> int:
        """The budget left for the KV cache (negative: over budget before any block)."""
        return self.budget_bytes - (
            self.weight_bytes
            + self.activation_bytes
            + self.staging_bytes
            + self.graph_bytes
            + self.communicator_bytes
            + self.other_bytes
        )

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def agreed(self, num_blocks: int) -> MemoryPlan:
        """The plan with the block count the tensor-parallel ranks agreed on (their fewest)."""
        if num_blocks >= self.num_blocks:
            return self
        return dataclasses.replace(self, num_blocks=num_blocks, limited_by_another_rank=True)

    def line(self) -> str:
        """The plan in one line (logged at start-up)."""
        terms = (
            ("weights", self.weight_bytes),
            ("activation peak", self.activation_bytes),
            ("kv staging", self.staging_bytes),
            ("cuda graphs", self.graph_bytes),
            ("communicators", self.communicator_bytes),
            ("other", self.other_bytes),
        )
        # a budget of the KV cache alone (CPU) subtracts nothing: no terms then
        spent = "".join(f" - {name} {_size(value)}" for name, value in terms if value or self.source != "budget")
        ranks = " (the fewest any tensor-parallel rank holds)" if self.limited_by_another_rank else ""
        return (
            f"memory plan ({self.source}, {self.device}): {self.budget} = {_size(self.budget_bytes)}{spent} = "
            f"KV cache {_size(self.num_blocks * self.bytes_per_block)}: {self.num_blocks} blocks, "
            f"{self.tokens} tokens{ranks}"
        )

    def refusal(self) -> str | None:
        """Why the engine must not start with this plan and what to change (None: it may)."""
        if self.num_blocks >= self.min_blocks:
            return None
        s = self.settings
        held = f"{self.num_blocks} KV blocks ({self.tokens} tokens)"
        if self.limited_by_another_rank:
            held += " on the tensor-parallel rank that holds the fewest"
        context = (
            f"one sequence of max_model_len {self.min_context}"
            if s.max_model_len is not None
            else f"one step's prompt chunk of {self.min_context} tokens"
        )
        fixes = []
        if self.source == "budget":
            fixes.append(f"raise --kv-cache-memory-gib (now {self.budget_bytes / GIB:.4g})")
        elif self.budget_capped:
            fixes.append(
                f"free the device: other processes held part of its --gpu-memory-utilization "
                f"{s.gpu_memory_utilization:g} share when this replica started"
            )
        elif s.gpu_memory_utilization < 1:
            fixes.append(f"raise --gpu-memory-utilization (now {s.gpu_memory_utilization:g})")
        if self.activation_bytes:
            fixes.append(
                f"lower --max-num-batched-tokens (now {s.max_num_batched_tokens}) or --max-num-seqs "
                f"(now {s.max_num_seqs}): the largest step's activations take {_size(self.activation_bytes)}"
            )
        if s.max_model_len is not None:
            fixes.append(f"lower --max-model-len (now {s.max_model_len})")
        else:
            fixes.append("set --max-model-len below the model's own")
        fixes.append(
            f"a larger --tp (now {s.tensor_parallel_size}): each device then holds a share of the weights "
            f"and of every block"
        )
        if not KVCacheDType.parse(s.kv_cache_dtype).quantized:
            fixes.append("--kv-cache-dtype int8 (about half the bytes per block)")
        if self.staging_bytes:
            fixes.append(f"fewer --kv-transfer-slots (now {s.kv_transfer_slots})")
        return (
            f"the KV cache would get {held}, fewer than {context} needs ({self.min_blocks} blocks, "
            f"{_size(self.bytes_per_block * self.min_blocks)}). Change one of: " + "; ".join(fixes)
        )

    def check(self) -> None:
        """Raise MemoryPlanError when the plan is refused: ``refusal``, then the plan's line."""
        problem = self.refusal()
        if problem is not None:
            raise MemoryPlanError(f"{problem}\n{self.line()}")


def plan_memory(
    settings: MemorySettings, model: ModelConfig, dtype: torch.dtype, usage: DeviceUsage, device: str
) -> MemoryPlan:
    """The KV blocks ``usage``'s budget leaves, for one rank of the model (``model``: its local
    heads; ``dtype``: the model's). Pure arithmetic: the engine and kv-plan both end here."""
    reserves = usage.reserves
    per_block = _block_bytes(settings, model, dtype)
    plan = MemoryPlan(
        source=usage.source,
        device=device,
        budget_bytes=usage.budget_bytes,
        budget=usage.budget,
        weight_bytes=usage.weight_bytes,
        activation_bytes=usage.activation_bytes,
        staging_bytes=staging_bytes(settings, model, dtype) if reserves else 0,
        graph_bytes=graph_bytes(settings, model, dtype) if reserves else 0,
        communicator_bytes=communicator_bytes(settings) if reserves else 0,
        other_bytes=usage.other_bytes,
        bytes_per_block=per_block,
        block_size=settings.block_size,
        num_blocks=0,
        min_blocks=0,
        min_context=0,
        settings=settings,
        budget_capped=usage.capped,
    )
    context = settings.context(model)
    # An asked-for max_model_len must fit whole; the model's own is lowered to what the cache
    # holds (assemble.plan_context), though never below one step's longest prompt chunk.
    floor = context if settings.max_model_len is not None else min(context, settings.max_num_batched_tokens)
    return dataclasses.replace(
        plan,
        num_blocks=max(0, plan.kv_bytes // per_block),
        min_blocks=min_blocks(floor, _window(model, settings), settings.block_size),
        min_context=floor,
    )


# ------------------------------------------------------------------------------- kv-plan's estimate
def estimate_usage(
    settings: MemorySettings, model: ModelConfig, dtype: torch.dtype, total_bytes: int, parameter_bytes: int
) -> DeviceUsage:
    """kv-plan's figures for one rank, no device: the parameters (``parameter_bytes``) plus the
    rotary tables loading builds, ``estimate_activation_bytes``, and as "other" the
    tensor-parallel group's communicator. The whole device is this replica's."""
    budget, label = device_budget(total_bytes, settings.gpu_memory_utilization)
    rotary = 2 * settings.context(model) * model.head_dim * 4  # cos and sin, fp32
    return DeviceUsage(
        source="estimate",
        budget_bytes=budget,
        budget=label,
        weight_bytes=parameter_bytes + rotary,
        activation_bytes=estimate_activation_bytes(settings, model, dtype),
        other_bytes=settings.communicator_bytes if settings.tensor_parallel_size > 1 else 0,
    )


def estimate_activation_bytes(settings: MemorySettings, model: ModelConfig, dtype: torch.dtype) -> int:
    """The peak of ``profile_step``'s step, from its largest tensors (one rank: ``model``'s
    local heads, ``1 / tp`` of the MLP). Inside a layer: the residual stream, its norm and a
    block's output ``[T, hidden]``, then the larger of attention (q/k/v, their rotated copies and
    the output, plus the larger context read: the decodes' padded gather with its mask, or the
    chunk's gathered context with its additive mask; a quantized cache dequantizes through
    fp32) and the MLP (gate, up and their product). After the layers: the hidden states and the
    larger of the prompt-logprob slice (logits and log-softmax) and the sampled rows' fp32
    logits (the logits, the processors' copy, the log-softmax for logprobs). SDPA's own
    workspace is not counted; the sdpa gather path is assumed (decodes through 'paged' or
    flash-attn read in place and need less)."""
    step = profile_step(settings.max_num_batched_tokens, settings.max_num_seqs, settings.context(model))
    e = _element(dtype)
    h, d, hq, hkv = model.hidden_size, model.head_dim, model.num_heads, model.num_kv_heads
    inner = math.ceil(model.intermediate_size / settings.tensor_parallel_size)
    tokens, rows, vocab = step.num_tokens, step.num_seqs, model.vocab_size
    window = _window(model, settings)
    read = step.context
    if window is not None:
        read = min(read, (window // settings.block_size + 2) * settings.block_size)
    value = e if not KVCacheDType.parse(settings.kv_cache_dtype).quantized else 1 + 4 + e
    decode_read = step.decodes * read * (2 * hkv * d * value + 1)
    chunk_read = 2 * read * hkv * d * value + step.chunk * read * e if step.chunk < step.context and step.chunk else 0
    attention = tokens * d * e * (3 * hq + 3 * hkv) + max(decode_read, chunk_read)
    mlp = 3 * tokens * inner * e
    layer = 3 * tokens * h * e + max(attention, mlp)
    prompt_rows = min(PROMPT_LOGITS_ROWS, step.chunk)
    after = tokens * h * e + max(2 * prompt_rows * vocab * 4, 3 * rows * vocab * 4)
    return max(layer, after)


# ------------------------------------------------------------------------------- the engine's profile
@dataclass(frozen=True, slots=True)
class ProbeStart:
    """The device before this replica loaded anything (``start_profile``)."""

    total: int
    used: int
    allocated: int


def start_profile(probe: MemoryProbe) -> ProbeStart:
    return ProbeStart(probe.total(), probe.used(), probe.allocated())


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """What ``profile_memory`` read of ``allocated()``: at the start, after loading, with the
    temporary cache in place (the baseline), at the step's peak, and once everything of the step
    was freed; and the device's ``used()`` then."""

    step: ProfileStep
    start: int
    loaded: int
    baseline: int
    peak: int
    after: int
    used_after: int
    temporary_cache_bytes: int


def profile_memory(
    config: EngineConfig,
    model: LlamaForCausalLM,
    backend: Backend,
    rank_model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    probe: MemoryProbe,
    start: ProbeStart,
    sample_rows: bool = True,
) -> tuple[DeviceUsage, ProfileResult]:
    """Run ``profile_step``'s step once through a ``ModelRunner`` over a temporary KV cache
    (and sample its rows when ``sample_rows``: rank 0 samples), measuring through ``probe``.
    Every tensor-parallel rank runs the same step (its collectives match). Nothing of the step
    reaches the engine: its sequences are local and never scheduled."""
    from workers.engine.model_runner import ModelRunner
    from workers.engine.sampler import sample
    from workers.engine.sampling_params import SamplingParams
    from workers.engine.scheduler import ScheduledSeq, SchedulerOutput
    from workers.engine.sequence import Sequence
    from workers.layers.kv_cache import PagedKVCache

    settings = MemorySettings.from_config(config, device)
    loaded = probe.allocated()
    context = settings.context(rank_model)
    window = _window(rank_model, settings)
    step = profile_step(config.max_num_batched_tokens, config.max_num_seqs, context)
    bs = config.block_size
    # Block 0 stands for every block a sequence only reads; each block written is its own.
    num_blocks = 1 + step.written_blocks(bs)
    greedy = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    scored = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, prompt_logprobs=0)
    items: list[ScheduledSeq] = []
    next_block = 1
    for i, (ctx, new) in enumerate(step.new_tokens()):
        is_chunk = bool(step.chunk) and i == step.decodes
        seq = Sequence(f"memory-profile-{i}", [0] * ctx, scored if is_chunk else greedy, arrival_time=0.0)
        table = [0] * -(-ctx // bs)
        for b in range((ctx - new) // bs, (ctx - 1) // bs + 1):
            table[b], next_block = next_block, next_block + 1
        seq.block_table = table
        seq.num_computed_tokens = ctx - new
        if is_chunk:  # positions before the chunk count as scored: the chunk scores its own rows
            seq.prompt_logprobs = [None] * (ctx - new + 1)
        items.append(ScheduledSeq(seq, new))
    out = SchedulerOutput([s for s in items if s.is_decode], [s for s in items if not s.is_decode], 0)
    try:
        with _quiet(logging.getLogger(PagedKVCache.__module__)):  # not the engine's cache: no "KV cache" line
            kv = PagedKVCache(rank_model, num_blocks, bs, config.kv_cache_dtype, dtype, device)
        kept = kv.layers + ([kv.rotation] if kv.rotation is not None else [])
        temporary = sum(t.numel() * t.element_size() for t in kept)
        del kept
        runner = ModelRunner(model, kv, backend, window, None, progress=False)
        baseline = probe.allocated()
        probe.reset_peak()
        logits, sampled, _ = runner.execute(out)
        if sample_rows:
            # a processed copy beside the raw logits, as a request with sampling controls has
            sample(logits.clone(), [item.seq for item in sampled], backend.ops.argmax, raw_logits=logits)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as exc:
        raise MemoryPlanError(
            f"the memory profile's step ({step.num_tokens} tokens over {step.num_seqs} sequences at context "
            f"{context}) ran out of device memory: lower --max-num-batched-tokens (now "
            f"{config.max_num_batched_tokens}), --max-num-seqs (now {config.max_num_seqs}) or --max-model-len "
            f"(now {context}), use a larger --tp, or --attention-backend paged (decodes then gather nothing): {exc}"
        ) from exc
    peak = probe.peak()
    del logits, sampled, runner, kv, out, items
    gc.collect()
    after = probe.allocated()
    used_after = probe.used()
    result = ProfileResult(step, start.allocated, loaded, baseline, peak, after, used_after, temporary)
    if after > loaded:  # e.g. lookup tables a first step caches for the process: they stay
        kept_bytes = _size(after - loaded)
        logger.debug("memory profile: %s stays allocated after its step (counted with the weights)", kept_bytes)
    budget, label = device_budget(start.total, config.gpu_memory_utilization, start.total - start.used)
    usage = DeviceUsage(
        source="profile",
        budget_bytes=budget,
        budget=label,
        capped=budget < int(start.total * config.gpu_memory_utilization),
        weight_bytes=after - start.allocated,
        activation_bytes=max(0, peak - baseline),
        # what grew outside torch's allocator since the start (library workspaces, the
        # tensor-parallel communicator); what was there before is not this replica's
        other_bytes=max(0, (used_after - after) - (start.used - start.allocated)),
    )
    return usage, result


# ------------------------------------------------------------------------------- helpers
def _window(model: ModelConfig, settings: MemorySettings) -> int | None:
    """The sliding window a sequence of the planned context keeps (None: full attention)."""
    window = model.sliding_window
    return window if window and window < settings.context(model) else None


def _block_bytes(settings: MemorySettings, model: ModelConfig, dtype: torch.dtype) -> int:
    return bytes_per_block(model, settings.block_size, settings.kv_cache_dtype, dtype)


def _element(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _size(nbytes: int) -> str:
    """A size for the plan's line: GiB, or MiB / KiB below one of them."""
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if abs(nbytes) >= unit:
            return f"{nbytes / unit:.2f} {name}"
    return f"{nbytes} B"


@contextlib.contextmanager
def _quiet(log: logging.Logger) -> Iterator[None]:
    """``log`` says nothing below WARNING inside the block."""
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)
