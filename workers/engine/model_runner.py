"""Turns a scheduled step into tensors, runs the model over the paged cache, returns logits.

Only rows that end a sequence's scheduled tokens (and reach its last token) go through the LM
head: a 300-token prefill chunk costs one row of logits, not 300. A request asking for prompt
logprobs also sends its chunk's prompt rows through it (in slices, so a long chunk never holds
``[tokens, vocab]`` logits at once) and gets their logprobs back.

With a sliding window, each sequence's attention reads blocks from ``first_window_block`` on:
earlier ones are outside every future query's window (and freed).

Everything device-specific comes from the engine's backend (``workers/backends``): the
attention object of each step (by ``EngineConfig.attention_backend``, or the backend's own
choice for "auto"; built or compiled here at start-up), and the torch threads of a step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from workers.backends.base import Backend
from workers.engine.block_manager import first_window_block
from workers.engine.compiled import CompiledDecode
from workers.engine.sampler import prompt_logprobs
from workers.engine.scheduler import ScheduledSeq, SchedulerOutput
from workers.engine.sequence import Sequence, TokenLogprob
from workers.layers.kv_cache import PagedKVCache
from workers.layers.paged_attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillSpan,
)
from workers.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

PROMPT_LOGITS_ROWS = 512  # rows of prompt logits computed at once ([rows, vocab] fp32)

# One sequence's prompt logprobs from a step: (sequence, first position scored, logprobs); the
# logprob at position p is prompt token p + 1's.
PromptLogprobs = tuple[Sequence, int, list[TokenLogprob]]


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


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: PagedKVCache,
        backend: Backend,
        sliding_window: int | None = None,
        compiled: CompiledDecode | None = None,
        progress: bool = False,
    ) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.block_size = kv.block_size
        self.sliding_window = sliding_window
        self.device = kv.layers[0].device
        self.threads = backend.step_threads()  # a step's torch threads by its kind
        self.attention_backend = kind = backend.attention_kind(kv)
        self._attention = backend.attention(kind, kv, sliding_window)
        progress = progress and kind != "sdpa"  # sdpa builds nothing
        if progress:
            logger.info("building the %s attention kernels (once per model shape)", kind)
        start = time.perf_counter()
        group = model.config.num_heads // model.config.num_kv_heads
        backend.warm_up_attention(kind, kv, model.attention_scale, kv.num_kv_heads * group, sliding_window)
        if progress:
            logger.info("%s attention ready in %.1f s", kind, time.perf_counter() - start)
        self.compiled = compiled  # decode-only steps of up to its largest bucket run compiled
        if compiled is not None:
            compiled.warm_up(self._scratch_attention, progress)

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq], list[PromptLogprobs]]:
        """Run one step. Returns logits ``[N, V]`` for the N sequences that sample, in order, and
        the prompt logprobs of the positions this step computed for requests that ask for them.
        The step runs on ``self.threads.for_step(out)`` torch threads when that is set."""
        threads = self.threads.for_step(len(out.prefills), len(out.decodes))
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
        meta.decode_first_pos = torch.tensor(firsts, dtype=torch.long, device=dev) * bs

    @torch.inference_mode()
    def forward_without_cache(self, token_ids: list[int]) -> torch.Tensor:
        """Logits of the last position from a full recomputation (the benchmark's baseline)."""
        dev = self.device
        meta = AttentionMetadata(
            write=None,
            prefills=[PrefillSpan(0, len(token_ids), len(token_ids), None)],
            sliding_window=self.sliding_window,
        )
        attn = PagedAttention(None, meta, self.model.attention_scale, self.backend.ops)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.arange(len(token_ids), device=dev),
            attn,
        )
        return self.model.compute_logits(hidden[-1:])
