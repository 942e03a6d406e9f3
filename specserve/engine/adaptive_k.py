"""Per-step choice of K from measured acceptance and measured step cost (`adaptive_k`).

Speculation pays while the tokens a step emits grow faster than the step's cost, and both
sides depend on the load: at batch 1 a verify row is nearly free, at batch 8 every draft row
costs the target real work and every draft pass runs for 8 requests. So both are measured
while serving: the conditional acceptance of each draft position (a moving average over
verified requests) and the wall time of a decode step for each (requests in the step, K) pair.
Before each step the engine asks for the K in 0..cap with the most expected tokens per second
at the current batch size. Batch sizes share timings by power-of-two bucket (1, 2, 3-4, 5-8,
...); a (bucket, K) pair not yet timed twice is tried first (largest K first), so each bucket
costs a few exploratory steps the first time it is seen, and every `refresh_every`-th choice
in a bucket re-times its least recently timed K (timings drift with context length, and an
early sample can carry one-off costs). K = 0 is plain decoding.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Timing:
    samples: deque = field(default_factory=lambda: deque(maxlen=7))   # latest step times
    last: int = 0           # choice number (in its bucket) when last timed

    @property
    def seconds(self) -> float:
        # The lower median: robust to one-off stalls (a first oneDNN call at a new row count,
        # a request's final bookkeeping) that a mean would carry for many steps.
        return statistics.median_low(self.samples)


class AdaptiveK:
    PHASES = ("verify", "propose")

    def __init__(self, k_max: int, accept_smoothing: float = 0.02,
                 prior_acceptance: float = 0.8, refresh_every: int = 50,
                 min_gain: float = 0.05) -> None:
        self.k_max = k_max
        self.min_gain = min_gain
        self.accept_smoothing = accept_smoothing
        self.refresh_every = refresh_every
        self.choices: dict[int, int] = {}                       # bucket -> choices made
        self.chosen: Counter[int] = Counter()                   # K -> times chosen
        # accept[j]: P(draft j+1 accepted | drafts 1..j accepted); optimistic until observed,
        # so that a position never tested still gets tried
        self.accept = [prior_acceptance] * k_max
        self.accept_seen = [0] * k_max
        # (phase, batch-size bucket, K) -> step times; phases: the verify step, the
        # propose after it
        self.timings: dict[tuple[str, int, int], _Timing] = {}

    def expected_tokens(self, k: int) -> float:
        """Tokens one request emits per step with k drafts: 1 + sum_j prod_{i<=j} accept_i."""
        total = run = 1.0
        for a in self.accept[:k]:
            run *= a
            total += run
        return total

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << (max(batch_size, 1) - 1).bit_length()

    def choose(self, batch_size: int, cap: int) -> int:
        """K for the next step of `batch_size` requests, at most `cap`."""
        k = self._choose(batch_size, min(cap, self.k_max))
        self.chosen[k] += 1
        return k

    def _choose(self, batch_size: int, cap: int) -> int:
        if cap <= 0:
            return 0
        b = self.bucket(batch_size)
        n = self.choices[b] = self.choices.get(b, 0) + 1
        explore_order = [cap, 0, *range(cap - 1, 0, -1)]
        for k in explore_order:
            for phase in self.PHASES:
                t = self.timings.get((phase, b, k))
                if t is None or len(t.samples) < 2:
                    return k
        if n % self.refresh_every == 0:
            return min(explore_order, key=lambda k: self.timings[("verify", b, k)].last)
        rate = {k: self.expected_tokens(k) / self.step_seconds(b, k) for k in explore_order}
        best = max(range(1, cap + 1), key=rate.__getitem__)
        # Speculate only for a clear gain: timings are noisy, and in a batch whose requests
        # accept at different rates the slowest one sets the end, so a marginal per-step gain
        # can be a loss overall.
        return best if rate[best] > (1 + self.min_gain) * rate[0] else 0

    def step_seconds(self, bucket: int, k: int) -> float:
        return sum(self.timings[(p, bucket, k)].seconds for p in self.PHASES)

    def observe_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        """One verified request: positions 1..num_accepted+1 were tested (the one after the
        last accepted draft was rejected, if it exists)."""
        for j in range(min(num_drafts, num_accepted + 1, self.k_max)):
            hit = 1.0 if j < num_accepted else 0.0
            # A plain mean over the first observations, then a moving average: a position
            # tested only while K was large must not sit near the prior for long.
            self.accept_seen[j] += 1
            rate = max(self.accept_smoothing, 1.0 / self.accept_seen[j])
            self.accept[j] += rate * (hit - self.accept[j])

    def observe(self, phase: str, batch_size: int, k: int, seconds: float) -> None:
        """Wall time of one phase of a decode step (no prompt tokens in it) at K = k: "verify"
        (the target pass, rejection sampling, bookkeeping) or "propose" (drafting k tokens)."""
        b = self.bucket(batch_size)
        t = self.timings.setdefault((phase, b, k), _Timing())
        t.samples.append(seconds)
        t.last = self.choices.get(b, 0)
