"""The P/D-aware autoscaling policy (``autoscaling: pd``): one decision for both pools, as a pure
function of their signals (``decide``: signals and the previous state in, replica counts and
the next state out). ``deploy/pools/autoscaler.py`` runs it and applies what it decides.

What Ray Serve 2.60 offers, and why pdserve runs its own loop (read in the installed
``ray/serve``):

- Replica-reported custom stats work: a deployment method ``record_autoscaling_stats()``
  returning ``{name: number}`` is polled by the replica (Serve's replica code,
  ``_fetch_custom_autoscaling_metrics``) and reaches a policy as ``ctx.aggregated_metrics``;
  but only for a deployment that has an ``autoscaling_config``.
- Custom policies work per deployment (``autoscaling_config.policy.policy_function``): each sees
  its own deployment's ``AutoscalingContext``, never the other pool's, so a joint decision within
  one budget cannot be written as one.
- An application-level policy exists in the controller (``ApplicationAutoscalingState``: one
  call with every deployment's context), but only through the declarative config path
  (``ServeApplicationSchema.autoscaling_policy``, whose own description says "under development
  and not yet supported"); ``serve.run``, which ``pdserve up``, the tests and the benchmarks use,
  has no such argument.
- External scaling is public: ``serve.run(..., external_scaler_enabled=True)`` (or
  ``external_scaler_enabled: true`` on the application in a Serve config) hands the
  deployments' replica counts to an outside caller, and ``POST /api/v1/applications/<app>/
  deployments/<name>/scale`` on the Ray dashboard (``ScaleDeploymentRequest``) sets one; that
  endpoint forwards to the controller's ``update_deployment_replicas``, which refuses unless the
  application enabled external scaling.

So the policy lives here, the pools are deployed with ``external_scaler_enabled``, and a small
controller deployment (``deploy/pools/autoscaler.py``) reads the replicas' own stats (the ``stats``
call ``pdserve status`` uses), decides, and sets each pool's target through the external-scaler
entry point, the dashboard's REST API (``autoscaling.dashboard_url``; by default port 8265 on
the head, where the autoscaler replica is placed): the only public way to set a replica count
from inside the cluster, so an application with ``autoscaling: pd`` needs the Ray dashboard.

The policy, per decision:

- prefill need (replicas, fractional) = max(queued prompt tokens / (tokens/s per replica x
  ``drain_fraction`` x TTFT target), pool prompt tokens/s / (tokens/s per replica x
  ``utilization``), the replicas at which ``ttft_quantile`` of arriving prompts wait no
  longer than the TTFT target leaves after their own prefill, by an M/G/c queue of the recent
  arrivals/s and mean prompt: the fewest whole replicas c that do, less how far c - 1 are from
  it, interpolated in log scale of the late share): enough replicas to drain the queue well
  within the TTFT target, to keep up with what arrives, and to keep queueing out of the TTFT. Tokens/s per replica is
  measured while replicas are busy (a prior until then, never below what the pool computes per
  replica). While decode sequences wait for
  blocks and prefill replicas hold half their KV or more for prompts decode has not taken, the
  queue term is dropped: that queue is decode's (counted, it moves replicas to prefill and
  starves both pools).
- decode need = the larger of what it holds and what its inflow will hold. Held: replicas x
  max(TPOT / TPOT target, KV usage / KV target), scaled up by waiting / running sequences when
  sequences wait for blocks. Inflow (Little's law): sequences prefill hands over per second x
  (their expected decode tokens x decode's recent TPOT + the measured overhead of a stay: its
  pull, waits for a step) = sequences resident, x the blocks each
  holds (prompt + half its output), over a replica's blocks at the KV target. The held KV alone
  is a snapshot that lags: decode can read little used while prompts are on their way, give a
  replica to prefill, and soon after be full with sequences waiting. Expected
  decode tokens = the handed-over requests' ``max_tokens`` x the share of their ``max_tokens``
  that finished sequences used (a chat request without ``max_tokens`` asks for all the context).
- each pool's count follows its need with a dead band (up once need > count + ``up_tolerance``,
  down once count - 1 replicas would run below ``down_utilization`` of their targets), within its
  bounds; when the two exceed the budget, each pool keeps what its own dead band would keep
  unless the other pool's need is ``take_ratio`` (1.5) times its count or more, and the rest go
  one by one to the pool whose need is least covered: a pool 10 % over its count does not take
  a replica the other pool needs 90 % of.
- budget left over after that (``fill_budget``, on by default: the budget is the GPUs the
  deployment holds anyway) goes one replica at a time to the pool whose need is least covered,
  as long as that pool would keep it: its need stays above ``down_utilization`` of the larger
  count, so its own dead band would not take it back. With the budget full the fill alone moves
  no replica from one pool to the other: a pool whose need is low keeps its replicas until the
  other pool needs them (``needs_growth``); a move costs a replica's stop and start, and the
  move back when the load shifts again. When the other pool does need them, the shrinking pool
  hands them over in the same change, not after a cooldown (shrinking first left the budget
  idle while the growing pool waited out the cooldown).
- with the budget full, a change moves at most ``move_step`` replicas (default 1) from one pool
  to the other: the needs are snapshots (decode's KV usage reads low until the next few
  long sequences land), and unbounded moves swung the split back and forth within minutes, each
  move a replica stopping and another loading its model. A larger shift takes
  one change per cooldown, unless the growing pool needs at least the count a double step gives
  it (need >= count + 2): then a change moves two.
- each pool's need is the median of the rounds' needs over ``look_back_s`` (10 s, five rounds):
  one round's need is a snapshot of a few sequences (decode's jumps up and down between
  consecutive rounds as bursts wait for blocks), and each flip would restart the delay below.
- a proposed change is applied only once it has held for ``upscale_delay_s`` (some pool grows,
  by its own need or by taking budget another pool gives up) or ``downscale_delay_s`` (only
  shrinking), and not while the last change is still landing (replicas starting or stopping) or
  within ``cooldown_s`` of it: no oscillation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

BLOCKED_BY_DECODE = 0.5  # prefill KV share held for decode beyond which prefill waits on decode


@dataclass(frozen=True)
class PoolBounds:
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True)
class PolicyConfig:
    max_total_replicas: int
    prefill: PoolBounds
    decode: PoolBounds
    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.1
    kv_usage_target: float = 0.8
    prefill_tokens_per_s: float = 2000.0  # per replica, until measured
    drain_fraction: float = 0.5  # the queue should drain within this share of the TTFT target
    utilization: float = 0.8  # of a prefill replica's measured tokens/s
    up_tolerance: float = 0.1
    down_utilization: float = 0.7
    upscale_delay_s: float = 4.0
    downscale_delay_s: float = 30.0
    cooldown_s: float = 10.0
    landing_timeout_s: float = 120.0  # a change not landed by then no longer holds decisions
    fill_budget: bool = True  # budget neither pool wants goes to a pool that would keep it
    move_step: int = 1  # with the budget full, replicas one change moves between the pools (0: any)
    take_ratio: float = 1.5  # a pool takes replicas the other would keep only when its need is this x its count
    ttft_quantile: float = 0.9  # prefill is sized so that this share of prompts waits no longer than the TTFT allows
    look_back_s: float = 10.0  # each pool's need is the median of its rounds' needs over this window (0: the last)
    # decode's held KV counts only what running sequences will still hold this long from now (0: all of it)
    kv_look_ahead_s: float = 10.0


@dataclass(frozen=True)
class PrefillSignals:
    replicas: int  # the pool's current target
    ready_replicas: int  # replicas answering now
    queued_prompt_tokens: int  # prompt tokens not yet computed, waiting or running, pool-wide
    prompt_tokens_per_s: float  # computed by the pool, recent
    tokens_per_s_per_replica: float | None  # measured while busy; None: not measured yet
    held_kv_fraction: float = 0.0  # of the pool's KV, held by finished prompts decode has not taken
    # requests arriving at the pool per second (recent, smoothed) and their mean prompt tokens
    arrivals_per_s: float = 0.0
    mean_prompt_tokens: float = 0.0
    prompt_tokens_cv2: float = 1.0  # squared coefficient of variation of their prompt tokens
    # Serve's replicas of the pool are as many as the target and none is starting (None: taken as
    # ready_replicas == replicas); a replica slow to answer a stats call is not a change landing
    settled: bool | None = None


@dataclass(frozen=True)
class DecodeSignals:
    replicas: int
    ready_replicas: int
    running_seqs: int
    waiting_seqs: int
    kv_usage: float  # mean over the pool's replicas, 0..1
    tpot_s: float | None  # recent time per output token of a running sequence; None: idle
    # what prefill hands over (decode's inflow): sequences per second, recent; each one's expected
    # decode tokens (its max_tokens x the share finished sequences used) and prompt tokens
    inflow_seqs_per_s: float = 0.0
    expected_output_tokens: float = 0.0
    inflow_prompt_tokens: float = 0.0
    blocks_per_replica: int = 0  # a decode replica's KV blocks
    # seconds a sequence holds decode's KV per token it produces: decode's recent TPOT (or the wall
    # time per token of finished sequences, where longer), kept while idle; None: never measured
    residency_tpot_s: float | None = None
    # what a finished sequence held decode's KV before its first decoded token (its pull, a wait
    # in the engine's queue), recent mean
    residency_overhead_s: float = 0.0
    # means over the hand-overs of prompt tokens x expected output tokens and of expected output
    # tokens²; None: taken as independent (the products of the means)
    inflow_prompt_x_output: float | None = None
    inflow_output_sq: float | None = None
    block_size: int = 16
    # every running sequence's (tokens it may still produce, KV blocks it holds), pool-wide, and
    # the pool's blocks; None: not reported (the held KV is then taken as lasting)
    running_left: tuple[tuple[int, int], ...] | None = None
    total_blocks: int = 0
    # a decode step's seconds = fixed + per row x its rows, fitted over the pool's recent steps;
    # None: not fitted (too few steps, or rows that hardly varied): TPOT is taken as growing in
    # proportion to a replica's rows
    step_fixed_s: float | None = None
    step_per_row_s: float | None = None
    settled: bool | None = None  # as PrefillSignals.settled


@dataclass(frozen=True)
class PolicyState:
    pending: tuple[int, int] | None = None  # the proposal waiting out its delay
    pending_since: float | None = None
    last_change: float | None = None  # the controller starts it at its own start
    # recent rounds' (time, prefill need, decode need), within the look-back window
    needs: tuple[tuple[float, float, float], ...] = ()


@dataclass(frozen=True)
class Decision:
    prefill: int
    decode: int
    changed: bool
    prefill_need: float
    decode_need: float
    state: PolicyState = field(default_factory=PolicyState)
    held: str | None = None  # why a wanted change waits (delay, cooldown, landing)


def prefill_need(s: PrefillSignals, config: PolicyConfig, decode_saturated: bool = False) -> float:
    """The largest of: the replicas that drain the queue within ``drain_fraction`` of the TTFT
    target, those that keep up with what the pool computes at ``utilization``, and those that
    keep the queueing wait of arriving prompts within the TTFT target (``ttft_need``).
    ``decode_saturated``: decode sequences wait for blocks. When prefill replicas then hold
    most of their KV for prompts decode has not taken, their queue is decode's to drain: only
    what they compute counts (more prefill replicas would only hold more). A replica's tokens/s
    is at least what the pool computes per replica (the prior may be low)."""
    ready = max(1, s.ready_replicas)
    rate = max(s.tokens_per_s_per_replica or config.prefill_tokens_per_s, s.prompt_tokens_per_s / ready)
    keep_up = s.prompt_tokens_per_s / (rate * config.utilization)
    if decode_saturated and s.held_kv_fraction >= BLOCKED_BY_DECODE:
        return keep_up
    drain = s.queued_prompt_tokens / (rate * config.drain_fraction * config.ttft_target_s)
    slo = ttft_need(s.arrivals_per_s, s.mean_prompt_tokens / rate, config, s.prompt_tokens_cv2)
    return max(drain, keep_up, slo)


MAX_TTFT_REPLICAS = 64  # ttft_need's search stops here


def erlang_c(servers: int, load: float) -> float:
    """The probability that an arrival waits in an M/M/c queue with ``servers`` servers and
    ``load`` = arrivals/s x service seconds (1 when load >= servers: the queue grows)."""
    if load >= servers:
        return 1.0
    blocking = 1.0  # Erlang B, by its recurrence (stable for any number of servers)
    for k in range(1, servers + 1):
        blocking = load * blocking / (k + load * blocking)
    return blocking / (1.0 - (load / servers) * (1.0 - blocking))


def late_share(servers: int, arrivals_per_s: float, service_s: float, slack_s: float, spread: float) -> float:
    """The share of arrivals that wait longer than ``slack_s`` at ``servers`` replicas: Erlang C
    times the M/M/c wait's exponential tail, its time scaled by ``spread`` (1 when the queue
    grows, or with no server)."""
    load = arrivals_per_s * service_s
    if servers < 1 or load >= servers:
        return 1.0
    return erlang_c(servers, load) * math.exp(-(servers / service_s - arrivals_per_s) * slack_s / spread)


def ttft_need(arrivals_per_s: float, service_s: float, config: PolicyConfig, service_cv2: float = 1.0) -> float:
    """The prefill replicas at which ``ttft_quantile`` of arriving prompts start within the TTFT
    target less their own prefill time, as a fraction: the fewest whole replicas that meet it,
    c, less how far c - 1 replicas are from meeting it (the late share interpolated between
    c - 1 and c in log scale; 0 replicas leave every arrival late). So c - 1 < need <= c, and the
    need falls with the load: as a whole count, a trickle of arrivals needed exactly 1 replica,
    and a pool of 2 never shrank (its dead band keeps 2 for a need above 0.7 x 1); an idle pool
    held a test's second replica for minutes.
    The pool is an M/G/c queue: Poisson arrivals,
    and the wait of an M/M/c queue (Erlang C, an exponential tail) scaled by (1 + cv²) / 2 for
    the service times' variability (Allen-Cunneen; ``service_cv2`` = the squared coefficient of
    variation of the prompts' lengths: 0 for equal prompts, whose waits are half an M/M/c's).
    The keep-up term alone, at 80 % utilization, keeps too few replicas when each prompt takes
    much of the TTFT target: just under that utilization a large share of arrivals wait longer
    than the target leaves them after their own prefill, and one replica more brings that share
    down to a few. When a prompt alone takes the whole target no count meets it; the need is
    then the load at ``utilization``."""
    if arrivals_per_s <= 0 or service_s <= 0:
        return 0.0
    load = arrivals_per_s * service_s
    slack = config.ttft_target_s - service_s
    if slack <= 0:
        return load / config.utilization
    allowed = 1.0 - config.ttft_quantile
    spread = (1.0 + max(0.0, service_cv2)) / 2.0
    servers = max(1, math.floor(load) + 1)
    before = 1.0  # the late share at servers - 1: at most the load, where the queue grows
    while servers < MAX_TTFT_REPLICAS:
        late = late_share(servers, arrivals_per_s, service_s, slack, spread)
        if late <= allowed:
            short = math.log(before / allowed) / math.log(before / max(late, 1e-300))
            return servers - 1 + min(1.0, max(0.0, short))
        before = late
        servers += 1
    return float(MAX_TTFT_REPLICAS)


def decode_need(s: DecodeSignals, config: PolicyConfig) -> float:
    """The largest of what decode holds now (``held_need``), what its inflow will hold
    (``inflow_need``), and ``ahead_need``: the KV still held ``kv_look_ahead_s`` from now."""
    return max(held_need(s, config), inflow_need(s, config), ahead_need(s, config))


def ahead_need(s: DecodeSignals, config: PolicyConfig) -> float:
    """Replicas for the KV held ``kv_look_ahead_s`` from now: what running sequences will still
    hold then (``kv_usage_ahead``) plus what the inflow brings in meanwhile and still holds then
    (its steady need x look-ahead / a stay, at most all of it). Either alone reads low while
    sequences end and others take their place: by either alone, decode under a steady mix read
    a need of well under one replica while its replicas held half their KV, shrank to one, and
    that one then ran full with sequences waiting."""
    inflow = inflow_need(s, config)
    if inflow > 0 and s.residency_tpot_s is not None and config.kv_look_ahead_s > 0:
        stay = s.expected_output_tokens * s.residency_tpot_s + s.residency_overhead_s
        inflow *= min(1.0, config.kv_look_ahead_s / stay) if stay > 0 else 1.0
    return s.replicas * kv_usage_ahead(s, config) / config.kv_usage_target + inflow


def kv_usage_ahead(s: DecodeSignals, config: PolicyConfig) -> float:
    """Decode's KV usage ``kv_look_ahead_s`` from now: today's, less the blocks of running
    sequences that will have finished by then (tokens they may still produce x TPOT; their
    max_tokens is an upper bound, so this errs toward holding). A change of the split lands
    seconds after it is decided, and a decode replica given up drains its sequences first: the
    blocks that matter are those still held then. By today's usage alone, decode replicas whose
    sequences are all about to end keep their replicas through a shift to prompt-heavy load,
    and prefill stays short of one for much of it."""
    tpot = s.tpot_s if s.tpot_s is not None else s.residency_tpot_s
    if not s.running_left or tpot is None or s.total_blocks <= 0 or config.kv_look_ahead_s <= 0:
        return s.kv_usage
    ending = sum(blocks for left, blocks in s.running_left if left * tpot <= config.kv_look_ahead_s)
    return max(0.0, s.kv_usage - ending / s.total_blocks)


def held_need(s: DecodeSignals, config: PolicyConfig) -> float:
    """The larger of: replicas x KV usage ahead / target, and ``tpot_need``; the first scaled by
    waiting / running sequences (a pool with sequences waiting and none running: at least one
    replica more)."""
    if s.running_seqs == 0 and s.waiting_seqs == 0:
        return 0.0
    kv = s.replicas * kv_usage_ahead(s, config) / config.kv_usage_target
    if not s.running_seqs:  # nothing runs yet: at least one replica more
        tpot = 0.0 if s.tpot_s is None else s.replicas * s.tpot_s / config.tpot_target_s
        return max(kv, tpot, s.replicas * (1.0 + config.up_tolerance + 1e-9))
    return max(kv * (s.running_seqs + s.waiting_seqs) / s.running_seqs, tpot_need(s, config))


def tpot_need(s: DecodeSignals, config: PolicyConfig) -> float:
    """The replicas at which decode's TPOT, with its running and waiting sequences spread over
    them, meets the target, as a fraction. A step lasts ``fixed + per_row x rows`` (the pool's
    fitted ``step_fixed_s``, ``step_per_row_s``); the measured TPOT, at running / replicas rows
    each, scales by that line's ratio at the rows c replicas would run: solved for c, TPOT(c) =
    target. Without a fit (or a fixed part of 0) this is replicas x TPOT / target x (running +
    waiting) / running: TPOT in proportion to the rows, a CPU's matmuls. A step's fixed part
    (weights read once per step on an accelerator, Python overhead) does not shrink with fewer
    rows: where it dominates the step, the proportional rule reads a need above one replica for
    a few sequences that one replica would run well within the target, and keeps replicas the
    other pool needs. When the fixed part alone reaches the target no count meets it: the
    proportional rule's need then (more than the replicas there are)."""
    if s.tpot_s is None or s.running_seqs <= 0:
        return 0.0
    rows = s.running_seqs + s.waiting_seqs
    proportional = s.replicas * s.tpot_s / config.tpot_target_s * rows / s.running_seqs
    fixed, per_row = s.step_fixed_s, s.step_per_row_s
    if fixed is None or per_row is None or fixed <= 0 or per_row <= 0 or s.replicas <= 0:
        return proportional
    # the fitted step at today's rows, scaled to the measured TPOT: the TPOT target in the line's units
    reach = config.tpot_target_s / s.tpot_s * (fixed + per_row * s.running_seqs / s.replicas)
    if reach <= fixed:
        return proportional
    return per_row * rows / (reach - fixed)


def inflow_need(s: DecodeSignals, config: PolicyConfig) -> float:
    """Replicas whose KV holds what prefill hands over, by Little's law: sequences resident =
    arrivals/s x residency, residency = expected decode tokens x decode's recent TPOT + the
    measured overhead of a stay, each holding its prompt and, on average over its stay, half its
    output; at ``kv_usage_target`` of a replica's blocks. It leads the held KV: a 2048-token
    prompt handed over is 128 blocks a replica will hold, before it holds them. The TPOT is the
    measured one, not the target: a loose target would size decode for sequences that stay far
    longer than they do. The overhead matters for short outputs: by tokens x TPOT alone a decode
    replica serving short outputs reads an inflow need under one while it is full, with prompts
    waiting. Until decode has run anything there is no inflow need."""
    if (
        s.inflow_seqs_per_s <= 0
        or s.expected_output_tokens <= 0
        or s.blocks_per_replica <= 0
        or s.residency_tpot_s is None
    ):
        return 0.0
    # Per sequence: stay x KV tokens held = (o x TPOT + overhead) x (p + o / 2 + a block), for
    # prompt p and output o. Its mean needs E[p o] and E[o²], not E[p] E[o]: in a mix of long
    # prompts with short outputs and short prompts with long outputs the means' product puts
    # decode's need at several times the replicas that serve it.
    p, o, bs = s.inflow_prompt_tokens, s.expected_output_tokens, s.block_size
    p_o = p * o if s.inflow_prompt_x_output is None else s.inflow_prompt_x_output
    o_sq = o * o if s.inflow_output_sq is None else s.inflow_output_sq
    token_seconds = s.residency_tpot_s * (p_o + o_sq / 2 + bs * o) + s.residency_overhead_s * (p + o / 2 + bs)
    blocks = s.inflow_seqs_per_s * token_seconds / bs
    return blocks / (s.blocks_per_replica * config.kv_usage_target)


def follow(current: int, need: float, bounds: PoolBounds, config: PolicyConfig) -> int:
    """The count a pool wants alone: up past the tolerance, down only with a margin."""
    wanted = current
    up = math.ceil(need - config.up_tolerance)
    if up > current:
        wanted = up
    else:
        down = math.ceil(need / config.down_utilization)
        if down < current:
            wanted = down
    return min(max(wanted, bounds.min_replicas), bounds.max_replicas)


def _to_least_covered(
    counts: tuple[int, int], needs: tuple[float, float], budget: int, may_take: Callable[[int, int], bool]
) -> tuple[int, int]:
    """``counts`` grown one replica at a time, up to ``budget``, each to the pool whose need is
    least covered (need / count; prefill on a tie) among those ``may_take(pool, its count)``."""
    grown = list(counts)
    while sum(grown) < budget:
        takers = [i for i in (0, 1) if may_take(i, grown[i])]
        if not takers:
            break
        i = max(takers, key=lambda k: (needs[k] / grown[k], -k))
        grown[i] += 1
    return grown[0], grown[1]


def fit_budget(
    wanted: tuple[int, int],
    needs: tuple[float, float],
    config: PolicyConfig,
    current: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Both wanted counts when they fit. Else each pool keeps what its own dead band keeps
    (``min(current, wanted)``) unless the other pool is short by ``take_ratio`` (need at least
    that many times its count): from there (from the minimums for a pool that keeps nothing, or
    when ``current`` is None), each next replica to the pool whose need is least covered (need /
    count), never past what the pool wants. Without the keep, a pool whose need reads just under
    its count gives a replica to a pool barely over its own: the needs are estimates, and the
    replicas left to the giving pool can be full soon after."""
    if sum(wanted) <= config.max_total_replicas:
        return wanted
    minimums = (config.prefill.min_replicas, config.decode.min_replicas)
    start = list(minimums)
    if current is not None:
        for i in (0, 1):
            other = 1 - i
            if needs[other] < config.take_ratio * max(1, current[other]):
                start[i] = max(minimums[i], min(current[i], wanted[i]))
    if sum(start) > config.max_total_replicas:
        start = list(minimums)
    return _to_least_covered((start[0], start[1]), needs, config.max_total_replicas, lambda i, n: n < wanted[i])


def fill_budget(wanted: tuple[int, int], needs: tuple[float, float], config: PolicyConfig) -> tuple[int, int]:
    """``wanted`` plus the budget it leaves, one replica at a time to the pool whose need is
    least covered (need / count), while that pool would keep the replica: ``follow`` from the
    larger count would not shrink it back (need above ``down_utilization`` of the larger count)."""
    bounds = (config.prefill, config.decode)

    def keeps(i: int, n: int) -> bool:
        return n < bounds[i].max_replicas and needs[i] > 0 and follow(n + 1, needs[i], bounds[i], config) > n

    return _to_least_covered(wanted, needs, config.max_total_replicas, keeps)


def move_limit(
    current: tuple[int, int], wanted: tuple[int, int], needs: tuple[float, float], config: PolicyConfig
) -> int:
    """``move_step``, doubled when a pool that grows needs at least the count a double step gives
    it. With one replica per change, a prefill pool whose need read many times its count grew
    one change at a time (each a replica starting, the cooldown, the upscale delay) while
    prompts queued. Asking for ``take_ratio`` times that count instead, a need well past the
    count still moved one replica, and the pool reached its size late in the load's phase."""
    step = config.move_step
    for i in (0, 1):
        if wanted[i] > current[i] and needs[i] >= current[i] + 2 * step:
            return 2 * step
    return step


def limit_move(current: tuple[int, int], wanted: tuple[int, int], step: int) -> tuple[int, int]:
    """``wanted`` with each pool's change cut to ``step`` replicas. The total never exceeds the
    larger of ``current``'s and ``wanted``'s (so a change within the budget stays within it): with
    one pool growing by G and the other shrinking by S, min(G, step) - min(S, step) is at most
    max(G - S, 0)."""
    p, d = (min(max(w, c - step), c + step) for c, w in zip(current, wanted))
    return p, d


def decide(
    prefill: PrefillSignals, decode: DecodeSignals, config: PolicyConfig, state: PolicyState, now: float
) -> Decision:
    """One decision for both pools (pure: the caller keeps ``Decision.state`` for the next)."""
    current = (prefill.replicas, decode.replicas)
    blind = [name for name, s in (("prefill", prefill), ("decode", decode)) if s.replicas and not s.ready_replicas]
    if blind:
        # nothing read from a pool says nothing about its need: no round for the look-back, no
        # delay accrued (while replicas start, counting those rounds as zero needs dates a shrink
        # proposal from the first of them, and the first round that reads the pools applies it)
        why = f"no replica of the {' and '.join(blind)} pool answered"
        state = replace(state, pending=None, pending_since=None)
        return Decision(current[0], current[1], False, 0.0, 0.0, state, why)
    now_needs = (prefill_need(prefill, config, decode_saturated=decode.waiting_seqs > 0), decode_need(decode, config))
    history = tuple(r for r in state.needs if now - r[0] < config.look_back_s) + ((now, *now_needs),)
    state = replace(state, needs=history)
    needs = look_back(history)
    rise = held_rise(history, now, config.upscale_delay_s)
    if rise is not None:  # a rise every round of the last upscale delay read: the median lags it
        needs = (max(needs[0], rise[0]), max(needs[1], rise[1]))
    wanted = fit_budget(
        (
            follow(prefill.replicas, needs[0], config.prefill, config),
            follow(decode.replicas, needs[1], config.decode, config),
        ),
        needs,
        config,
        current,
    )
    if config.fill_budget:
        wanted = fill_budget(wanted, needs, config)
    if config.move_step and sum(current) >= config.max_total_replicas:
        wanted = limit_move(current, wanted, move_limit(current, wanted, needs, config))

    def keep(held: str | None, next_state: PolicyState) -> Decision:
        return Decision(current[0], current[1], False, needs[0], needs[1], next_state, held)

    if wanted == current:
        return keep(None, replace(state, pending=None, pending_since=None))
    bounds = (config.prefill, config.decode)
    # a pool grows by its own need, or only by the fill (budget the other pool gives up): that
    # change is the other pool's shrink, and waits the downscale delay (see ``needs_growth``)
    grows = any(wanted[i] > current[i] and needs_growth(current[i], needs[i], bounds[i], config) for i in (0, 1))
    if not grows and sum(current) >= config.max_total_replicas and any(wanted[i] > current[i] for i in (0, 1)):
        # with the budget full, the fill alone moves no replica (see ``needs_growth``)
        return keep(None, replace(state, pending=None, pending_since=None))
    pending_since = state.pending_since
    if (
        state.pending is None
        or pending_since is None
        or _direction(state.pending, current) != _direction(wanted, current)
    ):
        pending_since = now
    landing = not (_settled(prefill) and _settled(decode))
    if landing and state.last_change is not None and now - state.last_change < config.landing_timeout_s:
        # the delay starts once the pools are as last set: a proposal from pools in flux is not
        # one that has held
        return keep(
            "the last change is still landing (replicas starting or stopping)",
            replace(state, pending=None, pending_since=None),
        )
    if rise is not None and any(
        wanted[i] > current[i] and follow(current[i], rise[i], bounds[i], config) >= wanted[i] for i in (0, 1)
    ):
        # its own need called for this growth in every round of the last upscale delay: it has
        # held that long already
        pending_since = min(pending_since, now - config.upscale_delay_s)
    state = replace(state, pending=wanted, pending_since=pending_since)
    if state.last_change is not None and now - state.last_change < config.cooldown_s:
        return keep(f"cooldown ({config.cooldown_s:g} s after the last change)", state)
    delay = config.upscale_delay_s if grows else config.downscale_delay_s
    if now - pending_since < delay:
        return keep(f"{'upscale' if grows else 'downscale'} delay ({delay:g} s)", state)
    return Decision(wanted[0], wanted[1], True, needs[0], needs[1], PolicyState(last_change=now, needs=history))


def needs_growth(count: int, need: float, bounds: PoolBounds, config: PolicyConfig) -> bool:
    """The pool's own need calls for more than ``count`` replicas (past the dead band). With the
    budget full, a change whose only growth is the fill (a pool taking a replica the other gives
    up, which it would keep but does not need) is not made: the replica is held anyway, and a move
    costs a replica's stop and start, and another when the load shifts back. Made, such a change
    moved a prefill replica to a decode pool whose need was within its count, served that load
    no better than the split it had, and left the prompts that came back short of a prefill
    replica. With budget free, such a change waits the downscale delay, like any shrink."""
    return follow(count, need, bounds, config) > count


def held_rise(history: tuple[tuple[float, float, float], ...], now: float, span_s: float) -> tuple[float, float] | None:
    """Each pool's need that every round of the last ``span_s`` reached: the least need of the
    rounds from the latest one at least ``span_s`` old through now; None while the rounds cover
    less than ``span_s``. The look-back's median follows a rise only once it fills half the window,
    and the upscale delay then starts, so by the median alone a pool's growth comes well into a
    shift of load, with prompts queued meanwhile."""
    old = [r[0] for r in history if now - r[0] >= span_s]
    if span_s <= 0 or not old:
        return None
    window = [r for r in history if r[0] >= max(old)]
    return min(r[1] for r in window), min(r[2] for r in window)


def look_back(history: tuple[tuple[float, float, float], ...]) -> tuple[float, float]:
    """Each pool's need over the recent rounds: their median. One round's need is a snapshot of
    a few sequences: under long prompts, a few of which fill a decode replica's KV, decode's need
    jumps up and down between consecutive rounds (a burst of hand-overs waiting for blocks), and
    prefill's with its arrivals counted over a few seconds; by the latest round each flip
    restarted the upscale delay and the pools never moved. The median drops a lone spike and
    follows a load that lasts half the window."""
    return statistics.median(r[1] for r in history), statistics.median(r[2] for r in history)


def _settled(s: PrefillSignals | DecodeSignals) -> bool:
    """The pool's replicas are as last set: Serve's count of them when read (``settled``), else
    those that answered. By the answers alone, a replica too busy to answer a stats call within
    its deadline read as a change still landing, and restarted a proposal's delay: under
    prompt-heavy load, where answers are slow, moves came late."""
    return s.settled if s.settled is not None else s.ready_replicas == s.replicas


def _direction(proposal: tuple[int, int], current: tuple[int, int]) -> tuple[int, int]:
    (p0, p1), (c0, c1) = proposal, current
    return (p0 > c0) - (p0 < c0), (p1 > c1) - (p1 < c1)


def describe(decision: Decision, prefill: PrefillSignals, decode: DecodeSignals, config: PolicyConfig) -> str:
    """The operator's line for a change: new counts and the signals that caused them."""
    rate = prefill.tokens_per_s_per_replica
    tpot = "-" if decode.tpot_s is None else f"{decode.tpot_s * 1000:.0f} ms"
    step = ""
    if decode.step_fixed_s is not None and decode.step_per_row_s is not None:
        step = (
            f"; a step {decode.step_fixed_s * 1000:.1f} + {decode.step_per_row_s * 1000:.2f} ms a row, "
            f"need {tpot_need(decode, config):.2f}"
        )
    inflow = ""
    if decode.inflow_seqs_per_s > 0:
        inflow = (
            f"inflow {decode.inflow_seqs_per_s:.2f} seq/s x {decode.expected_output_tokens:.0f} tokens "
            f"+ {decode.residency_overhead_s:.1f} s a stay (need {inflow_need(decode, config):.2f}), "
        )
    arrivals = ""
    if prefill.arrivals_per_s > 0:
        arrivals = f"{prefill.arrivals_per_s:.2f} req/s of {prefill.mean_prompt_tokens:.0f} tokens arriving, "
    return (
        f"prefill {prefill.replicas} -> {decision.prefill}, decode {decode.replicas} -> {decision.decode} "
        f"(budget {config.max_total_replicas}) | prefill: {arrivals}"
        f"{prefill.queued_prompt_tokens} queued prompt tokens, "
        f"{prefill.prompt_tokens_per_s:.0f} tok/s, "
        f"{'prior ' if rate is None else ''}{rate or config.prefill_tokens_per_s:.0f} tok/s per replica, "
        f"need {decision.prefill_need:.2f} | decode: {decode.running_seqs} running, {decode.waiting_seqs} waiting, "
        f"KV {decode.kv_usage:.0%} ({kv_usage_ahead(decode, config):.0%} in {config.kv_look_ahead_s:g} s), "
        f"TPOT {tpot} (target {config.tpot_target_s * 1000:.0f} ms{step}), "
        f"{inflow}need {decision.decode_need:.2f}"
    )
