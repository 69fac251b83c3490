"""Turns a scheduled step into tensors, runs the model over the paged cache, returns logits.

Only rows that end a sequence's scheduled tokens (and reach its last token) go through the LM
head: a 300-token prefill chunk costs one row of logits, not 300.
"""

from __future__ import annotations

import torch

from workers.engine.attention import AttentionMetadata, PagedAttention, PrefillSpan, flash_attn_usable
from workers.engine.scheduler import ScheduledSeq, SchedulerOutput
from workers.models.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = kv_caches[0].device
        self.use_flash_attn = flash_attn_usable(self.device, block_size)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run one step. Returns logits ``[N, V]`` for the N sequences that sample, in order."""
        items = out.decodes + out.prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        bs = self.block_size
        for item in items:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if item.completes:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(item)

        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev))
        if out.decodes:
            self._decode_metadata(meta, out.decodes)
        row = len(out.decodes)
        for item in out.prefills:
            context_len = item.seq.num_computed_tokens + item.num_new_tokens
            table = None
            if context_len != item.num_new_tokens:
                num_blocks = -(-context_len // bs)
                table = torch.tensor(item.seq.block_table[:num_blocks], dtype=torch.long, device=dev)
            meta.prefills.append(PrefillSpan(row, item.num_new_tokens, context_len, table))
            row += item.num_new_tokens

        attn = PagedAttention(self.kv_caches, meta, self.model.attention_scale)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            attn,
        )
        if not sample_rows:
            return hidden.new_empty((0, 0), dtype=torch.float32), sampled
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        return logits, sampled

    def _decode_metadata(self, meta: AttentionMetadata, decodes: list[ScheduledSeq]) -> None:
        bs, dev = self.block_size, self.device
        context_lens = [d.seq.num_computed_tokens + 1 for d in decodes]
        max_blocks = max(-(-n // bs) for n in context_lens)
        tables = [d.seq.block_table[:max_blocks] for d in decodes]
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        meta.num_decodes = len(decodes)
        meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=dev)
        meta.decode_context_lens = torch.tensor(context_lens, dtype=torch.long, device=dev)
        meta.use_flash_attn = self.use_flash_attn
        if not self.use_flash_attn:
            key_pos = torch.arange(max_blocks * bs, device=dev)
            meta.decode_mask = (key_pos[None, :] < meta.decode_context_lens[:, None])[:, None, None, :]

    @torch.inference_mode()
    def forward_without_cache(self, token_ids: list[int]) -> torch.Tensor:
        """Logits of the last position from a full recomputation (the benchmark's baseline)."""
        dev = self.device
        meta = AttentionMetadata(slot_mapping=None, prefills=[PrefillSpan(0, len(token_ids), len(token_ids), None)])
        attn = PagedAttention(None, meta, self.model.attention_scale)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.arange(len(token_ids), device=dev),
            attn,
        )
        return self.model.compute_logits(hidden[-1:])
