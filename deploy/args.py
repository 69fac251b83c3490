"""The application's arguments: one pydantic model, validated across fields, shared by the
builder (``build_app``), the Serve config YAMLs (``args:``) and ``pdserve up``."""

from __future__ import annotations

import enum
import ipaddress
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from workers.protocol import KVCacheDType, Transport


class Mode(str, enum.Enum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


PLACEMENT_GROUP_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


class PoolArgs(BaseModel):
    """One worker pool (prefill, decode or colocated): replicas and what each one needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(default=1, ge=1, description="replicas of this pool")
    num_cpus: float = Field(default=1.0, ge=0, description="CPUs per replica")
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads of each replica's engine; None: what num_cpus grants, max(1, floor(num_cpus))",
    )
    prefill_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads of an engine step that computes prompt tokens (CPU): a prompt's matmuls are "
        "compute-bound and the serving path has little to carry meanwhile; None: num_threads's count",
    )
    small_batch_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads of a decode-only engine step of at most small_batch_max_seqs sequences "
        "(CPU): fewer than num_threads leaves the serving path a core while such steps run, which helped on "
        "one 2-core VM and hurt on another (docs/decisions/0011-small-batch-threads-off-by-default.md), so "
        "measure before setting it; None: num_threads's count",
    )
    small_batch_max_seqs: int = Field(
        default=4, ge=1, description="the most sequences a decode step runs on small_batch_threads"
    )
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs per replica (1 on GPU clusters)")
    host_kv_gib: float = Field(
        default=0.0,
        ge=0,
        description="KV tier in host memory per replica: prefix blocks evicted from the KV cache wait here "
        "(pinned on GPUs; on CPU beside kv_cache_memory_gib); 0: none",
    )
    disk_kv_gib: float = Field(
        default=0.0, ge=0, description="KV tier on local disk per replica (files under disk_kv_path); 0: none"
    )
    disk_kv_path: str | None = Field(
        default=None,
        description="directory of the disk tier, on each node; a replica takes <path>/<model>/<pool>/rN, and a "
        "restarted one finds what its predecessor wrote",
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom resources per replica, e.g. {'prefill': 1} to pin a node type"
    )
    max_ongoing_requests: int = Field(default=64, ge=1, description="requests running per replica")
    max_queued_requests: int = Field(
        default=256,
        ge=-1,
        description="requests waiting for a replica of this pool; beyond it clients get 503 "
        "with Retry-After (-1: unbounded)",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="ranks (devices) one replica's engine is split over: Serve reserves a placement group "
        "of that many bundles of num_cpus/num_gpus (num_cpus, num_gpus and num_threads are per rank; "
        "resources go on the first bundle only); prefill and decode pools may differ",
    )
    placement_group_strategy: str | None = Field(
        default=None,
        description="with tensor_parallel_size > 1: Ray's strategy for a replica's bundles "
        "(default STRICT_PACK when num_gpus > 0, the GPUs of one node, else PACK)",
    )
    autoscaling_config: dict[str, Any] | None = Field(
        default=None,
        description="Ray Serve's autoscaling_config for this pool (min_replicas, max_replicas, "
        "target_ongoing_requests, upscale_delay_s, downscale_delay_s, ...); when set, "
        "`replicas` is not used: the pool starts at initial_replicas (else min_replicas)",
    )

    @field_validator("placement_group_strategy")
    @classmethod
    def _strategy(cls, v: str | None) -> str | None:
        if v is not None and v not in PLACEMENT_GROUP_STRATEGIES:
            raise ValueError(f"placement_group_strategy {v!r}: choose one of {', '.join(PLACEMENT_GROUP_STRATEGIES)}")
        return v

    @model_validator(mode="after")
    def _bundles(self) -> PoolArgs:
        if self.tensor_parallel_size > 1 and not (self.num_cpus or self.num_gpus):
            raise ValueError(
                "tensor_parallel_size > 1 reserves a bundle of num_cpus/num_gpus per rank: "
                "give num_cpus or num_gpus > 0"
            )
        return self

    @property
    def bundle_strategy(self) -> str:
        """The placement group strategy of a replica's bundles (tensor_parallel_size > 1)."""
        return self.placement_group_strategy or ("STRICT_PACK" if self.num_gpus > 0 else "PACK")

    @field_validator("autoscaling_config")
    @classmethod
    def _autoscaling(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return None
        from ray.serve.config import AutoscalingConfig  # Serve's own schema: its messages name the field

        unknown = sorted(set(v) - set(AutoscalingConfig.model_fields))
        if unknown:  # Serve's model ignores them silently: a typo would autoscale on defaults
            raise ValueError(
                f"autoscaling_config: unknown field(s) {', '.join(unknown)}; Serve's fields are "
                f"{', '.join(AutoscalingConfig.model_fields)}"
            )
        AutoscalingConfig(**v)
        if v.get("min_replicas", 1) < 1:
            raise ValueError(
                "autoscaling_config.min_replicas must be >= 1: a pool scaled to zero cannot "
                "take the other pool's hand-offs"
            )
        return dict(v)


class PoolBoundsArgs(BaseModel):
    """One pool's bounds under the pd policy (it starts at the pool's ``replicas``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=1, ge=1, description="never fewer (a pool at zero takes no hand-offs)")
    max_replicas: int | None = Field(
        default=None, ge=1, description="never more (default: the budget less the other pool's minimum)"
    )


class AutoscalingArgs(BaseModel):
    """``autoscaling: pd``: one decision for both pools within a total replica budget
    (``deploy/pools/autoscaling.py``), applied by the ``autoscaler`` deployment through Serve's
    external-scaler API. ``autoscaling: pd`` alone takes every default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = Field(
        default="pd",
        description="pd (the only policy; per-pool Serve autoscaling is prefill/decode.autoscaling_config instead)",
    )
    max_total_replicas: int | None = Field(
        default=None,
        ge=2,
        description="prefill + decode replicas at most, e.g. one per GPU (default: prefill.replicas + decode.replicas)",
    )
    prefill: PoolBoundsArgs = Field(default_factory=PoolBoundsArgs)
    decode: PoolBoundsArgs = Field(default_factory=PoolBoundsArgs)
    ttft_target_s: float = Field(default=2.0, gt=0, description="the prefill queue should drain well within it")
    tpot_target_s: float = Field(default=0.1, gt=0, description="time per output token a decode replica should keep")
    kv_usage_target: float = Field(default=0.8, gt=0, le=1, description="decode KV usage to stay under")
    prefill_tokens_per_s: float = Field(
        default=2000.0, gt=0, description="a prefill replica's prompt tokens/s until it is measured under load"
    )
    interval_s: float = Field(default=2.0, gt=0, description="how often the replicas are read and a decision made")
    upscale_delay_s: float = Field(default=4.0, ge=0, description="a change that grows a pool must hold this long")
    downscale_delay_s: float = Field(default=30.0, ge=0, description="a change that only shrinks must hold this long")
    cooldown_s: float = Field(default=10.0, ge=0, description="no change this soon after the last one")
    look_back_s: float = Field(
        default=10.0,
        ge=0,
        description="each pool's need is the median of the decision rounds' needs over this many seconds, so a "
        "one-round spike changes nothing (0: the last round's alone)",
    )
    kv_look_ahead_s: float = Field(
        default=10.0,
        ge=0,
        description="decode's KV need counts only the blocks running sequences will still hold this many seconds "
        "from now (tokens they may still produce x TPOT): a change lands, and a replica given up drains, "
        "seconds after it is decided (0: all the KV held now)",
    )
    fill_budget: bool = Field(
        default=True,
        description="budget neither pool's own need asks for goes to the pool with the least covered need, while "
        "that pool's need stays above its downscale threshold (the budget is GPUs held anyway); false: each pool "
        "grows only past its own upper threshold",
    )
    move_step: int = Field(
        default=1,
        ge=0,
        description="with the budget full, replicas one change moves from one pool to the other (0: no limit)",
    )
    take_ratio: float = Field(
        default=1.5,
        ge=1.0,
        description="over budget, a pool takes a replica the other pool's own need would keep only when its "
        "need is at least this many times its replicas",
    )
    dashboard_url: str | None = Field(
        default=None,
        description="the Ray dashboard the autoscaler sets replica counts through (Serve's external-scaler "
        "REST API); default: port 8265 on the head node",
    )

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v != "pd":
            raise ValueError(
                f"autoscaling.policy {v!r}: the only policy is 'pd' (per-pool queue-length "
                "autoscaling is prefill.autoscaling_config / decode.autoscaling_config)"
            )
        return v


POOL_TRANSPORTS = tuple(t.value for t in Transport if t is not Transport.OBJECT_STORE)
_CHOICES = {
    # object_store is a library-level transport (Ray actors passing a buffer's ref); the pools'
    # control path is direct, not a Ray call (workers/transfer/control.py)
    "transport": POOL_TRANSPORTS,
    "prefill_routing": ("cache_aware", "power_of_two", "round_robin"),
}


class PDServeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        description="Hugging Face model directory (the same path on every node), a .gguf file "
        "(converted once where the app is built) or 'smollm2'"
    )
    served_model_name: str | None = Field(default=None, description="id in /v1/models (default: dir name)")
    mode: Mode = Field(default=Mode.DISAGGREGATED)
    prefill: PoolArgs = Field(default_factory=PoolArgs)
    decode: PoolArgs = Field(default_factory=PoolArgs)
    colocated: PoolArgs = Field(default_factory=PoolArgs)
    ingress_replicas: int = Field(default=1, ge=1)
    cluster_autoscales: bool = Field(
        default=False,
        description="the Ray cluster adds nodes on demand (ray up's autoscaler): build_app does not refuse "
        "a layout larger than the nodes there are now",
    )
    ingress_num_cpus: float = Field(
        default=1.0, ge=0, description="Ray's CPU share per ingress replica (pdserve up sizes it to fit its machine)"
    )
    device: str = Field(default="auto", description="auto (cuda when the replica has a GPU), cpu, cuda")
    dtype: str | None = Field(default=None, description="auto, float32, bfloat16, float16")
    block_size: int = Field(default=16, description="tokens per KV block; must match across pools")
    kv_cache_dtype: KVCacheDType = Field(
        default=KVCacheDType.AUTO,
        description="auto (the model dtype), int8 or fp8 (per-block-per-head scales); must match across pools",
    )
    num_kv_blocks: int | None = Field(default=None, ge=1, description="KV blocks per replica (default: from memory)")
    kv_cache_memory_gib: float = Field(default=1.0, gt=0, description="CPU replicas: KV cache size")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="GPU: each rank's share of its device (weights, a step, reserves, KV)"
    )
    kv_transfer_slots: int = Field(
        default=2,
        ge=0,
        description="GPU, disaggregated pools: KV transfers in flight at once whose device staging copies each "
        "replica's memory plan reserves, each a whole max_model_len sequence (colocated replicas reserve none)",
    )
    communicator_memory_mib: int = Field(
        default=256, ge=0, description="GPU: device memory the memory plan reserves per NCCL pair group"
    )
    cuda_graph_memory_gib: float | None = Field(
        default=None,
        ge=0,
        description="GPU with enforce_eager false: memory reserved for the decode CUDA graphs (default: estimated)",
    )
    max_num_batched_tokens: int = Field(default=2048, ge=16)
    max_num_seqs: int = Field(default=128, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)
    enable_prefix_caching: bool = True
    enforce_eager: bool = Field(
        default=True,
        description="False: decode steps run compiled (torch.compile for batches up to "
        "max_num_seqs, compiled when a replica starts: a graph per batch bucket on CUDA, one on CPU)",
    )
    prepack_weights: bool = Field(
        default=True,
        description="CPU fp32: linears multiply with oneDNN on weights reordered once at load, small "
        "batches with pdserve's panel kernel on a panel copy (faster; the linears' weights then take "
        "three times their memory); false: F.linear",
    )
    coded_weights: bool = Field(
        default=True,
        description="with prepack_weights: the panel kernel reads a weight as one byte a weight where that "
        "reproduces it bit for bit (a checkpoint dequantized from a block format, such as a GGUF file's "
        "Q4/Q8 tensors); false: fp32 panels for every weight",
    )
    amx_linears: bool = Field(
        default=True,
        description="with coded_weights, on a CPU with Intel AMX: batches wider than the panel kernel's "
        "(prompts, wide decode steps) multiply on AMX's bf16 tiles with each input cut into three exact "
        "bf16 parts (fp32 products and sums); false: oneDNN's fp32 GEMM",
    )
    backend: Literal["auto", "cpu", "cuda", "reference"] = Field(
        default="auto",
        description="the engine's device backend: auto is the device's own (cpu or cuda); reference runs "
        "plain torch and gather + SDPA attention (the specification the others are checked against)",
    )
    attention_backend: Literal["auto", "sdpa", "flex", "paged"] = Field(
        default="auto",
        description="sdpa: decodes gather their blocks for SDPA; paged: decodes read the cache through "
        "their block tables in one compiled kernel (compiled when a replica starts); flex: FlexAttention "
        "over the cache; auto: paged on CPU, sdpa on CUDA (paged and flex need kv_cache_dtype auto)",
    )
    conversation_reuse: bool = Field(
        default=True,
        description="a chat turn that extends an earlier one reuses its exact token ids "
        "(answer included), so the earlier turns' KV blocks are hits",
    )
    output_channel: bool = Field(
        default=True,
        description="worker replicas send an ingress replica each engine step's tokens for all its requests "
        "in one message (workers/output_channel.py); false: every request's tokens on its own Serve stream",
    )
    redis_url: str | None = Field(default=None, description="Redis for the prefix index; None: route by load")
    emulated_step_s: tuple[float, float, float] | None = Field(
        default=None,
        description="benchmarks only: (s per step, per prefill token, per decode context token) each engine step "
        "lasts at least, as an accelerator's would (bench/autoscale.py --emulate-device); never for serving",
    )
    model_key: str | None = Field(
        default=None,
        description="namespaces block hashes and the index; build_app derives it once from the model and passes "
        "it to every replica (leave unset unless two model copies must share a cache)",
    )
    transport: str = Field(default="auto", description="auto, gloo, nccl, gloo_staged")
    transfer_timeout_s: float = Field(default=30.0, gt=0)
    kv_checksum: bool = Field(
        default=True,
        description="checksum every transferred KV block where it is and verify it on receipt; a mismatch is "
        "recomputed, counted (pdserve_kv_transfer_corrupt_total) and logged",
    )
    kv_rebalance: bool = Field(
        default=False,
        description="a decode replica about to preempt (fewer free KV blocks than running sequences) moves a stream "
        "live to the decode replica with the most room instead (needs redis_url; off: its measured gain varies "
        "from run to run, BENCHMARKS.md)",
    )
    max_migrations: int = Field(
        default=2,
        ge=0,
        description="times one request's decode stream may resume on another decode replica "
        "after its replica died (0: end the stream with an error event instead)",
    )
    autoscaling: AutoscalingArgs | None = Field(
        default=None,
        description="'pd' or {policy: pd, max_total_replicas, ttft_target_s, tpot_target_s, "
        "prefill: {min_replicas, max_replicas}, decode: {...}, ...}: size both pools "
        "together (disaggregated mode; the app needs external_scaler_enabled)",
    )
    lease_ttl_s: float = Field(default=30.0, gt=0, description="prefill blocks wait this long for decode")
    prefill_routing: str = Field(
        default="cache_aware", description="cache_aware (prefix index + load), power_of_two, round_robin"
    )
    min_prefix_match_blocks: int = Field(default=2, ge=1, description="shorter matches route by load")
    prefix_imbalance_threshold: int = Field(
        default=8, ge=0, description="queue-length gap that overrides a prefix match"
    )
    api_keys: tuple[str, ...] = Field(default=(), description="accepted Bearer keys; empty: no auth")
    max_request_bytes: int = Field(default=1 << 20, ge=1024, description="larger bodies get 413")
    request_timeout_s: float = Field(default=600.0, gt=0)
    step_timeout_s: float = Field(
        default=300.0,
        ge=0,
        description="a worker replica whose engine has been inside one step (a kernel, a collective) "
        "this long reports unhealthy, so Serve replaces it and its streams resume elsewhere; 0: never",
    )
    log_level: str = "INFO"
    fault_injection: dict[str, float] = Field(
        default_factory=dict,
        description="testing only: prefill_delay_s (sleep before each prefill), send_stall_s (stall before "
        "each KV send), step_delay_s (sleep after each engine step that runs sequences), step_hang_s "
        "(the first step that runs sequences in one decode or colocated replica of the app hangs this "
        "long, once per app), kv_corrupt_bytes (bytes flipped in each KV message after its checksum) to "
        "exercise replica deaths, transfer deadlines, health checks and KV checksums",
    )

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v: int) -> int:
        if v <= 0 or v & (v - 1):
            raise ValueError(f"block_size {v} must be a power of two (16 is the default)")
        return v

    @field_validator("transport", "prefill_routing")
    @classmethod
    def _one_of(cls, v: str, info: ValidationInfo) -> str:
        name = str(info.field_name)  # a field validator's info always names its field
        allowed = _CHOICES[name]
        if v not in allowed:
            raise ValueError(f"{name} {v!r}: choose one of {', '.join(allowed)}")
        return v

    @field_validator("autoscaling", mode="before")
    @classmethod
    def _autoscaling_shorthand(cls, v: Any) -> Any:
        return {"policy": v} if isinstance(v, str) else v

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        from workers.models.source import resolve_model  # a directory is returned at once

        return str(resolve_model(v))

    @model_validator(mode="after")
    def _cross_field(self) -> PDServeArgs:
        if self.mode is Mode.DISAGGREGATED and self.transport == "nccl" and self.decode.num_gpus == 0:
            raise ValueError("transport nccl needs GPU replicas: set decode.num_gpus and prefill.num_gpus")
        from deploy.placement import YAML, check_devices

        check_devices(self, YAML)  # a CUDA engine in a replica Ray gives no GPU
        if self.max_model_len and self.num_kv_blocks and self.max_model_len > self.num_kv_blocks * self.block_size:
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit in num_kv_blocks {self.num_kv_blocks} "
                f"x block_size {self.block_size}: raise num_kv_blocks or lower max_model_len"
            )
        if self.attention_backend in ("flex", "paged") and self.kv_cache_dtype.quantized:
            raise ValueError(
                f"attention_backend {self.attention_backend} needs kv_cache_dtype auto, not "
                f"{self.kv_cache_dtype.value}: a quantized cache is read through the gather path (sdpa or auto)"
            )
        if self.attention_backend == "flex" and not self.enforce_eager:
            raise ValueError(
                "attention_backend flex runs with eager decode steps only: set enforce_eager true "
                "(drop --compile) or use attention_backend sdpa or paged"
            )
        self._check_autoscaling()
        self._check_tensor_parallel()
        return self

    def _check_tensor_parallel(self) -> None:
        """Each pool's tensor_parallel_size (prefill and decode may differ: KV moves between TP
        groups of any sizes, workers/transfer/tp_transfer.py): eager only, and one the model's
        heads split over (the engine's own check)."""
        pools = ("colocated",) if self.mode is Mode.COLOCATED else ("prefill", "decode")
        for name in pools:
            tp = getattr(self, name).tensor_parallel_size
            if tp > 1 and not self.enforce_eager:
                raise ValueError(f"{name}.tensor_parallel_size {tp} runs eager only: set enforce_eager true")
            if tp > 1 and Path(self.model).is_dir():
                from workers.models.config import ModelConfig
                from workers.models.parallel import tensor_parallel_problem

                problem = tensor_parallel_problem(ModelConfig.from_dir(self.model), tp)
                if problem:
                    raise ValueError(f"{name}.tensor_parallel_size {tp}: {problem}; choose a size that divides them")

    def _check_autoscaling(self) -> None:
        if self.autoscaling is None:
            return
        if self.mode is not Mode.DISAGGREGATED:
            raise ValueError("autoscaling: pd sizes the prefill and decode pools: use mode disaggregated")
        for name in ("prefill", "decode"):
            if getattr(self, name).autoscaling_config is not None:
                raise ValueError(
                    f"autoscaling: pd sets each pool's replicas itself: remove "
                    f"{name}.autoscaling_config (Serve refuses both on one application)"
                )
        budget = self.autoscaling_budget
        for name in ("prefill", "decode"):
            lo, hi = self.autoscaling_bounds(name)
            start = getattr(self, name).replicas
            if lo > hi:
                raise ValueError(f"autoscaling.{name}: min_replicas {lo} > max_replicas {hi} (budget {budget})")
            if not lo <= start <= hi:
                raise ValueError(
                    f"{name}.replicas {start} is outside autoscaling.{name} bounds [{lo}, {hi}]: "
                    "the pool starts at its replicas"
                )
        if self.prefill.replicas + self.decode.replicas > budget:
            raise ValueError(
                f"prefill.replicas + decode.replicas = {self.prefill.replicas + self.decode.replicas} "
                f"exceeds autoscaling.max_total_replicas {budget}"
            )
        if self.autoscaling.prefill.min_replicas + self.autoscaling.decode.min_replicas > budget:
            raise ValueError(f"autoscaling: the pools' min_replicas add up to more than max_total_replicas {budget}")

    @property
    def autoscaling_budget(self) -> int:
        """The pd policy's total replica budget (its own or the pools' starting replicas)."""
        assert self.autoscaling is not None
        return self.autoscaling.max_total_replicas or self.prefill.replicas + self.decode.replicas

    def autoscaling_bounds(self, pool: str) -> tuple[int, int]:
        """(min, max) replicas of ``pool`` under the pd policy."""
        assert self.autoscaling is not None
        other = "decode" if pool == "prefill" else "prefill"
        own = getattr(self.autoscaling, pool)
        hi = own.max_replicas or self.autoscaling_budget - getattr(self.autoscaling, other).min_replicas
        return own.min_replicas, min(hi, self.autoscaling_budget - getattr(self.autoscaling, other).min_replicas)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def transfer_peers(self, role: str) -> int:
        """NCCL pair groups one rank of a ``role`` replica may hold: the other pool's most replicas,
        times the ranks of each that share its KV heads; none colocated or over gloo."""
        if role not in ("prefill", "decode") or self.transport not in ("auto", "nccl"):
            return 0
        other = "decode" if role == "prefill" else "prefill"
        pool = getattr(self, other)
        if self.autoscaling is not None:
            most = self.autoscaling_bounds(other)[1]
        else:
            most = int((pool.autoscaling_config or {}).get("max_replicas", pool.replicas))
        own_tp = getattr(self, role).tensor_parallel_size
        return most * max(1, pool.tensor_parallel_size // own_tp)

    def engine_kwargs(self, device: str, role: str = "colocated") -> dict[str, Any]:
        """Keyword arguments for ``LLMEngine`` on a replica of pool ``role`` whose device is resolved."""
        from workers.backends.cpu.options import CPUOptions

        pool = getattr(self, role)
        cpu = CPUOptions(
            prepack_weights=self.prepack_weights,
            coded_weights=self.coded_weights,
            amx_linears=self.amx_linears,
            prefill_threads=pool.prefill_threads,
            small_batch_threads=pool.small_batch_threads,
            small_batch_max_seqs=pool.small_batch_max_seqs,
        )
        return dict(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            device=device,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_memory_gib=self.kv_cache_memory_gib,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            enforce_eager=self.enforce_eager,
            backend=self.backend,
            cpu=cpu,
            attention_backend=self.attention_backend,
            model_key=self.model_key,
            tensor_parallel_size=pool.tensor_parallel_size,
            emulated_step_s=self.emulated_step_s,
            kv_transfer_slots=self.kv_transfer_slots if role in ("prefill", "decode") else 0,
            kv_transfer_peers=self.transfer_peers(role),
            communicator_memory_mib=self.communicator_memory_mib,
            cuda_graph_memory_gib=self.cuda_graph_memory_gib,
            host_kv_gib=pool.host_kv_gib,
            disk_kv_gib=pool.disk_kv_gib,
            disk_kv_path=os.path.join(pool.disk_kv_path, role) if pool.disk_kv_path else None,
        )


def redis_url_is_loopback(redis_url: str) -> bool:
    """True when the URL names this machine only (localhost, 127.0.0.0/8, ::1, 0.0.0.0)."""
    host = (urlsplit(redis_url).hostname or "").lower()
    if host in ("localhost", "localhost.localdomain", "") or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: resolved on each node, assumed to mean the same Redis
    return address.is_loopback or address.is_unspecified


def loopback_redis_problem(redis_url: str | None, alive_nodes: int) -> str | None:
    """Why `redis_url` cannot serve a Ray cluster of `alive_nodes` nodes (None when it can)."""
    if not redis_url or alive_nodes <= 1 or not redis_url_is_loopback(redis_url):
        return None
    from cluster.local import redact_url

    return (
        f"redis_url {redact_url(redis_url)} names the loopback address, but this Ray cluster has "
        f"{alive_nodes} nodes: replicas on the other nodes would look for Redis on their own loopback. "
        "Set redis_url to an address every node can reach, e.g. redis://<head IP>:6380/0 (the head's "
        "Redis in cluster/*.yaml, bound to the head's address), or leave redis_url unset to route by load alone."
    )


def check_redis_url_for_cluster(redis_url: str | None) -> None:
    """Start-up check (``build_app``): raise ValueError when a loopback Redis URL is given to a
    Ray cluster of more than one node. Without a connected Ray there is nothing to check."""
    if not redis_url or not redis_url_is_loopback(redis_url):
        return
    import ray

    if not ray.is_initialized():
        return
    problem = loopback_redis_problem(redis_url, sum(1 for node in ray.nodes() if node.get("Alive")))
    if problem:
        raise ValueError(problem)
