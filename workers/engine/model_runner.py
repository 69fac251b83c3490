"""Turns a scheduled step into tensors, runs the model over the paged cache, returns logits.

Only rows that end a sequence's scheduled tokens (and reach its last token) go through the LM
head: a 300-token prefill chunk costs one row of logits, not 300. A request asking for prompt
logprobs also sends its chunk's prompt rows through it (in slices, so a long chunk never holds
``[tokens, vocab]`` logits at once) and gets their logprobs back.

With a sliding window, each sequence's attention reads blocks from ``first_window_block`` on:
earlier ones are outside every future query's window (and freed).

``attention_backend`` (``EngineConfig.attention_backend``): "sdpa" gathers the blocks a step
reads (``PagedAttention``), "flex" attends over the physical cache (``FlexPagedAttention``,
compiled here at start-up), "paged" decodes through the block tables in one compiled kernel per
layer (``PagedDecodeAttention``, compiled here at start-up), "auto" picks
``auto_attention_backend``'s choice.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from workers.engine.block_manager import first_window_block
from workers.engine.compiled import CompiledDecode
from workers.engine.config import EngineConfig
from workers.engine.sampler import prompt_logprobs
from workers.engine.scheduler import ScheduledSeq, SchedulerOutput
from workers.engine.sequence import Sequence, TokenLogprob
from workers.layers.kv_cache import PagedKVCache
from workers.layers.paged_attention import (
    ATTENTION_BACKENDS,
    AttentionMetadata,
    FlexPagedAttention,
    PagedAttention,
    PagedDecodeAttention,
    PrefillSpan,
    decode_mask,
    flash_attn_usable,
    warm_up_flex,
    warm_up_paged_decode,
)
from workers.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

PROMPT_LOGITS_ROWS = 512  # rows of prompt logits computed at once ([rows, vocab] fp32)

# One sequence's prompt logprobs from a step: (sequence, first position scored, logprobs); the
# logprob at position p is prompt token p + 1's.
PromptLogprobs = tuple[Sequence, int, list[TokenLogprob]]


# "auto" on a full-precision cache, by device type: chosen by measuring decode steps with the
# backends side by side (bench/attention.py, batch 1/8/32 x context 256/1024, 2 cores). Flex
# won nothing measurable on CPU (flex/sdpa 0.86-1.26 on SmolLM2-135M, slower at 5 of 6 points).
# Paged (its kernel from PAGED_MIN_KEYS keys a step, gather + SDPA below) was paged/sdpa
# 0.98-1.02 at batch 1 and 8 x 256, 0.92-0.95 at 8 x 1024 and 32 x 256, and 0.40 at 32 x 1024,
# where the gather path's 50 MB per layer copy dominates: paged on CPU. On CUDA (an H200, 8B-
# shaped bf16 model, 2k context, eager, bench/gpu_check.py) sdpa won: 20.4 / 21.1 / 23.7 ms a step
# at batch 1 / 16 / 64 against paged's inductor kernel 27.9 / 26.1 / 69.8 (same run), and flex
# 38.7 / 35.1 / 57.8 against sdpa's 24.3 / 24.9 / 26.7 in another; paged's later Triton kernel
# (triton_paged, its combine fused) drew level: 34.6 / 36.2 against 33.6 / 38.0 at batch 1 / 64,
# and 12.6 / 21.7 against 13.1 / 21.7 compiled: sdpa there (flash-attn's paged kernel when
# installed; flash-attn was not on that machine).
AUTO_BACKEND = {"cpu": "paged"}


def auto_attention_backend(kv: PagedKVCache) -> str:
    """What "auto" runs: sdpa for a quantized cache (flex needs full precision), else the
    measured choice for the device."""
    if kv.quantized:
        return "sdpa"
    return AUTO_BACKEND.get(kv.layers[0].device.type, "sdpa")


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block on ``threads`` torch (OpenMP) threads, then restore the count before it (a
    call to ``torch.set_num_threads`` costs microseconds: the pool's threads are kept)."""
    before = torch.get_num_threads()
    if threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class StepThreads:
    """CPU: the torch threads of a step by its kind (EngineConfig's ``prefill_threads``,
    ``small_batch_threads`` and ``small_batch_max_seqs``); None anywhere: the process's own."""

    prefill: int | None = None
    small_batch: int | None = None
    small_batch_max_seqs: int = 4

    @classmethod
    def from_config(cls, config: EngineConfig) -> StepThreads:
        return cls(config.prefill_threads, config.small_batch_threads, config.small_batch_max_seqs)

    @property
    def switches(self) -> bool:
        """Whether some step runs on a count of its own."""
        return self.prefill is not None or self.small_batch is not None

    def for_step(self, out: SchedulerOutput) -> int | None:
        """``prefill`` for a step with prompt tokens, ``small_batch`` for a decode-only step of at
        most ``small_batch_max_seqs`` sequences; else None."""
        if out.prefills:
            return self.prefill
        if len(out.decodes) <= self.small_batch_max_seqs:
            return self.small_batch
        return None


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: PagedKVCache,
        sliding_window: int | None = None,
        compiled: CompiledDecode | None = None,
        progress: bool = False,
        attention_backend: str = "sdpa",
        step_threads: StepThreads | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.sliding_window = sliding_window
        self.device = kv.layers[0].device
        # CPU only: a step's torch threads by its kind (EngineConfig); elsewhere every step the same
        self.threads = (step_threads or StepThreads()) if self.device.type == "cpu" else StepThreads()
        if self.threads.switches:
            # inductor's C++ kernels (the paged decode, --compile's graphs) would otherwise fix the
            # thread count they were compiled under (`omp parallel num_threads(N)`) unless it equals
            # os.cpu_count(): with a count that changes per step they take the one in force
            import torch._inductor.config as inductor_config

            inductor_config.cpp.dynamic_threads = True
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={attention_backend!r} must be one of {ATTENTION_BACKENDS}")
        if attention_backend == "auto":
            attention_backend = auto_attention_backend(kv)
        self.attention_backend = attention_backend
        self._attention: type[PagedAttention] = PagedAttention
        warm_ups = {"flex": (FlexPagedAttention, warm_up_flex), "paged": (PagedDecodeAttention, warm_up_paged_decode)}
        if attention_backend in warm_ups:  # each refuses a quantized cache (check_full_precision)
            self._attention, warm_up = warm_ups[attention_backend]
            if progress:
                logger.info("compiling the %s attention kernel (once per model shape)", attention_backend)
            start = time.perf_counter()
            group = model.config.num_heads // model.config.num_kv_heads
            warm_up(kv, model.attention_scale, kv.num_kv_heads * group, sliding_window)
            if progress:
                logger.info("%s attention ready in %.1f s", attention_backend, time.perf_counter() - start)
        self.use_flash_attn = attention_backend == "sdpa" and flash_attn_usable(
            self.device, self.block_size, kv, sliding_window
        )
        self.compiled = compiled  # decode-only steps of up to its largest bucket run compiled
        if compiled is not None:
            compiled.warm_up(self._scratch_attention, progress)

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq], list[PromptLogprobs]]:
        """Run one step. Returns logits ``[N, V]`` for the N sequences that sample, in order, and
        the prompt logprobs of the positions this step computed for requests that ask for them.
        The step runs on ``self.threads.for_step(out)`` torch threads when that is set."""
        threads = self.threads.for_step(out)
        if threads is not None:
            with torch_threads(threads):
                return self._execute(out)
        return self._execute(out)

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq], list[PromptLogprobs]]:
        items = out.decodes + out.prefills
        input_ids: list[int] = []
        positions: list[int] = []
        write_blocks: list[int] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        prompt_rows: list[tuple[Sequence, range, int]] = []  # (seq, positions scored, first row)
        bs = self.block_size
        for item in items:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            targets = seq.prompt_logprob_targets(start, end)
            if targets:
                prompt_rows.append((seq, targets, len(input_ids) + targets.start - start))
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            write_blocks.extend(table[p // bs] for p in range(start, end))
            if item.completes:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(item)

        dev = self.device
        offsets = [p % bs for p in positions]
        meta = AttentionMetadata(
            write=self.kv.write_plan(write_blocks, offsets, dev), sliding_window=self.sliding_window
        )
        if out.decodes:
            self._decode_metadata(meta, out.decodes)
        row = len(out.decodes)
        for item in out.prefills:
            start = item.seq.num_computed_tokens
            context_len = start + item.num_new_tokens
            cached_table: torch.Tensor | None = None  # only a chunk after cached tokens reads the cache
            first = 0
            if context_len != item.num_new_tokens:
                first = first_window_block(start, self.sliding_window, bs)
                num_blocks = -(-context_len // bs)
                cached_table = torch.tensor(item.seq.block_table[first:num_blocks], dtype=torch.long, device=dev)
            meta.prefills.append(PrefillSpan(row, item.num_new_tokens, context_len, cached_table, first * bs))
            row += item.num_new_tokens

        attn = self._attention(self.kv, meta, self.model.attention_scale)
        if (
            self.compiled is not None
            and not out.prefills
            and not prompt_rows
            and self.compiled.bucket(len(input_ids)) is not None
        ):
            logits = self.compiled.run(input_ids, positions, attn)  # every decode row samples
            return logits[torch.tensor(sample_rows, device=dev)], sampled, []
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            attn,
        )
        prompt = [
            (seq, targets.start, self._prompt_logprobs(hidden, seq, targets, row)) for seq, targets, row in prompt_rows
        ]
        if not sample_rows:
            return hidden.new_empty((0, 0), dtype=torch.float32), sampled, prompt
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        return logits, sampled, prompt

    def _prompt_logprobs(self, hidden: torch.Tensor, seq: Sequence, targets: range, row: int) -> list[TokenLogprob]:
        """Logprobs of prompt tokens ``targets + 1`` from the hidden rows of positions ``targets``
        (starting at ``row``)."""
        top = seq.params.prompt_logprobs
        if top is None:  # prompt_logprob_targets is empty then: no rows to score
            return []
        result: list[TokenLogprob] = []
        for first in range(0, len(targets), PROMPT_LOGITS_ROWS):
            n = min(PROMPT_LOGITS_ROWS, len(targets) - first)
            logits = self.model.compute_logits(hidden[row + first : row + first + n])
            ids = seq.token_ids[targets.start + first + 1 : targets.start + first + n + 1]
            result.extend(prompt_logprobs(logits, ids, top))
        return result

    def _scratch_attention(self, batch: int) -> PagedAttention:
        """Attention for ``batch`` decodes at position 0 of block 0 (free at start-up: what
        compiling writes there is void), to compile a bucket with."""
        meta = AttentionMetadata(
            write=self.kv.write_plan([0] * batch, [0] * batch, self.device), sliding_window=self.sliding_window
        )
        self._fill_decode_metadata(meta, [1] * batch, [0] * batch, [[0]] * batch)
        return self._attention(self.kv, meta, self.model.attention_scale)

    def _decode_metadata(self, meta: AttentionMetadata, decodes: list[ScheduledSeq]) -> None:
        bs = self.block_size
        context_lens = [d.seq.num_computed_tokens + 1 for d in decodes]
        firsts = [first_window_block(n - 1, self.sliding_window, bs) for n in context_lens]
        tables = [d.seq.block_table[f : -(-n // bs)] for d, f, n in zip(decodes, firsts, context_lens)]
        self._fill_decode_metadata(meta, context_lens, firsts, tables)

    def _fill_decode_metadata(
        self, meta: AttentionMetadata, context_lens: list[int], firsts: list[int], tables: list[list[int]]
    ) -> None:
        bs, dev = self.block_size, self.device
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        meta.num_decodes = len(tables)
        meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=dev)
        meta.decode_context_lens = torch.tensor(context_lens, dtype=torch.long, device=dev)
        meta.use_flash_attn = self.use_flash_attn
        first_pos = torch.tensor(firsts, dtype=torch.long, device=dev) * bs
        meta.decode_first_pos = first_pos
        if not self.use_flash_attn and self.attention_backend == "sdpa":
            meta.decode_mask = decode_mask(
                meta.decode_block_tables, meta.decode_context_lens, first_pos, bs, self.sliding_window
            )

    @torch.inference_mode()
    def forward_without_cache(self, token_ids: list[int]) -> torch.Tensor:
        """Logits of the last position from a full recomputation (the benchmark's baseline)."""
        dev = self.device
        meta = AttentionMetadata(
            write=None,
            prefills=[PrefillSpan(0, len(token_ids), len(token_ids), None)],
            sliding_window=self.sliding_window,
        )
        attn = PagedAttention(None, meta, self.model.attention_scale)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.arange(len(token_ids), device=dev),
            attn,
        )
        return self.model.compute_logits(hidden[-1:])
