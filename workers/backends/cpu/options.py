"""The CPU backend's options: one frozen sub-config of ``EngineConfig`` (``EngineConfig.cpu``)."""

from __future__ import annotations

from dataclasses import dataclass

# With inductor's compiled paged decode, a step whose tables hold fewer keys than this gathers
# and runs SDPA instead, which is as fast or faster there (docs/decisions/0001-paged-attention-on-cpu.md).
PAGED_MIN_KEYS = 2048


@dataclass(frozen=True, slots=True)
class CPUOptions:
    # fp32 linears multiply on weights prepared once at load: oneDNN's reordered copy for wide
    # batches, the panel kernel's copy for small ones (linears.py). False: F.linear.
    prepack_weights: bool = True
    # Batches of up to this many rows take the panel kernel; None: timed both ways at load.
    plain_linear_rows: int | None = None
    # The panel kernel holds a weight as one byte a weight where that is exact (weights on a
    # block-quantized grid, as a GGUF checkpoint's). False: fp32 panels.
    coded_weights: bool = True
    # Coded weights on a CPU with AMX: wide batches multiply on AMX tiles. False: oneDNN.
    amx_linears: bool = True
    # Torch threads of a step that computes prompt tokens; None: the process's own.
    prefill_threads: int | None = None
    # Torch threads of a decode-only step of at most small_batch_max_seqs sequences; None: the
    # process's own (off unless set: whether one thread less pays is the machine's).
    small_batch_threads: int | None = None
    small_batch_max_seqs: int = 4
    # The hand-written kernels, each checked against aten at first use. False runs the
    # reference path instead (the kernels' tests and benchmarks compare both ways).
    fused_ops: bool = True  # add+RMSNorm, rotary, SwiGLU, KV write, argmax
    lean_decode: bool = True  # small decode steps as one loop of kernel calls (needs fused_ops)
    prompt_kernel: bool = True  # prompt attention over the cache in place (the paged attention)
    decode_kernel: bool = True  # paged decode attention in C++ (else inductor's compiled kernel)
    # With inductor's decode kernel: a step of fewer keys gathers and runs SDPA instead.
    paged_min_keys: int = PAGED_MIN_KEYS

    def __post_init__(self) -> None:
        checks = {
            "plain_linear_rows": (self.plain_linear_rows is None or self.plain_linear_rows >= 0, "must be >= 0"),
            "prefill_threads": (self.prefill_threads is None or self.prefill_threads > 0, "must be positive"),
            "small_batch_threads": (
                self.small_batch_threads is None or self.small_batch_threads > 0,
                "must be positive",
            ),
            "small_batch_max_seqs": (self.small_batch_max_seqs > 0, "must be positive"),
            "paged_min_keys": (self.paged_min_keys >= 0, "must be >= 0"),
        }
        for name, (ok, problem) in checks.items():
            if not ok:
                raise ValueError(f"cpu.{name}={getattr(self, name)!r} {problem}")
