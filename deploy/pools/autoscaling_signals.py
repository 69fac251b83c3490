"""The pd policy's signals, read from the pool replicas' own ``stats`` answers (what ``pdserve
status`` shows) two samples at a time: rates are the counters' deltas over the interval.

- prefill: queued prompt tokens = (waiting + running sequences) x the recent mean prompt
  length (a prefill replica's running sequences are the ones still prefilling; held KV is
  not counted); held KV share = held prompts x the mean prompt length / the pool's KV tokens;
  tokens/s per replica = the prompt tokens the replica's steps computed (the engine's
  ``prefill_tokens_computed``) per second of its model time in them (the engine's ``busy_s``;
  an interval with at least ``MIN_BUSY_S`` of it), smoothed, so
  an idle pool keeps its last measure. Per second of a busy interval instead, a read that
  catches one or two whole prompts swings well above and below the replica's real rate.
- decode: running and waiting sequences and KV usage as reported; TPOT = the engine's decode
  steps' seconds per token they produced (``decode_token_s`` / ``decode_tokens``), per replica,
  weighted by the mean rows decoding (a replica without those counters: mean running sequences
  at the two reads / generated tokens per second).
- prefill's arrivals: requests (their prompt tokens, and the squares of those for the lengths'
  spread) per second as they start on prefill, not as they finish, so that a saturated pool
  still reads what it is asked for; smoothed alike.
- decode's inflow: requests prefill handed over per second and their ``max_tokens`` per
  second (their ratio is the mean ``max_tokens``), summed over a window as long as a stay
  (``inflow_window``: the hand-overs of the last stay are the ones resident, by Little's law;
  smoothed like prefill's arrivals until decode's TPOT is known and while the inflow shifts,
  ``inflow_shifted``) x the share of
  ``max_tokens`` that sequences finished on decode produced over the last ``USED_WINDOW``
  reads (1 until any finish); the hand-overs' mean prompt and, per request, the means of
  prompt x ``max_tokens`` and ``max_tokens``² (x that share, and its square: what the inflow
  need weighs each prompt by); a decode replica's blocks; decode's TPOT over intervals that
  produced tokens, smoothed and kept while none do (how long a handed-over sequence stays, per
  token; longer where finished sequences' seconds after their first decoded token per token
  were: the waits between steps), and the overhead of a stay: the seconds finished sequences
  held decode's KV before their first decoded token (their pull, a wait for a step) over the
  last ``USED_WINDOW`` reads, per sequence (from replicas that do not count those: the seconds
  they held it less their tokens x that TPOT).
- decode's step line: a step's seconds = fixed + per row x rows, least squares over the steps
  of recent reads (the engine's ``decode_steps``, ``decode_step_s``, ``decode_rows_sq`` with
  its rows and row-seconds; each read's sums fading), for the TPOT a different count would see.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from deploy.pools.autoscaling import DecodeSignals, PrefillSignals

SMOOTHING = 0.5  # weight of the newest busy interval in tokens/s per replica
MIN_BUSY_S = 0.5  # model seconds an interval needs before its tokens / busy seconds count
INFLOW_SMOOTHING = 0.3  # weight of the newest interval in decode's residency TPOT
# Weight of the newest interval in the SMOOTHED rates. The policy takes each need's median over
# its look-back (10 s), which already drops a lone spike; with a lower weight the two smoothings
# together held a rise in arrivals under the rate that needs another prefill replica for a
# large part of a load's phase.
RATE_SMOOTHING = 0.6
# Weight of each earlier read in the decode step fit's sums (older reads fade by this factor a
# read: reads 2 s apart weigh half after about 4 s), and the least the fit needs: steps, and a
# variance of their rows (a pool whose steps all ran the same rows says nothing of the slope)
FIT_DECAY = 0.7
FIT_MIN_STEPS = 20
FIT_MIN_ROWS_VAR = 0.2
FIT_SUMS = ("decode_steps", "decode_tokens", "decode_step_s", "decode_token_s", "decode_rows_sq")
USED_WINDOW = 30  # reads over which finished sequences' produced / max_tokens is summed
# Decode's inflow is summed over the reads of the last stay (the expected decode tokens x TPOT +
# the overhead), within these bounds. Smoothed like prefill's arrivals (a few seconds of memory),
# the inflow of long outputs, whose stay is far longer, follows each Poisson burst: it read an
# inflow need above the replicas that served the load, and prefill gave up a replica the next
# prompts needed.
INFLOW_WINDOW_MIN_S = 6.0
INFLOW_WINDOW_MAX_S = 60.0
SHIFT_SIGMAS = 2.0  # a change of the inflow between the window's halves beyond this is a shift
# prefill's counters read as smoothed rates: arrivals (as requests start) and hand-overs to decode
SMOOTHED = (
    "received",
    "received_prompt_tokens",
    "received_prompt_tokens_sq",
    "handed_over",
    "handed_over_max_tokens",
    "handed_over_prompt_tokens",
    "handed_over_prompt_x_max",
    "handed_over_max_sq",
)
HANDED = tuple(key for key in SMOOTHED if key.startswith("handed_over"))


def settled(replicas: list[dict[str, Any]], target: int) -> bool:
    """A pool's replicas as read (one entry per replica Serve has, answering or not) are as many
    as its target and none is starting (not in the worker directory yet): no change is landing.
    A replica too busy to answer its stats call in time is not one."""
    return len(replicas) == target and not any(r.get("starting") for r in replicas)


@dataclass
class SignalReader:
    """Keeps the previous sample of each replica; ``read`` turns a new one into signals."""

    block_size: int = 16
    tokens_per_s_per_replica: float | None = None
    _previous: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    _mean_prompt_tokens: float = 0.0
    # prefill's counters in SMOOTHED as per-second rates, each smoothed alike, so that their
    # ratios are means over the same recent requests
    _rates: dict[str, float] = field(default_factory=dict)
    _used: deque = field(default_factory=lambda: deque(maxlen=USED_WINDOW))  # (produced, max_tokens)
    # prefill's reads of HANDED, newest last: (time, seconds, {key: delta}), INFLOW_WINDOW_MAX_S back
    _handed: deque = field(default_factory=deque)
    # (sequences, their output tokens, seconds they held decode's KV, of those the seconds before
    # their first decoded token or None where a replica does not count them), finished per read
    _stays: deque = field(default_factory=lambda: deque(maxlen=USED_WINDOW))
    _blocks_per_replica: int = 0
    _tpot: float | None = None  # decode's TPOT, smoothed, kept while no sequence runs
    _fit: dict[str, float] = field(default_factory=dict)  # FIT_SUMS over decode's recent reads, fading

    def read(
        self,
        now: float,
        prefill: list[dict[str, Any]],
        decode: list[dict[str, Any]],
        prefill_target: int,
        decode_target: int,
    ) -> tuple[PrefillSignals, DecodeSignals]:
        live_p = [r for r in prefill if r.get("healthy")]
        live_d = [r for r in decode if r.get("healthy")]
        self._read_inflow(now, live_p, live_d)
        p = self._prefill(now, live_p, prefill_target)
        d = self._decode(now, live_d, decode_target)
        self._previous = {r["worker_id"]: (now, r) for r in live_p + live_d}
        return replace(p, settled=settled(prefill, prefill_target)), replace(d, settled=settled(decode, decode_target))

    def _delta(self, now: float, r: dict[str, Any], key: str) -> tuple[float, float] | None:
        """(counter delta, seconds) since this replica's previous sample; None for a new replica.
        A counter a replica does not report counts as 0."""
        prev = self._previous.get(r["worker_id"])
        if prev is None or now <= prev[0]:
            return None
        return r.get(key, 0) - prev[1].get(key, 0), now - prev[0]

    def _sum_deltas(self, now: float, replicas: list[dict[str, Any]], key: str) -> tuple[float, float]:
        """(sum of the replicas' deltas, the longest interval) over those sampled before."""
        total = seconds = 0.0
        for r in replicas:
            d = self._delta(now, r, key)
            if d is not None:
                total += d[0]
                seconds = max(seconds, d[1])
        return total, seconds

    def _read_inflow(self, now: float, prefill: list[dict[str, Any]], decode: list[dict[str, Any]]) -> None:
        seconds = self._sum_deltas(now, prefill, "handed_over")[1]
        if seconds:
            a = RATE_SMOOTHING
            deltas = {key: self._sum_deltas(now, prefill, key)[0] for key in SMOOTHED}
            for key, delta in deltas.items():
                self._rates[key] = a * delta / seconds + (1 - a) * self._rates.get(key, 0.0)
            self._handed.append((now, seconds, {key: deltas[key] for key in HANDED}))
            while now - self._handed[0][0] > INFLOW_WINDOW_MAX_S:
                self._handed.popleft()
        produced = self._sum_deltas(now, decode, "finished_output_tokens")[0]
        asked = self._sum_deltas(now, decode, "finished_max_tokens")[0]
        if asked > 0:
            self._used.append((produced, asked))
        finished = self._sum_deltas(now, decode, "finished_seqs")[0]
        if finished > 0:
            held_s = self._sum_deltas(now, decode, "finished_resident_s")[0]
            setup_s = (
                self._sum_deltas(now, decode, "finished_setup_s")[0]
                if all("finished_setup_s" in r for r in decode)
                else None
            )
            self._stays.append((finished, produced, held_s, setup_s))
        if decode:
            self._blocks_per_replica = round(sum(r["total_blocks"] for r in decode) / len(decode))

    def rate(self, key: str) -> float:
        """A prefill counter's smoothed per-second rate (0 before any interval)."""
        return self._rates.get(key, 0.0)

    def per(self, key: str, per: str) -> float:
        """Mean of ``key`` per ``per`` over recent requests: the two smoothed rates' ratio, so
        that times the rate of ``per`` it is the smoothed rate of ``key``, not one interval's
        mean times a rate that lags a shift (0 when nothing came)."""
        base = self.rate(per)
        return self.rate(key) / base if base > 0 else 0.0

    def inflow_window(self) -> float | None:
        """Seconds over which decode's inflow is summed: a stay of what prefill hands over now
        (its mean ``max_tokens`` x the share used x decode's TPOT + the overhead of a stay), within
        ``INFLOW_WINDOW_MIN_S``..``INFLOW_WINDOW_MAX_S``; None (the smoothed rates) until decode's
        TPOT is known, and while the inflow shifts (``inflow_shifted``)."""
        if self._tpot is None:
            return None
        stay = self.mean_max_tokens() * self.used_share() * (self.residency_tpot() or 0.0) + self.residency_overhead()
        window = min(max(stay, INFLOW_WINDOW_MIN_S), INFLOW_WINDOW_MAX_S)
        return None if self.inflow_shifted(window) else window

    def inflow_shifted(self, window: float) -> bool:
        """The window's newer half handed over sequences, or ``max_tokens``, at a rate more than
        ``SHIFT_SIGMAS`` standard deviations from its older half's (Poisson counts; ``max_tokens``
        a compound Poisson sum, whose variance is its sum of squares): the load changed, and the
        window's sum lags it by up to a stay. Summed over a stay regardless, a load that starts
        from idle reads a fraction of what arrives, and both pools shrink only to grow back soon
        after; and a phase after long outputs would read their ``max_tokens`` for a stay."""
        new = [0.0] * 4  # seconds, hand-overs, max_tokens, max_tokens²
        old = [0.0] * 4
        covered = 0.0
        for interval, d in self._handed_within(window):
            half = new if covered < window / 2 else old
            for i, x in enumerate((interval, d["handed_over"], d["handed_over_max_tokens"], d["handed_over_max_sq"])):
                half[i] += x
            covered += interval
        if new[0] <= 0 or old[0] <= 0:
            return False

        def beyond(i: int, var_i: int) -> bool:  # column i's rates apart, the variance from column var_i
            diff = new[i] / new[0] - old[i] / old[0]
            var = new[var_i] / new[0] ** 2 + old[var_i] / old[0] ** 2
            return var > 0 and diff * diff > SHIFT_SIGMAS**2 * var

        return beyond(1, 1) or beyond(2, 3)

    def _handed_within(self, window: float) -> list[tuple[float, dict[str, float]]]:
        """Prefill's reads of HANDED, newest first, until their intervals cover ``window`` (at
        least the newest): (seconds, {key: delta}) each."""
        reads: list[tuple[float, dict[str, float]]] = []
        covered = 0.0
        for _, interval, deltas in reversed(self._handed):
            reads.append((interval, deltas))
            covered += interval
            if covered >= window:
                break
        return reads

    def inflow_rate(self, key: str, window: float | None) -> float:
        """A HANDED counter's per-second rate over prefill's reads of the last ``window`` seconds
        (``_handed_within``), the smoothed rate when ``window`` is None."""
        if window is None or not self._handed:
            return self.rate(key)
        reads = self._handed_within(window)
        return sum(deltas[key] for _, deltas in reads) / sum(interval for interval, _ in reads)

    def mean_max_tokens(self) -> float:
        """Mean ``max_tokens`` of recent hand-overs."""
        return self.per("handed_over_max_tokens", "handed_over")

    def prompt_tokens_cv2(self) -> float:
        """Squared coefficient of variation of recent prompt lengths (E[L²] / E[L]² - 1; 1, an
        exponential spread, until any arrived)."""
        mean = self.per("received_prompt_tokens", "received")
        if mean <= 0:
            return 1.0
        return max(0.0, self.per("received_prompt_tokens_sq", "received") / (mean * mean) - 1.0)

    def _measured_setup(self) -> bool:
        """Every stay in the window came with its setup seconds (decode replicas that count them)."""
        return bool(self._stays) and all(s is not None for *_, s in self._stays)

    def residency_overhead(self) -> float:
        """Seconds a finished sequence held decode's KV before its first decoded token (its pull,
        a wait for a step), mean over the window; from replicas that do not count it, what it held
        beyond its tokens x the residency TPOT. 0 until a sequence finished and the TPOT is known.
        The remainder alone folds each token's wait between steps into a per-sequence overhead:
        long outputs finishing as a prompt-heavy load returns make every stay's overhead read
        long, applied then to each short output, and decode's need reads several times what the
        same prompts needed before."""
        seqs = sum(n for n, *_ in self._stays)
        if not seqs or self._tpot is None:
            return 0.0
        if self._measured_setup():
            return sum(s for *_, s in self._stays) / seqs
        tokens = sum(t for _, t, _, _ in self._stays)
        held_s = sum(h for _, _, h, _ in self._stays)
        return max(0.0, (held_s - tokens * self._tpot) / seqs)

    def residency_tpot(self) -> float | None:
        """Seconds a handed-over sequence holds decode's KV per token it produces: the engine's
        TPOT (smoothed), or, once finished sequences counted their setup, their seconds after it
        per token over the window where that is longer (the waits between steps)."""
        if self._tpot is None or not self._measured_setup():
            return self._tpot
        tokens = sum(t for _, t, _, _ in self._stays)
        decoding_s = sum(h - s for _, _, h, s in self._stays)
        return max(self._tpot, decoding_s / tokens) if tokens > 0 else self._tpot

    def used_share(self) -> float:
        """Produced / max_tokens of the sequences finished over the window (1 until any finish)."""
        asked = sum(a for _, a in self._used)
        return min(1.0, sum(p for p, _ in self._used) / asked) if asked else 1.0

    def _prefill(self, now: float, replicas: list[dict[str, Any]], target: int) -> PrefillSignals:
        requests = prompt = computed = 0.0
        seconds = 0.0
        for r in replicas:
            d_req, d_prompt = self._delta(now, r, "requests"), self._delta(now, r, "prompt_tokens")
            d_cached = self._delta(now, r, "cached_prompt_tokens")
            if d_req is None or d_prompt is None or d_cached is None:
                continue
            requests += d_req[0]
            prompt += d_prompt[0]
            computed += d_prompt[0] - d_cached[0]
            seconds = max(seconds, d_req[1])
            prev = self._previous[r["worker_id"]][1]
            busy = (prev["num_waiting"] + prev["num_running"]) and (r["num_waiting"] + r["num_running"])
            d_busy = self._delta(now, r, "busy_s")
            # the tokens the model computed in that busy time, step by step (a replica that does
            # not report them: the prompts finished in the interval, whose steps may have run in
            # the interval before; with those, the smoothed rate can read well above what the
            # device can compute)
            d_computed = self._delta(now, r, "prefill_tokens_computed") if "prefill_tokens_computed" in r else None
            computed_in_busy = d_computed[0] if d_computed is not None else d_prompt[0] - d_cached[0]
            rate = None
            if d_busy is not None and d_busy[0] >= MIN_BUSY_S and computed_in_busy > 0:
                # over the model's own busy time, whatever share of the interval it was
                rate = computed_in_busy / d_busy[0]
            elif "busy_s" not in r and busy and d_prompt[0] - d_cached[0] > 0:
                rate = (d_prompt[0] - d_cached[0]) / d_prompt[1]  # a replica that reports no busy time
            if rate is not None:
                old = self.tokens_per_s_per_replica
                self.tokens_per_s_per_replica = rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old
        if requests:
            self._mean_prompt_tokens = prompt / requests
        elif not self._mean_prompt_tokens:
            total_req = sum(r["requests"] for r in replicas)
            self._mean_prompt_tokens = sum(r["prompt_tokens"] for r in replicas) / total_req if total_req else 0.0
        in_flight = sum(r["num_waiting"] + r["num_running"] for r in replicas)
        capacity = sum(r["total_blocks"] for r in replicas) * self.block_size
        held = sum(r.get("num_held", 0) for r in replicas) * self._mean_prompt_tokens
        return PrefillSignals(
            replicas=target,
            ready_replicas=len(replicas),
            queued_prompt_tokens=round(in_flight * self._mean_prompt_tokens),
            prompt_tokens_per_s=computed / seconds if seconds else 0.0,
            tokens_per_s_per_replica=self.tokens_per_s_per_replica,
            held_kv_fraction=min(1.0, held / capacity) if capacity else 0.0,
            arrivals_per_s=self.rate("received"),
            mean_prompt_tokens=self.per("received_prompt_tokens", "received"),
            prompt_tokens_cv2=self.prompt_tokens_cv2(),
        )

    def _decode(self, now: float, replicas: list[dict[str, Any]], target: int) -> DecodeSignals:
        weighted_tpot = weight = 0.0
        flowing = flowing_weight = 0.0  # replicas that produced tokens: the residency's TPOT
        for r in replicas:
            d_gen = self._delta(now, r, "generated_tokens")
            if d_gen is None:
                continue
            prev = self._previous[r["worker_id"]][1]
            running = (prev["num_running"] + r["num_running"]) / 2
            d_rows = self._delta(now, r, "decode_tokens") if "decode_token_s" in r else None
            d_row_s = self._delta(now, r, "decode_token_s") if d_rows is not None else None
            tokens_per_s = d_gen[0] / d_gen[1]
            if d_rows is not None and d_row_s is not None and d_rows[0] > 0:
                # the engine's own: its decode steps' seconds per token they produced, weighted by
                # the mean rows decoding over the interval (sequences that ran between two reads,
                # not at them: short outputs live under a second, and the running counts at the
                # reads gave TPOTs of about twice the step's time)
                tpot, running = d_row_s[0] / d_rows[0], d_row_s[0] / d_gen[1]
            elif running <= 0:
                continue
            else:
                tpot = running / tokens_per_s if tokens_per_s > 0 else d_gen[1]  # stalled: a whole interval
            weighted_tpot += tpot * running
            weight += running
            if tokens_per_s > 0:
                flowing += tpot * running
                flowing_weight += running
        usage = [r["kv_usage"] for r in replicas]
        tpot_now = weighted_tpot / weight if weight else None
        if flowing_weight:  # a stalled or draining interval says nothing about how long sequences stay
            a, tpot = INFLOW_SMOOTHING, flowing / flowing_weight
            self._tpot = tpot if self._tpot is None else a * tpot + (1 - a) * self._tpot
        fixed, per_row = self._step_fit(now, replicas)
        share = self.used_share()
        window = self.inflow_window()
        seqs = self.inflow_rate("handed_over", window)

        def per_seq(key: str) -> float:  # a hand-over's mean over the window
            return self.inflow_rate(key, window) / seqs if seqs > 0 else 0.0

        prompt = per_seq("handed_over_prompt_tokens")  # 0: a prefill without these counters
        left = None  # every replica's running sequences (tokens left, blocks held); None: one did not say
        if replicas and all("running_left" in r for r in replicas):
            left = tuple((int(n), int(b)) for r in replicas for n, b in r["running_left"])
        return DecodeSignals(
            replicas=target,
            ready_replicas=len(replicas),
            running_seqs=sum(r["num_running"] for r in replicas),
            waiting_seqs=sum(r["num_waiting"] for r in replicas),
            kv_usage=sum(usage) / len(usage) if usage else 0.0,
            tpot_s=tpot_now,
            residency_tpot_s=self.residency_tpot(),
            residency_overhead_s=self.residency_overhead(),
            inflow_seqs_per_s=seqs,
            expected_output_tokens=per_seq("handed_over_max_tokens") * share,
            inflow_prompt_tokens=prompt or self._mean_prompt_tokens,
            inflow_prompt_x_output=per_seq("handed_over_prompt_x_max") * share if prompt else None,
            inflow_output_sq=per_seq("handed_over_max_sq") * share * share if prompt else None,
            blocks_per_replica=self._blocks_per_replica,
            block_size=self.block_size,
            running_left=left,
            total_blocks=sum(r.get("total_blocks", 0) for r in replicas),
            step_fixed_s=fixed,
            step_per_row_s=per_row,
        )

    def _step_fit(self, now: float, replicas: list[dict[str, Any]]) -> tuple[float | None, float | None]:
        """A decode step's (fixed seconds, seconds per row), least squares over the steps the
        pool ran in recent reads (each read's sums fading by ``FIT_DECAY``); (None, None) without
        enough steps or spread in their rows, or from replicas that do not count them. A slope
        that comes out negative (noise) is 0; an intercept below 0, a line through the origin."""
        if not all("decode_steps" in r for r in replicas):
            return None, None
        for key in FIT_SUMS:
            self._fit[key] = FIT_DECAY * self._fit.get(key, 0.0) + self._sum_deltas(now, replicas, key)[0]
        n, sx, sy = self._fit["decode_steps"], self._fit["decode_tokens"], self._fit["decode_step_s"]
        sxy, sxx = self._fit["decode_token_s"], self._fit["decode_rows_sq"]
        if n < FIT_MIN_STEPS:
            return None, None
        mean_x, mean_y = sx / n, sy / n
        var_x = sxx / n - mean_x * mean_x
        if var_x < FIT_MIN_ROWS_VAR:
            return None, None
        per_row = max(0.0, (sxy / n - mean_x * mean_y) / var_x)
        fixed = mean_y - per_row * mean_x
        if fixed < 0:
            return 0.0, sy / sx if sx else None
        return fixed, per_row
