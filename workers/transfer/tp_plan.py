"""Which prefill rank sends which KV heads to which decode rank, between tensor-parallel groups
of any sizes.

A tensor-parallel replica of ``tp`` ranks over a model with ``H`` KV heads holds, on rank ``r``,
heads ``[r * H / tp, (r + 1) * H / tp)`` when ``tp`` divides ``H``, and the one head
``r * H // tp`` (replicated over ``tp / H`` ranks) when ``H`` divides ``tp``; the query heads of
rank ``r`` use exactly those (``workers/models/parallel.py`` shards them so). Block ids are the same
on every rank, so a transfer moves the same blocks on every pair; only the heads differ.

For each decode rank, the plan names the prefill ranks holding its heads and the slices to send:
contiguous heads from one prefill rank travel as one slice, and where the prefill side replicates
a head, the decode ranks needing it are spread over its holders (so no prefill rank sends more
than its share). Only pairs that exchange data appear, so only those pair groups are made. Scale
rows of an int8/fp8 cache are rows of the same ``[rows, heads, dim]`` block, so they travel with
their heads.
"""

from __future__ import annotations

from dataclasses import dataclass


def heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> range:
    """The global KV heads ``rank`` of a ``tp``-rank replica holds."""
    check_tp(num_kv_heads, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {tp}")
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // tp
    return range(head, head + 1)


def check_tp(num_kv_heads: int, tp: int) -> None:
    if tp < 1 or num_kv_heads < 1:
        raise ValueError(f"tensor_parallel_size {tp} and num_kv_heads {num_kv_heads} must be positive")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp} and the model's {num_kv_heads} KV heads: one must divide the other"
        )


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """One prefill rank's part of one decode rank's receive: global heads ``heads``, at local
    head offsets ``src`` on the prefill rank and ``dst`` on the decode rank."""

    prefill_rank: int
    decode_rank: int
    heads: range
    src: range
    dst: range


@dataclass(frozen=True, slots=True)
class TPTransferPlan:
    num_kv_heads: int
    prefill_tp: int
    decode_tp: int
    slices: tuple[HeadSlice, ...]

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """(prefill rank, decode rank) pairs that exchange data: one pair group each."""
        return sorted({(s.prefill_rank, s.decode_rank) for s in self.slices})

    def sends(self, prefill_rank: int) -> list[HeadSlice]:
        return [s for s in self.slices if s.prefill_rank == prefill_rank]

    def receives(self, decode_rank: int) -> list[HeadSlice]:
        return [s for s in self.slices if s.decode_rank == decode_rank]


def plan_tp_transfer(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> TPTransferPlan:
    """The head slices each decode rank receives, from which prefill rank."""
    check_tp(num_kv_heads, prefill_tp)
    check_tp(num_kv_heads, decode_tp)
    holders: dict[int, list[int]] = {}  # global head -> prefill ranks holding it
    for rank in range(prefill_tp):
        for head in heads_of_rank(num_kv_heads, prefill_tp, rank):
            holders.setdefault(head, []).append(rank)
    slices: list[HeadSlice] = []
    for d in range(decode_tp):
        wanted = heads_of_rank(num_kv_heads, decode_tp, d)
        # decode ranks sharing a replicated head (and prefill ranks sharing one) pair off in turn
        replica = d % max(1, decode_tp // num_kv_heads)
        run: list[tuple[int, int]] = []  # (head, prefill rank) of the slice being built
        for head in wanted:
            owners = holders[head]
            source = owners[replica % len(owners)]
            if run and (run[-1][1] != source or run[-1][0] + 1 != head):
                slices.append(_slice(run, d, num_kv_heads, prefill_tp, wanted))
                run = []
            run.append((head, source))
        slices.append(_slice(run, d, num_kv_heads, prefill_tp, wanted))
    return TPTransferPlan(num_kv_heads, prefill_tp, decode_tp, tuple(slices))


def _slice(run: list[tuple[int, int]], decode_rank: int, num_kv_heads: int, prefill_tp: int, wanted: range):
    first, last, source = run[0][0], run[-1][0], run[0][1]
    held = heads_of_rank(num_kv_heads, prefill_tp, source)
    return HeadSlice(
        prefill_rank=source,
        decode_rank=decode_rank,
        heads=range(first, last + 1),
        src=range(first - held.start, last + 1 - held.start),
        dst=range(first - wanted.start, last + 1 - wanted.start),
    )
