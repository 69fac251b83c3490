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

The scheduler owns every request's status (``RequestStatus``): its methods are the only code
that changes one, each a transition allowed by ``TRANSITIONS``, and ``requests`` holds every
request not yet FINISHED. Disaggregation adds two statuses outside the batch: a decode worker's
request AWAITING_REMOTE_KV (blocks reserved, the prefill worker's KV in flight) and a prefill
worker's finished request HELD_FOR_DECODE (blocks kept until the decode side has pulled them).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvstore.hashing import BlockHash
from workers.engine.block_manager import BlockManager, CachedPrefix
from workers.engine.sequence import FinishReason, RequestStatus, Sequence

WAITING, RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING
AWAITING_REMOTE_KV, HELD_FOR_DECODE = RequestStatus.AWAITING_REMOTE_KV, RequestStatus.HELD_FOR_DECODE
FINISHED = RequestStatus.FINISHED

# A waiting request whose next prompt blocks a running prefill is computing waits for them when at
# least this many would be shared (32 tokens at the default block size, SGLang's threshold).
MIN_SHARED_BLOCKS = 2

# Every move a request may make; ``Scheduler._move`` refuses any other (an engine bug, not bad
# input). A new request enters WAITING or AWAITING_REMOTE_KV; FINISHED is the end.
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    WAITING: frozenset({RUNNING, FINISHED}),  # admitted; aborted
    RUNNING: frozenset({WAITING, HELD_FOR_DECODE, FINISHED}),  # preempted; done (held or not); aborted
    AWAITING_REMOTE_KV: frozenset({RUNNING, WAITING, FINISHED}),  # KV arrived; recompute; aborted
    HELD_FOR_DECODE: frozenset({FINISHED}),  # released or aborted
    FINISHED: frozenset(),
}


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """True when this step reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """One query token over a context already in the cache: it attends like a decode."""
        return self.num_new_tokens == 1 and self.seq.num_computed_tokens > 0


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledSeq]  # one new token each
    prefills: list[ScheduledSeq]  # chunks of prompts (or of recomputation after preemption)
    num_preempted: int

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.prefills)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_chunk_tokens: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_chunk_tokens = max_chunk_tokens or max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Sequence] = {}  # every request not FINISHED, by id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Seconds a step may wait for a tier load it starts (the engine sets it from its step
        # time; 0: never, the request joins a later step).
        self.inline_load_s = 0.0
        self.idle_load_s = 1.0  # the same when no sequence is running: it delays nobody
        # Counted once per request, at its first admission (``_count_prefix_lookup``).
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached

    # ----------------------------------------------------------------- queries
    @property
    def has_unfinished(self) -> bool:
        """Anything for ``schedule`` to do: a request waiting or running, or a tier load whose
        blocks ``schedule`` must settle (an aborted request's too)."""
        return bool(self.waiting or self.running or self.block_manager.loads)

    def get(self, request_id: str, status: RequestStatus | None = None) -> Sequence | None:
        """The request, if it is in the engine (and in ``status``, when given)."""
        seq = self.requests.get(request_id)
        return seq if seq is not None and (status is None or seq.status is status) else None

    def count(self, status: RequestStatus) -> int:
        if status is WAITING:
            return len(self.waiting)
        if status is RUNNING:
            return len(self.running)
        return sum(1 for seq in self.requests.values() if seq.status is status)

    # ------------------------------------------------------------- transitions
    def add(self, seq: Sequence, hold_kv: bool = False) -> None:
        """A new request joins the queue (WAITING). With ``hold_kv`` it ends HELD_FOR_DECODE,
        keeping its blocks, instead of FINISHED."""
        seq.status_when_done = HELD_FOR_DECODE if hold_kv else FINISHED
        self._register(seq, WAITING)
        self.waiting.append(seq)

    def reserve_remote(self, seq: Sequence, cached: CachedPrefix, num_cached_tokens: int) -> bool:
        """A new request whose prompt KV another worker computed: take blocks for its prompt,
        ``cached`` ones referenced (AWAITING_REMOTE_KV). ``num_cached_tokens`` counts the prompt
        tokens found cached, those outside a sliding window included. False when the blocks are
        not free: nothing is taken and the request is not in the engine."""
        if not self.block_manager.allocate_slots(seq, seq.num_prompt_tokens - cached.num_tokens, cached):
            return False
        self._register(seq, AWAITING_REMOTE_KV)
        self._count_prefix_lookup(seq, num_cached_tokens)
        return True

    def commit_remote(self, seq: Sequence) -> None:
        """AWAITING_REMOTE_KV -> RUNNING: the reserved blocks hold the prompt's KV now."""
        self._move(seq, RUNNING, source=AWAITING_REMOTE_KV)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.cache_full_blocks(seq)
        seq.first_scheduled_time = time.monotonic()
        self.running.append(seq)

    def recompute_remote(self, seq: Sequence) -> None:
        """AWAITING_REMOTE_KV -> WAITING: no KV arrives; the reserved blocks are freed and the
        prompt is computed here (the output is the same)."""
        self._move(seq, WAITING, source=AWAITING_REMOTE_KV)
        self.block_manager.free(seq)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """RUNNING -> ``seq.status_when_done``: FINISHED frees the blocks, HELD_FOR_DECODE keeps
        them for the decode side's pull."""
        self._move(seq, seq.status_when_done, source=RUNNING)
        self.running.remove(seq)
        seq.finish_reason = reason
        if seq.status is FINISHED:
            self.block_manager.free(seq)

    def hold(self, seq: Sequence) -> None:
        """RUNNING -> HELD_FOR_DECODE before it finished: a decode worker moves the running
        sequence to another worker, which pulls its blocks and goes on from its last token."""
        self._move(seq, HELD_FOR_DECODE, source=RUNNING)
        self.running.remove(seq)

    def hold_copy(self, seq: Sequence, num_blocks: int, copy: Sequence) -> None:
        """``copy`` (new) holds another reference to ``seq``'s first ``num_blocks`` blocks, full
        ones that no step writes again (HELD_FOR_DECODE): a live migration's pre-copy, sent while
        ``seq`` goes on."""
        copy.status_when_done = FINISHED
        self.block_manager.share_blocks(seq, num_blocks, copy)
        self._register(copy, HELD_FOR_DECODE)

    def cache_remote(self, seq: Sequence) -> None:
        """AWAITING_REMOTE_KV -> FINISHED with its received full blocks left in the prefix cache
        (a live migration's pre-copy: the blocks wait there for the stream that follows)."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.cache_full_blocks(seq)
        self._move(seq, FINISHED, source=AWAITING_REMOTE_KV)
        self.block_manager.free(seq)

    def release(self, seq: Sequence) -> None:
        """HELD_FOR_DECODE -> FINISHED: the decode side has the KV (or never will)."""
        self._move(seq, FINISHED, source=HELD_FOR_DECODE)
        self.block_manager.free(seq)

    def abort(self, seq: Sequence) -> None:
        """Any status -> FINISHED (reason ABORT); every block the request holds is freed."""
        status = seq.status
        self._move(seq, FINISHED)
        if status is RUNNING:
            self.running.remove(seq)
        elif status is WAITING:
            self.waiting.remove(seq)
        seq.finish_reason = FinishReason.ABORT
        self.block_manager.free(seq)

    # -------------------------------------------------------------- scheduling
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

        computing = self._blocks_being_computed(scheduled) if self.waiting else set()
        self.block_manager.finish_loads()
        w = 0
        while w < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[w]
            cached = self.block_manager.find_cached_prefix(seq)
            if self._shares_blocks_being_computed(seq, len(cached.blocks), computing):
                w += 1  # admitted once they are cached; later requests may go first
                continue
            if self._loading_from_tiers(seq, cached):
                w += 1  # admitted once its blocks are back in the device pool; the batch goes on
                continue
            if seq.kv_load is False:  # its load just ended within this step: the cache has it now
                seq.kv_load = None
                cached = self.block_manager.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - cached.num_tokens, budget, self.max_chunk_tokens)
            if not self.block_manager.allocate_slots(seq, num_new, cached):
                break
            del self.waiting[w]
            self._move(seq, RUNNING, source=WAITING)
            seq.num_computed_tokens = cached.num_tokens
            self._count_prefix_lookup(seq, cached.num_tokens)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            computing.update(self._uncomputed_full_blocks(seq))
        decodes = [s for s in scheduled if s.is_decode]
        prefills = [s for s in scheduled if not s.is_decode]
        return SchedulerOutput(decodes, prefills, preempted)

    @property
    def loading(self) -> list:
        """Tier loads under way (``LoadJob``s)."""
        return self.block_manager.loads

    # --------------------------------------------------------------- internal
    def _loading_from_tiers(self, seq: Sequence, cached: CachedPrefix) -> bool:
        """True while the sequence waits for a tier load: one starts, at its first admission
        attempt, when a lower tier holds the blocks after its device-cached prefix and the
        device pool can take them while leaving room for the rest of its prompt."""
        job = seq.kv_load
        if job is not None:
            if not job.done.is_set() or job in self.block_manager.loads:
                return True
            seq.kv_load = None  # loaded and registered: ``cached`` found them
            return False
        if seq.tiers_looked:
            return False
        metas = self.block_manager.find_in_tiers(seq, cached)
        if not metas:
            seq.tiers_looked = True
            return False
        rest = -(-(seq.num_tokens - cached.num_tokens) // self.block_manager.block_size) - len(metas)
        job = self.block_manager.start_load(metas, cached, reserve=max(rest, 0))
        # No room now: admission (which needs more blocks still) waits too; look again next step.
        seq.tiers_looked = job is not None
        if job is None:
            return False
        # A short load is waited for here, so the request joins this step rather than the next:
        # the batch loses at most ``inline_load_s``, the request a whole step.
        allowance = self.inline_load_s if self.running else self.idle_load_s  # idle: nobody waits for it
        if allowance > 0 and job.done.wait(allowance):
            self.block_manager.finish_loads()
            seq.kv_load = False  # loaded: the caller looks the cache up again
            return False
        seq.kv_load = job
        return True

    def _uncomputed_full_blocks(self, seq: Sequence) -> list[BlockHash]:
        """Hashes of the sequence's full blocks that are not computed yet: what its prefill
        will add to the prefix cache."""
        if not self.block_manager.enable_prefix_caching:
            return []
        first = seq.num_computed_tokens // self.block_manager.block_size
        return self.block_manager.block_hashes(seq)[first:]

    def _blocks_being_computed(self, scheduled: list[ScheduledSeq]) -> set[BlockHash]:
        computing: set[BlockHash] = set()
        for s in scheduled:
            if not s.is_decode:  # a prefill chunk
                computing.update(self._uncomputed_full_blocks(s.seq))
        return computing

    def _shares_blocks_being_computed(self, seq: Sequence, num_cached_blocks: int, computing: set[BlockHash]) -> bool:
        """True when the blocks right after the waiting sequence's cached prefix are ones a
        running prefill is computing now, at least ``MIN_SHARED_BLOCKS`` of them: it waits for
        them to be cached rather than compute them a second time (as SGLang's in-batch prefix
        caching does). A request asking for prompt logprobs takes no hit
        (``find_cached_prefix``) and never waits."""
        if not computing or seq.params.prompt_logprobs is not None:
            return False
        max_blocks = (seq.num_tokens - 1) // self.block_manager.block_size
        ahead = self.block_manager.block_hashes(seq)[num_cached_blocks:max_blocks]
        return len(ahead) >= MIN_SHARED_BLOCKS and all(h in computing for h in ahead[:MIN_SHARED_BLOCKS])

    def _preempt(self, seq: Sequence) -> None:
        """RUNNING -> WAITING, at the front of the queue, blocks freed: recomputed from scratch."""
        self._move(seq, WAITING, source=RUNNING)
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.tiers_looked = False  # its blocks may have gone down meanwhile
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _count_prefix_lookup(self, seq: Sequence, num_cached_tokens: int) -> None:
        """The one place prefix-cache hits are counted: a request's first admission (to the
        batch or to a remote-KV reservation). A recompute after preemption or a failed transfer
        looks the cache up again but is the same request: not counted twice."""
        if seq.num_cached_tokens is not None:
            return
        seq.num_cached_tokens = num_cached_tokens
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += num_cached_tokens

    def _register(self, seq: Sequence, status: RequestStatus) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        seq.status = status
        self.requests[seq.request_id] = seq

    def _move(self, seq: Sequence, status: RequestStatus, source: RequestStatus | None = None) -> None:
        """Set the status; ``source``: the only status the caller's transition starts from."""
        if status not in TRANSITIONS[seq.status] or source not in (None, seq.status):
            expected = f" (this transition starts from {source.value})" if source is not None else ""
            raise RuntimeError(
                f"request {seq.request_id!r}: {seq.status.value} -> {status.value} "
                f"is not a request transition{expected}"
            )
        seq.status = status
        if status is FINISHED:
            del self.requests[seq.request_id]
