"""The CPU backend: the reference's arithmetic, run by hand-written kernels where they take a step.

- Elementwise ops (``CPUOps``): the fused add+RMSNorm, rotary, SwiGLU, KV write and argmax
  kernels of ``fused.py``, each checked bit for bit against aten once per process; aten's ops
  wherever a kernel does not take the tensors (another dtype, a layout it does not read, inside
  ``torch.compile``).
- Attention: "paged" (default) is ``CPUPagedAttention`` (C++ decode and prompt kernels over the
  cache in place); "sdpa" the reference's gather + SDPA; "flex" FlexAttention over the cache.
- Linears: fp32 weights prepared once at load (``linears.prepack_linears``): oneDNN's reordered
  copy, the panel kernel's copy (coded one byte a weight where exact), AMX tiles for wide batches.
- Fast decode: ``LeanDecode``, a small decode step as one loop of kernel calls.
- Threads: a step's torch threads by its kind (``CPUOptions``); memory: ``kv_cache_memory_gib``
  and glibc's malloc thresholds (``memory.py``).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

from workers.backends.base import AttentionFactory, Backend, FastDecode, Ops, StepThreads
from workers.backends.cpu import fused
from workers.backends.cpu.memory import keep_freed_memory
from workers.backends.cpu.options import CPUOptions

if TYPE_CHECKING:
    from torch import nn

    from workers.layers.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)


class CPUOps(Ops):
    """``Ops`` with the fused kernels where they take the tensors (bit for bit aten's results)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if fused.norm_takes(x, weight):
            return fused.add_rms_norm(x, None, weight, eps)[1]
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if fused.norm_takes(x, weight, residual):
            return fused.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if fused.rotary_takes(x, cos, sin):
            return fused.rotary(x, cos, sin)
        return super().rotary(x, cos, sin)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if fused.swiglu_takes(gate_up):
            return fused.swiglu(gate_up)
        return super().swiglu(gate_up)

    def kv_write(self, flat: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if fused.kv_write_takes(flat, slots, k, v):
            fused.kv_write(flat, slots, k, v)
            return
        super().kv_write(flat, slots, k, v)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if fused.argmax_takes(logits):
            return fused.argmax(logits)
        return super().argmax(logits)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
        if fused.bitmask_takes(logits, bitmask):
            fused.apply_token_bitmask(logits, bitmask, rows, vocab)
            return
        super().apply_token_bitmask(logits, bitmask, rows, vocab)


class CPUBackend(Backend):
    name = "cpu"
    attention_kinds = ("paged", "sdpa", "flex")
    _linears_summary = ""  # set by prepare_linears

    @property
    def options(self) -> CPUOptions:
        return self.config.cpu

    def make_ops(self) -> Ops:
        return CPUOps() if self.config.cpu.fused_ops else Ops()

    def default_attention(self, kv: PagedKVCache) -> str:
        # paged reads the cache in place; a quantized cache is read through the gather path
        return "sdpa" if kv.quantized else "paged"

    def attention(self, kind: str, kv: PagedKVCache, window: int | None) -> AttentionFactory:
        if kind != "paged":
            return super().attention(kind, kv, window)
        from workers.backends.cpu.attention import CPUPagedAttention

        opts = self.options
        return functools.partial(
            CPUPagedAttention,
            ops=self.ops,
            min_keys=opts.paged_min_keys,
            decode_kernel_on=opts.decode_kernel,
            prompt_kernel_on=opts.prompt_kernel,
        )

    def warm_up_attention(
        self, kind: str, kv: PagedKVCache, scale: float, num_q_heads: int, window: int | None
    ) -> None:
        if kind != "paged":
            super().warm_up_attention(kind, kv, scale, num_q_heads, window)
            return
        from workers.backends.cpu.attention import warm_up
        from workers.layers.paged_attention import warm_up_paged_decode

        if not (warm_up(kv, num_q_heads, self.options.prompt_kernel) and self.options.decode_kernel):
            warm_up_paged_decode(kv, scale, num_q_heads, window)  # inductor's kernel runs instead

    def prepare_process(self) -> None:
        keep_freed_memory()

    def prepare_linears(self, model: nn.Module) -> None:
        from workers.backends.cpu import linears

        opts = self.options
        if not opts.prepack_weights:
            return
        packed = linears.prepack_linears(model, coded=opts.coded_weights, amx=opts.amx_linears)
        if not packed:
            return
        logger.info("prepacked %d linear weights for oneDNN (CPU fp32)", packed)
        if coded_line := linears.describe_coded(model):
            logger.info("%s", coded_line)
        if amx_line := linears.describe_amx(model):
            logger.info("%s", amx_line)
        rows, timings = linears.choose_plain_rows(model, opts.plain_linear_rows)
        small_op, wide_op = linears.small_op_name(), linears.wide_op_name(model)
        if rows:
            self._linears_summary = (
                f"batches of up to {rows} row(s) multiply with {small_op}, larger ones with {wide_op}"
            )
        measured = ", ".join(
            f"{t.rows} row(s): {small_op} {t.plain_s * 1e3:.1f} ms, {wide_op} {t.packed_s * 1e3:.1f} ms"
            + (
                f" (faster at best, but by less than {t.margin:.0%})"
                if t.plain_s < t.packed_s and not t.plain_wins
                else f" (won {t.plain_rounds_won} of {t.rounds} rounds)"
            )
            for t in timings
        )
        logger.info(
            "batches of up to %d rows multiply with %s, larger ones with %s (%s)",
            rows,
            small_op,
            wide_op,
            f"measured on {torch.get_num_threads()} threads: {measured}" if timings else "as configured",
        )

    def prepare_model(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().prepare_model(model, dtype)
        if self.config.cpu.fused_ops and dtype == torch.float32:
            logger.info("%s", fused.describe())  # the self-checks run here, at load, not in the first request

    def linears_summary(self) -> str:
        return self._linears_summary

    def fast_decode(self, model: nn.Module) -> FastDecode | None:
        opts = self.options
        if not (opts.lean_decode and opts.fused_ops and opts.prepack_weights):
            return None
        from workers.backends.cpu.lean_decode import LeanDecode

        lean = LeanDecode.for_model(model)  # type: ignore[arg-type]
        if lean is None or lean.max_rows == 0:
            return None
        logger.info(
            "decode steps of up to %d rows run as one loop of kernel calls, not through the modules (lean decode)",
            lean.max_rows,
        )
        return lean

    def step_threads(self) -> StepThreads:
        opts = self.options
        threads = StepThreads(opts.prefill_threads, opts.small_batch_threads, opts.small_batch_max_seqs)
        if threads.switches:
            # inductor's C++ kernels (its paged decode, --compile's graphs) would otherwise fix the
            # thread count they were compiled under (`omp parallel num_threads(N)`) unless it equals
            # os.cpu_count(): with a count that changes per step they take the one in force
            import torch._inductor.config as inductor_config

            inductor_config.cpp.dynamic_threads = True
        return threads

    def describe(self) -> str:
        opts = self.options
        kernels = ("fused_ops", "lean_decode", "prompt_kernel", "decode_kernel")
        off = [name for name in kernels if not getattr(opts, name)]
        return f"cpu backend ({torch.backends.cpu.get_cpu_capability()})" + (f", off: {', '.join(off)}" if off else "")
