"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each step schedules running sequences first (decodes take one token, unfinished prefills their
next chunk), then admits waiting sequences first-come-first-served while budget, sequence slots
and blocks last. A waiting sequence is admitted with its cached prefix blocks referenced.

When a running sequence needs a block and none is free, the most recently admitted running
sequence is preempted: its blocks are freed (cached ones stay revivable) and it goes back to
the front of the queue with ``num_computed_tokens = 0``; recomputing prompt + output so far
reproduces its state exactly. No sequence is admitted in a step that preempted.

``max_chunk_tokens`` caps one prefill chunk (sliding-window models: a chunk's blocks plus the
window's must fit in the cache, so a prompt longer than the cache still runs, chunk by chunk).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """True when this step reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledSeq]  # one new token each
    prefills: list[ScheduledSeq]  # chunks of prompts (or of recomputation after preemption)
    num_preempted: int

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.prefills)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_chunk_tokens: int | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_chunk_tokens = max_chunk_tokens or max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = 0

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, self.max_chunk_tokens)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
                continue
            # seq itself was preempted: everything after it is gone too; stop
            break

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            cached = self.block_manager.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - cached.num_tokens, budget, self.max_chunk_tokens)
            if not self.block_manager.allocate_slots(seq, num_new, cached):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = cached.num_tokens
            if seq.num_cached_tokens is None:  # report the first admission, not a recompute
                seq.num_cached_tokens = cached.num_tokens
                stats = self.block_manager.stats
                stats.prefix_queries += seq.num_prompt_tokens
                stats.prefix_hits += cached.num_tokens
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        # One query token over a context already in the cache attends like a decode.
        decodes = [s for s in scheduled if s.num_new_tokens == 1 and s.seq.num_computed_tokens > 0]
        prefills = [s for s in scheduled if not (s.num_new_tokens == 1 and s.seq.num_computed_tokens > 0)]
        return SchedulerOutput(decodes, prefills, preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
