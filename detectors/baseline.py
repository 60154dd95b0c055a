"""Per-key baselines (what normal is for a key), learned from its first healthy minutes or pinned;
a quiet key borrows its latency and error baselines from its bucket or bundle (`BaselinePool`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, fields

from specwatch.schemas.policy import BaselinePolicy, PinnedBaseline

from specwatch.schemas.slice_stats import SliceStats, ratio

__all__ = ["Baseline", "BaselineLearner", "BaselinePool"]

# A key with little traffic keeps learning for up to this many learning periods.
_MAX_LEARN_PERIODS = 5
# A key whose own failures differ from its bundle's rate (by this many nats, a chi-squared test
# at p = 1e-4) keeps its own rate, shrunk toward the bundle's with _PRIOR_FAILURES of prior.
_PRIOR_FAILURES = 2.0
_OWN_RATE_NATS = 7.57
# The bundle's rate is that prior once the bundle has this many requests, or learning ran out.
_PRIOR_REQUESTS = 1000
# After the longest learning, a quiet key with no bucket to borrow from needs this many requests.
_MIN_OWN_REQUESTS = 10


@dataclass
class Baseline:
    """What normal looks like for one key. NaN fields are unknown (their gates stay quiet)."""

    acceptance_length: float = math.nan
    position_rates: list[float] = field(default_factory=list)
    draft_to_verify: float = math.nan
    draft_ms_per_drafted_token: float = math.nan
    e2e_p99_ms: float = math.nan
    tpot_p99_ms: float = math.nan
    error_rate: float = math.nan
    requests: int = 0  # finished requests the latency and error baselines were learned from
    failures: int = 0
    requests_per_second: float = math.nan  # the key's own traffic while it learned
    e2e_tail_share: float = math.nan  # share of the learned requests past the latency limit (smoothed)
    tpot_tail_share: float = math.nan
    verify_ms_per_step: float = math.nan  # the load the latency limits were learned at
    latency_source: str = ""  # "key", or "bucket" when a quiet key borrowed its bucket's
    error_source: str = ""  # "key", or "bundle" when the key's failures were consistent with its bundle's rate
    bundle_error_rate: float = math.nan  # the pooled rate the key's was judged against
    learned_from: float = math.nan
    learned_until: float = math.nan
    pinned: bool = False

    def expected_acceptance_length(self, drafted_at_least: list[int], rounds: int) -> float:
        """Acceptance length the baseline predicts for rounds that drafted as these did (so a
        lowered D is not mistaken for an acceptance drop).

        >>> b = Baseline(position_rates=[0.9, 0.8, 0.7, 0.6])
        >>> round(b.expected_acceptance_length([10, 10, 10, 10], 10), 2)
        4.0
        >>> round(b.expected_acceptance_length([10, 10], 10), 2)
        2.7
        """
        if not rounds:
            return math.nan
        if not self.position_rates:
            return self.acceptance_length
        expected_accepted = 0.0
        for i, drafted in enumerate(drafted_at_least):
            if i >= len(self.position_rates) or math.isnan(self.position_rates[i]):
                return math.nan
            expected_accepted += drafted * self.position_rates[i]
        return 1.0 + expected_accepted / rounds

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Baseline":
        return cls(**{name: data[name] for name in _BASELINE_FIELDS})


_BASELINE_FIELDS = tuple(f.name for f in fields(Baseline))


class BaselinePool:
    """Speculating traffic of every key of one bundle while it learned, by bucket and in total:
    a quiet key borrows its bucket's latency, every key's error rate leans on the bundle's.

    >>> pool = BaselinePool()
    >>> s = SliceStats(); s.add_request(80.0, 9.0, 900.0, True, "stop", 1.0)
    >>> pool.add("coding", s); pool.add("reasoning", s)
    >>> pool.borrow("coding", min_requests=2), pool.borrow("coding", min_requests=1)[1]
    ((None, ''), 'bucket')
    >>> pool.bundle.requests
    2
    >>> control = SliceStats(); control.add_request(80.0, 30.0, 3000.0, False, "stop", 1.0)
    >>> pool.add("coding", control); pool.bundle.requests  # standard decoding is not pooled
    2
    """

    # requests and failures of speculating slices after their keys learned (see `count`)
    later_requests = 0
    later_failures = 0

    def __init__(self) -> None:
        self.buckets: dict[str, SliceStats] = {}
        self.bundle = SliceStats()

    def add(self, bucket: str, stats: SliceStats) -> None:
        # a slower control cohort on standard decoding would loosen the borrowed limit
        if not stats.requests or not stats.speculative_requests:
            return
        mine = self.buckets.get(bucket)
        if mine is None:
            mine = self.buckets[bucket] = SliceStats()
        mine.merge(stats, samples=False)  # what a quiet key borrows is read for quantiles only
        self.bundle.merge(stats, sketches=False)  # across buckets, only counts mean the same

    def count(self, stats: SliceStats) -> None:
        """Count a learned key's speculating slice toward the bundle's error rate (`error_rate`)."""
        if stats.requests and stats.speculative_requests:
            self.later_requests += stats.requests
            self.later_failures += stats.errors + stats.timeouts

    def error_rate(self, without: tuple[int, int] = (0, 0)) -> float:
        """The bundle's failure rate over every request counted so far, smoothed by one failure,
        less ``without`` (a key's own requests and failures since it learned).

        >>> pool = BaselinePool(); s = SliceStats()
        >>> for _ in range(999): s.add_request(80.0, 9.0, 900.0, True, "stop", 1.0)
        >>> s.add_request(80.0, 9.0, 900.0, True, "error", 1.0)
        >>> pool.add("coding", s); pool.error_rate()
        0.001998001998001998
        >>> pool.count(s); pool.error_rate(), pool.error_rate(without=(1000, 1))
        (0.0014992503748125937, 0.001998001998001998)
        """
        requests = self.bundle.requests + self.later_requests - without[0]
        failures = self.bundle.errors + self.bundle.timeouts + self.later_failures - without[1]
        return (failures + 1.0) / (requests + 1.0)

    def to_state(self) -> dict:
        return {"buckets": {bucket: stats.to_state() for bucket, stats in self.buckets.items()},
                "bundle": self.bundle.to_state(), "later_requests": self.later_requests,
                "later_failures": self.later_failures}

    @classmethod
    def from_state(cls, state: dict) -> "BaselinePool":
        pool = cls()
        pool.buckets = {str(bucket): SliceStats.from_state(stats) for bucket, stats in state["buckets"].items()}
        pool.bundle = SliceStats.from_state(state["bundle"])
        pool.later_requests, pool.later_failures = int(state["later_requests"]), int(state["later_failures"])
        return pool

    def borrow(self, bucket: str, min_requests: int) -> tuple[SliceStats | None, str]:
        """The bucket's learned traffic if it holds ``min_requests`` finished requests."""
        mine = self.buckets.get(bucket)
        if mine is not None and mine.requests >= min_requests:
            return mine, "bucket"
        return None, ""


def _shrunk_rate(failures: int, requests: int, prior_rate: float) -> float:
    """The beta posterior mean: ``_PRIOR_FAILURES`` failures' worth of prior at ``prior_rate``."""
    return (failures + _PRIOR_FAILURES) / (requests + _PRIOR_FAILURES / prior_rate)


def rate_evidence_nats(failures: int, requests: int, rate: float) -> float:
    """Log-likelihood ratio of a key's own failure rate against ``rate``, in nats (half the G statistic).

    >>> round(rate_evidence_nats(0, 2563, 0.00226), 2)  # no failure where 5.8 were expected
    5.8
    >>> round(rate_evidence_nats(26, 2563, 0.002), 1)  # five times the rate
    21.4
    >>> rate_evidence_nats(0, 0, 0.002)
    0.0
    """
    if requests <= 0:
        return 0.0
    own = failures / requests
    nats = 0.0
    if failures:
        nats += failures * math.log(own / rate)
    if failures < requests:
        nats += (requests - failures) * math.log((1.0 - own) / (1.0 - rate))
    return nats


def error_baseline(failures: int, requests: int, bundle_rate: float) -> tuple[float, str]:
    """A key's error rate and its source: the bundle's (``"bundle"``) unless its own failures
    differ by ``_OWN_RATE_NATS``, then its own shrunk toward the bundle's (``"key"``).

    >>> [(round(r, 5), source) for r, source in (error_baseline(0, 2563, 0.00226), error_baseline(2, 97, 0.0028),
    ...                                           error_baseline(26, 2563, 0.002))]
    [(0.00226, 'bundle'), (0.0028, 'bundle'), (0.00786, 'key')]
    """
    if rate_evidence_nats(failures, requests, bundle_rate) < _OWN_RATE_NATS:
        return bundle_rate, "bundle"
    return _shrunk_rate(failures, requests, bundle_rate), "key"


def tail_share(stats: SliceStats, metric: str, limit: float) -> float:
    """Share of ``stats``' requests past ``limit`` in ``metric``, smoothed by one request each way
    (none past the limit in n requests does not prove a rate of zero).

    >>> s = SliceStats()
    >>> for ms in (10.0, 11.0, 12.0, 40.0): s.add_request(5.0, ms, 100.0, True, "stop", 0.0)
    >>> round(tail_share(s, "tpot", 30.0), 3)
    0.333
    """
    sketch = getattr(stats, metric)
    if sketch is None or math.isnan(limit):
        return math.nan
    return (sketch.count_past(limit) + 1.0) / (sketch.count + 2.0)


class BaselineLearner:
    """Accumulates a key's first ``learn_seconds`` of traffic into a `Baseline`; pinned values win.

    ``broad_acceptance``: the rounds come from many requests (a bundle's steps), so no request
    count is needed. With a ``pool``, the key feeds it while learning and borrows from it.
    ``tail_factor`` times a learned p99 is the latency limit whose baseline share is kept.

    >>> from specwatch.schemas.policy import BaselinePolicy
    >>> learner = BaselineLearner(BaselinePolicy(learn_seconds=3, min_rounds=2, min_requests=1))
    >>> for t in range(5):
    ...     s = SliceStats(); s.add_round(4, 2); s.add_round(4, 2); s.add_step_time(1.0, 10.0, 0.5, t)
    ...     s.add_request(80.0, 9.0, 900.0, True, "stop", t)
    ...     learner.update(s, slice_end=float(t + 1))
    >>> learner.baseline.acceptance_length, learner.acceptance_ready
    (3.0, True)
    """

    def __init__(self, policy: BaselinePolicy, pinned: PinnedBaseline | None = None,
                 broad_acceptance: bool = False, pool: BaselinePool | None = None, bucket: str = "",
                 tail_factor: float = 2.0) -> None:
        self.policy = policy
        self.pinned = pinned
        self.broad_acceptance = broad_acceptance
        self.pool = pool
        self.bucket = bucket
        self.tail_factor = tail_factor
        self._reset()

    def _reset(self) -> None:
        self.baseline = Baseline()
        self._acc = SliceStats()
        self._draft_costs: list[float] = []  # per slice: one absurd step must not set the baseline
        self._token_costs: list[float] = []
        self._start: float | None = None
        self.acceptance_ready = False
        self.latency_ready = False
        if self.pinned is not None:
            self._apply_pins()

    def _apply_pins(self) -> None:
        pin = self.pinned
        self.baseline.pinned = True
        for name in ("acceptance_length", "draft_to_verify", "e2e_p99_ms", "tpot_p99_ms",
                     "error_rate"):
            if getattr(pin, name) is not None:
                setattr(self.baseline, name, getattr(pin, name))
        if pin.acceptance_length is not None:
            self.acceptance_ready = True
        if pin.e2e_p99_ms is not None or pin.tpot_p99_ms is not None:
            self.latency_ready = True

    def _learn_requests(self, own: SliceStats, source: SliceStats, name: str, elapsed: float) -> None:
        """Latency limits from ``source`` (own or borrowed), the error rate from own counts and a prior."""
        b = self.baseline
        b.latency_source = name
        if source.e2e is not None:
            b.e2e_p99_ms = source.quantile("e2e", 0.99)
            b.tpot_p99_ms = source.quantile("tpot", 0.99)
            b.e2e_tail_share = tail_share(source, "e2e", b.e2e_p99_ms * self.tail_factor)
            b.tpot_tail_share = tail_share(source, "tpot", b.tpot_p99_ms * self.tail_factor)
            b.verify_ms_per_step = ratio(source.verify_ms, source.steps)
        b.requests, b.failures = own.requests, own.errors + own.timeouts
        b.requests_per_second = own.requests / max(elapsed, self.policy.learn_seconds)
        if self.pool is None:  # nothing to borrow from: its own counts, smoothed
            prior_rate = (b.failures + 1.0) / (b.requests + 1.0)
            b.error_rate, b.error_source = _shrunk_rate(b.failures, b.requests, prior_rate), "key"
        else:
            b.bundle_error_rate = prior_rate = self.pool.error_rate()
            b.error_rate, b.error_source = error_baseline(b.failures, b.requests, prior_rate)

    @property
    def done(self) -> bool:
        return self.acceptance_ready and self.latency_ready

    def to_state(self) -> dict:
        """What was learned so far as plain data (the settings and the pool are the owner's)."""
        return {"baseline": self.baseline.to_dict(), "acc": self._acc.to_state(),
                "draft_costs": self._draft_costs, "token_costs": self._token_costs, "start": self._start,
                "acceptance_ready": self.acceptance_ready, "latency_ready": self.latency_ready}

    def load_state(self, state: dict) -> None:
        """Take up learning where `to_state` left it."""
        self.baseline = Baseline.from_dict(state["baseline"])
        self._acc = SliceStats.from_state(state["acc"])
        self._draft_costs = [float(v) for v in state["draft_costs"]]
        self._token_costs = [float(v) for v in state["token_costs"]]
        self._start = state["start"]
        self.acceptance_ready, self.latency_ready = bool(state["acceptance_ready"]), bool(state["latency_ready"])

    def update(self, stats: SliceStats, slice_end: float) -> None:
        if self.done:
            return
        if self._start is None:
            self._start = slice_end
        self._acc.merge(stats, samples=False)
        if not self.acceptance_ready and stats.verify_ms > 0:
            self._draft_costs.append(stats.draft_to_verify)
            if stats.drafted_tokens:
                self._token_costs.append(stats.draft_ms / stats.drafted_tokens)
        if self.pool is not None and not self.latency_ready:
            self.pool.add(self.bucket, stats)
        elapsed = slice_end - self._start
        b, acc = self.baseline, self._acc
        if not self.acceptance_ready and elapsed >= self.policy.learn_seconds:
            # a handful of prompts would bias the baseline by how easy they were
            broad = (self.broad_acceptance or acc.requests >= self.policy.min_requests
                     or elapsed >= self.policy.learn_seconds * _MAX_LEARN_PERIODS)
            if acc.rounds >= self.policy.min_rounds and broad:
                b.position_rates = acc.position_rates()
                b.acceptance_length = acc.acceptance_length
                b.draft_to_verify = statistics.median(self._draft_costs) if self._draft_costs else math.nan
                b.draft_ms_per_drafted_token = (statistics.median(self._token_costs) if self._token_costs
                                                else math.nan)
                b.learned_from, b.learned_until = self._start, slice_end
                self.acceptance_ready = True
            elif acc.rounds == 0 and elapsed >= self.policy.learn_seconds * _MAX_LEARN_PERIODS:
                self.acceptance_ready = True  # a key that never drafts has no acceptance baseline
        if not self.latency_ready and elapsed >= self.policy.learn_seconds:
            out_of_time = elapsed >= self.policy.learn_seconds * _MAX_LEARN_PERIODS
            source, name = (acc, "key") if acc.requests >= self.policy.min_requests else (None, "")
            if source is None and self.pool is not None:
                source, name = self.pool.borrow(self.bucket, self.policy.min_requests)
            if source is None and out_of_time and acc.requests >= _MIN_OWN_REQUESTS:
                source, name = acc, "key"
            prior_known = self.pool is None or self.pool.bundle.requests >= _PRIOR_REQUESTS
            if (source is not None and prior_known) or out_of_time:
                if source is not None:
                    self._learn_requests(acc, source, name, elapsed)
                self.latency_ready = True
        if self.done:
            if self.pinned is not None:
                self._apply_pins()  # pinned values always win over learned ones
            self._acc = SliceStats()  # learning is over: free the accumulated sketches
            self._draft_costs, self._token_costs = [], []
