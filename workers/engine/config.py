"""Engine configuration: frozen, validated once, derived values as properties."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from workers.backends import BACKENDS
from workers.backends.cpu.options import CPUOptions
from workers.engine.memory_plan import COMMUNICATOR_MIB
from workers.protocol import KVCacheDType


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: str
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size the cache from kv_cache_memory_gib / GPU memory
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 128  # sequences running at once
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: str | None = None  # None/"auto": fp32 on CPU, the checkpoint's half type on CUDA
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO  # a plain "auto" / "int8" / "fp8" is parsed here
    kv_cache_memory_gib: float = 1.0  # CPU: memory for the KV cache when num_kv_blocks is None
    gpu_memory_utilization: float = 0.9  # CUDA: this replica's share of the GPU (weights, a step, reserves, KV)
    model_key: str | None = None  # namespaces block hashes; None: derived from the model dir
    seed: int = 0  # generator for requests that give no seed
    load_progress: bool = True
    # "safetensors": the checkpoint's weights; "dummy": random weights of the config's shapes, no
    # files read (benchmarks and device checks of large shapes, as vLLM's load_format=dummy)
    load_format: str = "safetensors"
    # False: decode-only steps up to the largest bucket run compiled (torch.compile at start-up;
    # CUDA: a graph per bucket, CPU: one; workers/engine/compiled.py); True: everything eager.
    enforce_eager: bool = True
    compile_batch_sizes: tuple[int, ...] | None = None  # decode buckets; None: powers of two to max_num_seqs
    # The device backend (workers/backends): "auto" is the device's own ("cpu" or "cuda");
    # "reference" runs plain torch and gather + SDPA anywhere (the specification).
    backend: str = "auto"
    # The CPU backend's options (kernels, linears, threads): workers/backends/cpu/options.py.
    cpu: CPUOptions = CPUOptions()
    # "sdpa": attention gathers the blocks it reads; "flex": FlexAttention over the physical cache;
    # "paged": decodes read the cache through their block tables in one kernel ("flex" and
    # "paged": full-precision cache only); "auto": the backend's choice
    attention_backend: str = "auto"
    # Ranks the model is split over (workers/engine/tensor_parallel.py): this process is rank 0,
    # ranks 1..N-1 are processes it starts. 1: the whole model here, no collectives.
    tensor_parallel_size: int = 1
    # Benchmarks only: (seconds per step, per prefill token, per context token of a decode) that a
    # step lasts at least; the engine thread sleeps the rest. On a CPU every replica shares the same
    # cores, so a replica adds no compute; this stands in for an accelerator's step time (one per
    # replica, independent of the others) in bench/autoscale.py's emulated runs. None: off.
    emulated_step_s: tuple[float, float, float] | None = None
    # The CUDA memory plan's reserves (workers/engine/memory_plan.py). KV transfers in flight at
    # once whose device staging copies it reserves, each a whole max_model_len sequence (0: a
    # replica that never moves KV; disaggregated pools set it), and the transfer peers whose NCCL
    # pair groups, made while serving, it reserves ``communicator_memory_mib`` for each.
    kv_transfer_slots: int = 0
    kv_transfer_peers: int = 0
    communicator_memory_mib: int = COMMUNICATOR_MIB
    # enforce_eager=False on CUDA: the decode buckets' CUDA graphs (None: estimated from the model)
    cuda_graph_memory_gib: float | None = None
    # KV tiers under the device pool (workers/engine/kv_tiers.py): prefix blocks evicted from it
    # go to host memory (pinned on CUDA; on CPU a budget beside kv_cache_memory_gib) and to files
    # under disk_kv_path, and are loaded back for a later request. 0: no such tier.
    host_kv_gib: float = 0.0
    disk_kv_gib: float = 0.0
    disk_kv_path: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", KVCacheDType.parse(self.kv_cache_dtype))
        if isinstance(self.cpu, dict):  # from dataclasses.asdict (a tensor-parallel rank's config)
            object.__setattr__(self, "cpu", CPUOptions(**self.cpu))
        buckets, max_seqs = self.compile_batch_sizes, self.max_num_seqs
        checks = {
            "block_size": (
                self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                "must be a positive power of two (16 is the default)",
            ),
            "num_kv_blocks": (self.num_kv_blocks is None or self.num_kv_blocks > 0, "must be positive"),
            "max_num_batched_tokens": (self.max_num_batched_tokens > 0, "must be positive"),
            "max_num_seqs": (self.max_num_seqs > 0, "must be positive"),
            "max_model_len": (self.max_model_len is None or self.max_model_len > 1, "must be > 1"),
            "kv_cache_memory_gib": (self.kv_cache_memory_gib > 0, "must be positive"),
            "load_format": (self.load_format in ("safetensors", "dummy"), "must be 'safetensors' or 'dummy'"),
            "gpu_memory_utilization": (0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]"),
            "attention_backend": (
                self.attention_backend in ("auto", "sdpa", "flex", "paged")
                and not (self.attention_backend in ("flex", "paged") and self.kv_cache_dtype.quantized),
                "must be 'auto', 'sdpa', 'flex' or 'paged' ('flex' and 'paged' need kv_cache_dtype auto: "
                "a quantized cache is read through the gather path)",
            ),
            "compile_batch_sizes": (
                buckets is None or (len(buckets) > 0 and all(0 < b <= max_seqs for b in buckets)),
                "must be batch sizes in [1, max_num_seqs]",
            ),
            "tensor_parallel_size": (self.tensor_parallel_size > 0, "must be positive"),
            "kv_transfer_slots": (self.kv_transfer_slots >= 0, "must be >= 0"),
            "kv_transfer_peers": (self.kv_transfer_peers >= 0, "must be >= 0"),
            "communicator_memory_mib": (self.communicator_memory_mib >= 0, "must be >= 0"),
            "cuda_graph_memory_gib": (
                self.cuda_graph_memory_gib is None or self.cuda_graph_memory_gib >= 0,
                "must be >= 0 (None: estimated)",
            ),
            "host_kv_gib": (self.host_kv_gib >= 0, "must be >= 0 (0: no host tier)"),
            "disk_kv_gib": (
                self.disk_kv_gib >= 0 and (self.disk_kv_gib == 0 or bool(self.disk_kv_path)),
                "must be >= 0 (0: no disk tier), and a disk tier needs disk_kv_path",
            ),
            "backend": (self.backend in BACKENDS, f"must be one of {', '.join(BACKENDS)}"),
            "emulated_step_s": (
                self.emulated_step_s is None or (len(self.emulated_step_s) == 3 and min(self.emulated_step_s) >= 0),
                "must be three non-negative numbers (per step, per prefill token, per decode context token)",
            ),
        }
        for name, (ok, problem) in checks.items():
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {problem}")
        if self.attention_backend == "flex" and not self.enforce_eager:
            # The compiled decode graph calls attention as an opaque op; flex's own compiled
            # call inside it fails in dynamo (vmap over the block mask's symbolic sizes, torch
            # 2.13): refused here, before the model loads, not in the start-up compile.
            raise ValueError(
                "attention_backend='flex' runs with eager decode steps only: drop enforce_eager=False "
                "(--compile) or use attention_backend 'sdpa' or 'paged'"
            )
        if not Path(self.model_dir).is_dir():
            raise FileNotFoundError(f"model_dir {self.model_dir!r} is not a directory")
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.has_kv_tiers and not self.enable_prefix_caching:
            raise ValueError("host_kv_gib / disk_kv_gib keep prefix blocks: they need enable_prefix_caching")

    @property
    def has_kv_tiers(self) -> bool:
        return self.host_kv_gib > 0 or self.disk_kv_gib > 0

    def _check_tensor_parallel(self) -> None:
        from workers.models.config import ModelConfig
        from workers.models.parallel import tensor_parallel_problem

        tp = self.tensor_parallel_size
        if self.has_kv_tiers:
            raise ValueError(
                f"tensor_parallel_size={tp}: KV tiers (host_kv_gib, disk_kv_gib) are not built for "
                "tensor-parallel replicas yet; drop them or use tensor_parallel_size=1"
            )
        if not self.enforce_eager:
            raise ValueError(
                f"tensor_parallel_size={tp} runs eager only: drop enforce_eager=False (--compile) "
                "or use tensor_parallel_size=1"
            )
        problem = tensor_parallel_problem(ModelConfig.from_dir(self.model_dir), tp)
        if problem:
            raise ValueError(f"tensor_parallel_size={tp}: {problem}; choose a size that divides them")

    @property
    def resolved_model_key(self) -> str:
        """Directory name plus a digest of config.json: two different models never share hashes."""
        if self.model_key:
            return self.model_key
        path = Path(self.model_dir).resolve()
        digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:12]
        return f"{path.name}-{digest}"
