"""What the agent learns from an engine's counters between samples: its prefill rate, the time
per output token its running requests see, its prefix-cache hit ratio, and how the prefill the
ledger books compares with what the engine really computes. Pure: fed counter totals."""

from __future__ import annotations

from collections import deque


class PrefillRate:
    """The prompt tokens per second a node clears at full load, from vllm:prompt_tokens_total.

    vLLM counts a prompt when its prefill completes, whole: a 7,000-token prompt adds nothing
    for the ~0.8 s an A100 takes over it, then 7,000 at once. A rate read over one sample
    (0.2 s) then saw 35,000 tokens/s on a node that clears ~9,000. So a rate is read only
    between two completions: from the sample before one in which the counter grew to a later
    one in which it grew again, at least `WINDOW_S` apart. With prefills run one after the other
    (vLLM gives a running prefill's next chunk the step's budget first), every token counted in
    that span was computed inside it: the figure can be low (idle time in the span), not high.

    A span only shows what the node was *given*, so the estimate is the peak seen, decaying by
    `DECAY` per sample so that it follows a node that got slower. A node given work at the
    estimated rate only (the prefill budget admits about that much) reads that rate back in
    every span: below saturation the spans say how busy it was, not how fast it is —
    `PrefillSpeed` says that, and the agent publishes the better of the two.

    A node's first work is read from the last sample that saw it idle (nothing running or
    waiting): every token counted since was computed since, so that span too can read low, not
    high, and it needs no `WINDOW_S` — it is the only figure there is until a second completion
    follows the first by `WINDOW_S`. Before, single samples gave the first figure: 22,000 to
    60,000 tokens/s for the first ~3 s of the llm-d-like mix, on nodes that clear ~9,700
    (docs/benchmarks.md). They still do where no idle sample was seen (an agent started on a
    busy node); the first span replaces them. Samples closer than `MIN_DT_S` are noise.
    """

    DECAY = 0.998  # per sample (0.2 s): halves in ~70 s without a new peak
    MIN_DT_S = 0.15
    WINDOW_S = 2.0  # shortest span read: the sampling's slack is then under a tenth of it
    SPAN_S = 10.0  # longest: completions further apart say little about the node's speed

    def __init__(self) -> None:
        self.rate = 0.0
        self.span = 0.0  # the best span read, decaying as the estimate does
        self._last: tuple[float, float] | None = None  # (time, prompt tokens total)
        # (time of the sample before a completion, the total then): where spans may start
        self._marks: deque[tuple[float, float]] = deque()
        self._idle: tuple[float, float] | None = None  # (time, total) of the last idle sample

    def update(self, now: float, total: float | None, busy: bool = True) -> float:
        """`total`: prompt tokens the engine computed so far (counted at each prefill's end);
        `busy`: the engine has requests running or waiting (True where not known)."""
        if total is None:
            return self.rate
        if self._last is None or total < self._last[1]:  # first sample, or engine restarted
            self._last = (now, total)
            self._marks.clear()
            self._idle = None if busy else (now, total)
            return self.rate
        t0, c0 = self._last
        if now - t0 < self.MIN_DT_S:
            return self.rate
        self._last = (now, total)
        self.rate *= self.DECAY
        self.span *= self.DECAY
        had_span = self.span > 0
        if self._idle is not None and now - self._idle[0] > self.SPAN_S:
            self._idle = None
        if total > c0 and self._idle is not None:  # the work since the node was last seen idle
            ti, ci = self._idle
            self.span = max(self.span, (total - ci) / (now - ti))
        if not busy:
            self._idle = (now, total)
        if total == c0:
            return self.rate
        # A prefill completed in (t0, now]: read every span from an earlier completion's mark
        # (within SPAN_S, at least WINDOW_S long) — the tokens of completions after the mark's
        # over the time since the sample before it — and keep the best.
        while self._marks and now - self._marks[0][0] > self.SPAN_S:
            self._marks.popleft()
        for tm, cm in self._marks:
            if now - tm < self.WINDOW_S:
                break
            self.span = max(self.span, (total - cm) / (now - tm))
        self._marks.append((t0, total))
        sample = (total - c0) / (now - t0)
        if self.span <= 0:
            self.rate = max(self.rate, sample)
        else:  # the first span replaces what single samples said
            self.rate = max(self.rate, self.span) if had_span else self.span
        return self.rate


class PrefillSpeed:
    """Prompt tokens per second of prefill as the node's requests saw it: tokens computed over
    time in prefill (first scheduled to first token) of the requests that finished lately —
    vLLM's request_prefill_kv_computed_tokens and request_prefill_time_seconds, observed
    together when a request ends — as sums decaying with `HALF_S`. A lone prefill reads the
    node's speed at any load, so a lightly loaded node is not taken for a slow one (spans
    between completions read only what it was given); prefills that share steps each count the
    steps' whole time, so under load it reads low, where the spans read the node at full speed.
    0 until `MIN_S` of prefill time was seen; None inputs (an engine without these histograms)
    leave it there."""

    HALF_S = 10.0
    MIN_S = 0.05

    def __init__(self) -> None:
        self.speed = 0.0
        self._tokens = 0.0  # decayed sums since the first sample
        self._seconds = 0.0
        self._last: tuple[float, float, float] | None = None  # (time, tokens, seconds totals)

    def update(self, now: float, tokens: float | None, seconds: float | None) -> float:
        if tokens is None or seconds is None:
            return self.speed
        if self._last is not None:
            t0, k0, s0 = self._last
            if tokens < k0 or seconds < s0:  # the engine restarted: its histograms with it
                self._tokens = self._seconds = 0.0
            else:
                decay = 0.5 ** (max(0.0, now - t0) / self.HALF_S)
                self._tokens = self._tokens * decay + (tokens - k0)
                self._seconds = self._seconds * decay + (seconds - s0)
        self._last = (now, tokens, seconds)
        if self._seconds >= self.MIN_S:
            self.speed = self._tokens / self._seconds
        return self.speed


class Tpot:
    """Seconds per output token that the node's running requests see, two ways, from the same
    counters every sample (so they follow load within a second or two — unlike vLLM's
    per-request latency histograms, observed only when a request ends):

    - `tpot_s`, now: running requests ÷ output tokens per second over the last sample,
      smoothed (ALPHA). Spiky: on a prefill-heavy mix a 0.2 s sample that holds one step with a
      2,048-token chunk (~0.22 s on an A100) reads ~200 ms a token, the next one, all decode
      steps, ~16 ms. The spikes are the decode guards' margin for the urgent class: judged
      without them, the urgent class's own guard let support at 2.0× run decode late (goodput
      −19 %).
    - `decode_s`, what answers saw over the last second or so: request-seconds running ÷
      output tokens, as sums decaying with `HALF_S` — each step weighed by its length. On the
      llm-d-like mix `tpot_s` read 40–300 ms while answers saw under 60 ms a token, and the own
      guard held realtime off every node; so that guard holds a node only while this is above
      half its limit too (gates.slow_decode). An idle node (nothing running) reads 0 and
      starts over."""

    ALPHA = 0.5
    HALF_S = 1.0

    def __init__(self) -> None:
        self.tpot_s = 0.0
        self.decode_s = 0.0
        self._spent = 0.0  # decayed request-seconds running
        self._tokens = 0.0  # decayed output tokens
        self._last: tuple[float, float, int] | None = None  # (time, generated total, running)

    def update(self, now: float, generated: float | None, running: int) -> float:
        """Take a sample; return `tpot_s` (`decode_s` beside it)."""
        if generated is None:
            return self.tpot_s
        if self._last is not None:
            t0, g0, r0 = self._last
            dt = now - t0
            if dt < PrefillRate.MIN_DT_S:
                return self.tpot_s
            got = max(0.0, generated - g0)
            seen = running * dt / got if got > 0 and running > 0 else 0.0
            self.tpot_s = (
                seen if self.tpot_s == 0 else (self.ALPHA * seen + (1 - self.ALPHA) * self.tpot_s)
            )
            decay = 0.5 ** (dt / self.HALF_S)
            self._spent = self._spent * decay + (r0 + running) / 2 * dt
            self._tokens = self._tokens * decay + got
        self._last = (now, generated, running)
        if running <= 0:
            self._spent = self._tokens = 0.0
        self.decode_s = self._spent / self._tokens if self._tokens > 0 else 0.0
        return self.tpot_s


class PrefixHits:
    """The share of prompt tokens the engine found in its prefix cache lately (None: the
    engine does not report it, or has looked nothing up yet), smoothed over samples. High on a
    node whose prompts share prefixes: its KV in use is then well below what the ledger books
    (each request's whole prompt), which is why `booked` can hold a node at lower measured
    memory."""

    ALPHA = 0.2

    def __init__(self) -> None:
        self.ratio: float | None = None
        self._last: tuple[float, float] | None = None

    def update(self, queries: float | None, hits: float | None) -> float | None:
        if queries is None or hits is None:
            return self.ratio
        if self._last is not None:
            dq, dh = queries - self._last[0], hits - self._last[1]
            if dq > 0:
                seen = min(1.0, max(0.0, dh / dq))
                self.ratio = (
                    seen
                    if self.ratio is None
                    else (self.ALPHA * seen + (1 - self.ALPHA) * self.ratio)
                )
        self._last = (queries, hits)
        return self.ratio


class Booking:
    """Prefill the ledger booked per prompt token the engine computed, lately: the factor that
    turns the engine's computed-token rate into the rate at which the ledger's pending prefill
    clears. The ledger books a request's prompt less what the prefix index expects its node
    to hold; the engine computes its prompt less what it really found cached. Where the two
    differ — prompts shorter than a prefix block that the engine still finds cached (vLLM's
    blocks are 16 tokens; a chat template's head), or an index that expects more than the
    engine kept — pending prefill drained at the computed rate drifts from the node: on 145
    identical short prompts in flight the ledger held 292,603 tokens "pending" (85 s at its
    rate) on a node with nothing waiting. So the published rate is the computed one times
    booked ÷ computed over the last `HALF_S`-ish seconds.

    Faster than computed only while the engine has nothing waiting: during a burst the
    bookings run ahead of the engine because it has a backlog, not because the ledger
    miscounts (`waiting` > 0 caps the factor at 1). 1 until `MIN_TOKENS` were booked."""

    HALF_S = 20.0
    MIN_TOKENS = 2_000.0
    MAX = 16.0

    def __init__(self) -> None:
        self.factor = 1.0
        self._booked = 0.0  # decayed sums since the first sample
        self._computed = 0.0
        self._last: tuple[float, float, float] | None = None  # (time, booked, computed totals)

    def update(
        self, now: float, booked: float | None, computed: float | None, waiting: int
    ) -> float:
        if booked is None or computed is None:
            return self.factor
        if self._last is not None:
            t0, b0, c0 = self._last
            if computed < c0:  # the engine restarted: its counters with it
                self._booked = self._computed = 0.0
            else:
                decay = 0.5 ** (max(0.0, now - t0) / self.HALF_S)
                # A ledger gone (expired when idle past the lease TTL) counts again from 0.
                self._booked = self._booked * decay + (booked - b0 if booked >= b0 else booked)
                self._computed = self._computed * decay + (computed - c0)
        self._last = (now, booked, computed)
        if self._booked < self.MIN_TOKENS:
            self.factor = 1.0
        else:
            seen = self._booked / max(self._computed, self._booked / self.MAX)
            self.factor = max(1 / self.MAX, min(1.0, seen) if waiting > 0 else seen)
        return self.factor
