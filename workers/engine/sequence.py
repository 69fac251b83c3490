"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.hashing import BlockHash
from workers.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in the engine. Only ``Scheduler`` methods change it (see its
    ``TRANSITIONS``); every status but FINISHED keeps the request in the engine's table."""

    WAITING = "waiting"  # queued for admission: new, preempted, or recomputing a failed transfer
    RUNNING = "running"  # in the batch: its blocks cover its computed tokens
    AWAITING_REMOTE_KV = "awaiting_remote_kv"  # decode side: blocks reserved, another worker's KV in flight
    HELD_FOR_DECODE = "held_for_decode"  # prefill side: generation done, blocks kept until release_kv
    FINISHED = "finished"  # gone from the engine, blocks freed


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(eq=False)
class Sequence:
    """Prompt + generated tokens, the KV blocks that hold them, and progress through them.

    ``num_computed_tokens`` counts tokens whose KV is in ``block_table``; the next step computes
    ``token_ids[num_computed_tokens:]`` (or a chunk of it). A step that reaches the end samples
    one new token. Preemption frees the blocks and sets it back to 0: the same loop recomputes.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    # With ``params.structured``: its grammar's matcher (workers/engine/structured.py), advanced
    # over every generated token.
    grammar: Any = None

    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    # The status it takes when generation ends: FINISHED frees the blocks; HELD_FOR_DECODE (a
    # prefill worker's request, ``add_request(hold_kv=True)``) keeps them for the decode side.
    status_when_done: RequestStatus = RequestStatus.FINISHED
    finish_reason: FinishReason | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0  # leading full blocks already registered in the prefix cache
    num_dropped_blocks: int = 0  # leading table entries released (sliding window): NULL_BLOCK
    num_cached_tokens: int | None = None  # prompt tokens served from the cache at first admission
    num_preemptions: int = 0
    # Waiting for blocks a lower KV tier is loading (``BlockManager.start_load``): a LoadJob
    # (False for the moment between a load that ended within the step and the cache look-up).
    # ``tiers_looked``: this admission attempt already looked in the tiers (one load per attempt).
    kv_load: Any = None
    tiers_looked: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With ``params.prompt_logprobs``: entry i is prompt token i given tokens [0, i) (entry 0 is
    # None: nothing precedes it), filled chunk by chunk as the prompt is computed.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def between_decode_steps(self) -> bool:
        """It has generated, and every token but the last sampled one is computed: the state a
        finished prefill hands over, so it can move to another worker as one."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        """Generation is over (its blocks may still be held for the decode side)."""
        return self.status in (RequestStatus.HELD_FOR_DECODE, RequestStatus.FINISHED)

    def prompt_logprob_targets(self, start: int, end: int) -> range:
        """Positions whose logits a step computing tokens ``[start, end)`` must add to
        ``prompt_logprobs``: position p predicts prompt token p + 1. Empty without
        ``prompt_logprobs``, and for positions already done (a recompute after preemption)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        done = len(self.prompt_logprobs) - 1  # positions already scored
        if start > done:  # positions before this step's were not computed here (a cache hit)
            return range(0)
        return range(done, min(end, self.num_prompt_tokens - 1))

    @property
    def generated_token_ids(self) -> list[int]:
        """Every token generated for this request, those of a stream resumed here included
        (they end the prompt: ``params.output_position_offset`` of them)."""
        offset = self.params.output_position_offset
        earlier = self.prompt_token_ids[len(self.prompt_token_ids) - offset :] if offset else []
        return earlier + self.output_token_ids

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
