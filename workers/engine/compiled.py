"""Compiled decode steps: the model under ``torch.compile``, compiled at start-up, never while
a request is being served.

A decode-only step of B sequences up to the largest bucket runs compiled; every other step
(prefill chunks, mixed steps, batches past the largest bucket) runs eager. On CUDA each bucket
has its graph (CUDA graphs need static shapes): the step pads its tokens to the smallest bucket
>= B. On CPU one graph with a dynamic batch dimension serves every bucket, its rows padded to
at least 2 (dynamo specialises size 1): with a static batch, inductor's freezing packs the
linears for MKL's sgemm (``mkl._mkl_linear``), which ran slower than eager; with a dynamic one
it packs them for oneDNN (``mkldnn._linear_pointwise``), as eager runs them
(docs/decisions/0018-eager-decode-by-default.md).

Attention stays outside the graphs as one opaque op, ``pdserve::paged_attention``, which calls
the step's ``PagedAttention`` (set for the call by ``step_attention``): the graphs hold the dense
work only (embedding, norms, projections, rotary, MLP, LM head), whose shapes depend on the
row count alone. On CPU, inductor with ``freezing`` folds the weights into the graph as
constants and prepacks them for oneDNN; on CUDA, ``mode="reduce-overhead"`` adds
CUDA graphs per bucket, captured piecewise between the attention ops (graph partition). That is
where compiling pays, most at small batches; compiled bf16 may flip a near-tie in greedy decoding,
since the graphs reorder bf16 arithmetic (docs/decisions/0018-eager-decode-by-default.md).

Padding rows carry token 0 at position 0; attention neither writes their K/V nor reads for
them (it sees the step's real rows only and returns zeros for the rest), and their logits are
dropped.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from workers.layers.paged_attention import PagedAttention
from workers.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# The running step's attention and its real token count, for the opaque op. Kept out of the
# graphs' arguments: a bucket's graph must not depend on how many of its rows are padding.
_STEP: tuple[PagedAttention, int] | None = None


@contextlib.contextmanager
def step_attention(attn: PagedAttention, num_tokens: int) -> Iterator[None]:
    global _STEP
    _STEP = (attn, num_tokens)
    try:
        yield
    finally:
        _STEP = None


# cudagraph_unsafe: with CUDA graphs inductor partitions each graph around this op and captures
# only the dense pieces; the op reads the step's block tables, new tensors every step, which a
# captured replay would never see.
@torch.library.custom_op("pdserve::paged_attention", mutates_args=(), tags=(torch._C.Tag.cudagraph_unsafe,))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The step's attention over its real rows (padding rows get zeros). Writes those rows'
    K/V into the paged cache, a side effect outside the graph: the layers' ops run in order,
    and only later ops read what an op wrote."""
    assert _STEP is not None, "paged_attention runs only inside step_attention"
    attn, n = _STEP
    out = q.new_zeros(q.shape)
    out[:n] = attn.forward(layer, q[:n], k[:n], v[:n])
    return out


@paged_attention.register_fake
def _(q, k, v, layer):
    return torch.empty_like(q)


class _OpAttention:
    """Stands in for ``PagedAttention`` inside the traced model: every layer calls the op."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.paged_attention(q, k, v, layer)


_OP_ATTENTION = _OpAttention()
_MIN_DYNAMIC_ROWS = 2  # the CPU graph's rows: dynamo would specialise a batch of 1


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to the first one >= ``max_num_seqs`` (capped there)."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_seqs)
    return tuple(sizes)


class CompiledDecode:
    """Bucketed compiled forward for decode-only steps (see the module docstring)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_num_seqs: int,
        device: torch.device,
        batch_sizes: tuple[int, ...] | None = None,
    ) -> None:
        import torch._inductor.config as inductor_config

        self.model = model
        self.device = device
        self.buckets = tuple(sorted(set(batch_sizes))) if batch_sizes else decode_buckets(max_num_seqs)
        self.dynamic_batch = device.type == "cpu"  # one graph for every bucket (module docstring)
        if device.type == "cpu":
            inductor_config.freezing = True  # weights become constants: prepacked once per graph
        # One graph per bucket, static shapes (CPU: one). Dynamo keeps its entries per code object,
        # shared by every engine of the process (each guarded on its own model): the limit grows.
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit += len(self.buckets)
        dynamo_config.accumulated_recompile_limit += len(self.buckets)
        if device.type == "cuda":
            inductor_config.graph_partition = True  # CUDA graphs around the attention op (above)
        mode = "reduce-overhead" if device.type == "cuda" else None
        # dynamic=None: only what run() marks dynamic (the CPU graph's batch dimension) is dynamic
        self._forward = torch.compile(
            self._dense_forward, dynamic=None if self.dynamic_batch else False, fullgraph=True, mode=mode
        )

    def _dense_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, _OP_ATTENTION))

    def bucket(self, num_tokens: int) -> int | None:
        for size in self.buckets:
            if size >= num_tokens:
                return size
        return None

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], attn: PagedAttention) -> torch.Tensor:
        """Logits ``[len(input_ids), vocab]`` of a decode-only step (one token per sequence)."""
        n = len(input_ids)
        size = self.bucket(n)
        assert size is not None, f"{n} decodes exceed the largest bucket {self.buckets[-1]}"
        pad = (max(n, _MIN_DYNAMIC_ROWS) if self.dynamic_batch else size) - n
        ids = torch.tensor(input_ids + [0] * pad, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions + [0] * pad, dtype=torch.long, device=self.device)
        if self.dynamic_batch:
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(pos, 0)
        with step_attention(attn, n):
            logits = self._forward(ids, pos)
        return logits[:n]

    def warm_up(self, make_attention, progress: bool = True) -> None:
        """Compile every bucket now (``make_attention(batch)`` gives a step's attention for
        ``batch`` decodes over scratch blocks): a progress bar on stderr and a log line per bucket.
        On CPU the first bucket compiles the one graph and the others run it once, so that any
        size dynamo would still specialise on shows here, not while serving."""
        from tqdm.auto import tqdm

        started = time.monotonic()
        bar = tqdm(self.buckets, desc="Compiling decode steps", unit="bucket", disable=not progress)
        for i, size in enumerate(bar, 1):
            bar.set_postfix_str(f"batch {size}")
            t = time.monotonic()
            self.run([0] * size, [0] * size, make_attention(size))
            logger.info(
                "compiled decode step %d/%d (batch %d) in %.1f s", i, len(self.buckets), size, time.monotonic() - t
            )
        logger.info(
            "decode steps compiled for batches %s in %.1f s",
            ",".join(map(str, self.buckets)),
            time.monotonic() - started,
        )
