"""Per-key monitors: a `KeyMonitor` per (bundle, bucket, cohort), a `BundleMonitor` per bundle;
both run the gates of the fallback table over rolling windows and return `Finding`s."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from specwatch.schemas.policy import Policy

from .baseline import Baseline, BaselineLearner, BaselinePool
from .gates import BernoulliCusum, ConsecutiveGate, DropDetector
from .rate_tests import error_rate_limit, first_to_fire, rate_tests, retune, tail_rates
from .recovery import RecoveryEvidence
from .stalls import StalledRequests
from specwatch.schemas.slice_stats import SliceStats, merge_all, round_evidence as _round, speedup_leaving_out

__all__ = ["Finding", "KeyMonitor", "BundleMonitor"]


@dataclass(frozen=True)
class Finding:
    """A detector's verdict that something on the fallback table happened."""

    reason: str
    detector: str
    ts: float
    metric: str
    value: float
    threshold: float
    baseline: float
    window_start: float
    window_end: float
    details: dict = field(default_factory=dict)

    def evidence(self) -> dict:
        out = {"metric": self.metric, "value": _round(self.value), "threshold": _round(self.threshold),
               "baseline": _round(self.baseline), "window_start": _round_time(self.window_start),
               "window_end": _round_time(self.window_end)}
        out.update({k: _round(v) for k, v in self.details.items()})
        return out


def _round_time(value: float) -> float:
    """Event times to the millisecond: unix times need ten digits before the point.

    >>> _round_time(1795000000.1234567)
    1795000000.123
    """
    return round(float(value), 3)


_SLO_SHARE = 0.01  # an absolute latency SLO is read as a p99
# A baseline tail share per band of load, so a day's peak is not a tail (docs/EVALUATION.md).
_LOAD_SLICES = 10.0
_LOAD_BAND = 0.1
_BAND_REQUESTS = 500


def _trimmed(slices: list[SliceStats], damage) -> list[SliceStats]:
    """The slices without the one that does the most ``damage`` (scores for every slice at once):
    one absurd record, in every overlapping window, would otherwise make 'several windows running'.

    >>> a, b, c = SliceStats(), SliceStats(), SliceStats()
    >>> a.draft_ms, b.draft_ms, c.draft_ms = 1.0, 5000.0, 2.0
    >>> a.verify_ms = b.verify_ms = c.verify_ms = 10.0
    >>> [s.draft_ms for s in _trimmed([a, b, c], draft_costs)]
    [1.0, 2.0]
    """
    if len(slices) < 2:
        return slices
    scores = damage(slices)
    worst = max(range(len(slices)), key=scores.__getitem__)
    return slices[:worst] + slices[worst + 1:]


def draft_costs(slices: list[SliceStats]) -> list[float]:
    return [-math.inf if math.isnan(s.draft_to_verify) else s.draft_to_verify for s in slices]


def speedup_losses(slices: list[SliceStats]) -> list[float]:
    """How far each slice pulls the window's speedup down: its speedup without that slice (one that
    holds all the window's rounds or time goes first). Slow drafts and rejected rounds alike."""
    return [math.inf if math.isnan(v) else v for v in speedup_leaving_out(slices)]


class _Windowed:
    """A bounded history of slices for one key, with window merges on demand; windows never
    reach back past ``floor`` (set when the path changed, e.g. a restore)."""

    def __init__(self, policy: Policy, *window_slices: int) -> None:
        self.policy = policy
        # history reaches back as far as a restore's evidence spans too
        evidence = math.ceil(policy.actions.restore_evidence_seconds / policy.windows.slice_seconds)
        self.history: deque[tuple[float, SliceStats]] = deque(
            maxlen=max(*window_slices, evidence, 30))
        self.floor = -math.inf
        self._last_window: tuple[tuple, tuple[SliceStats, float, float]] | None = None
        self._count_requests()

    def _count_requests(self) -> None:
        """Requests of the last k slices are ``_requests_pushed - _requests_before[-k]``."""
        self._requests_before: deque[int] = deque(maxlen=self.history.maxlen)
        self._requests_pushed = 0
        for _, stats in self.history:
            self._requests_before.append(self._requests_pushed)
            self._requests_pushed += stats.requests

    def to_state(self) -> dict:
        """The key's history and learning as plain data; the settings are the policy's."""
        return {"history": [[end, stats.to_state()] for end, stats in self.history], "floor": self.floor,
                "requests_before": list(self._requests_before), "requests_pushed": self._requests_pushed,
                "learner": self.learner.to_state()}

    def load_state(self, state: dict) -> None:
        """Take up where `to_state` left (on a monitor made from the same policy)."""
        self.history.clear()
        self.history.extend((float(end), SliceStats.from_state(stats)) for end, stats in state["history"])
        self.floor = float(state["floor"])
        self._last_window = None
        self._requests_before.clear()
        self._requests_before.extend(int(n) for n in state["requests_before"])
        self._requests_pushed = int(state["requests_pushed"])
        self.learner.load_state(state["learner"])

    @property
    def baseline(self) -> Baseline:
        return self.learner.baseline

    def push(self, slice_end: float, stats: SliceStats) -> None:
        self.history.append((slice_end, stats))
        self._requests_before.append(self._requests_pushed)
        self._requests_pushed += stats.requests

    def rearm(self, floor: float | None = None) -> None:
        """Forget streaks after the path changed; with ``floor``, the slices up to it too."""
        self._reset()
        if floor is not None:
            self.floor = floor

    def window(self, slices: int, sketches: bool = True, trim=None) -> tuple[SliceStats, float, float]:
        """The last ``slices`` slices merged, less the most damaging by ``trim`` if given;
        gates judging the same window in one update share one merge."""
        ident = (slices, sketches, trim, self.floor, len(self.history), self.history[-1][0])
        if self._last_window is not None and self._last_window[0] == ident:
            return self._last_window[1]
        recent = list(self.history)[-slices:]
        if recent[0][0] <= self.floor:
            recent = [item for item in recent if item[0] > self.floor] or recent[-1:]
        parts = [s for _, s in recent]
        if trim is not None:
            parts = _trimmed(parts, trim)
        merged = merge_all(parts, sketches), recent[0][0], recent[-1][0]
        self._last_window = (ident, merged)
        return merged

    def window_of_requests(self, slices: int, min_requests: int, max_slices: int,
                           trim=None) -> tuple[SliceStats, float, float] | None:
        """The last ``slices`` slices, widened up to ``max_slices`` until they hold ``min_requests``
        (a request's rounds move together); None when even the widest window has too few."""
        newest = min(max_slices, len(self.history))
        if not newest or self._requests_pushed - self._requests_before[-newest] < min_requests:
            return None
        count, requests = 0, 0
        for end, stats in reversed(self.history):
            if end <= self.floor or count >= max_slices:
                break
            count += 1
            requests += stats.requests
            if count >= slices and requests >= min_requests:
                return self.window(count, sketches=False, trim=trim)
        return None

    def since(self, after: float, seconds: float) -> tuple[SliceStats, float, float] | None:
        """Merged slices ending in ``(max(after, newest - seconds), newest]``; None if none."""
        start = max(after, self.history[-1][0] - seconds) if self.history else math.inf
        recent = [(end, s) for end, s in self.history if end > start]
        if not recent:
            return None
        return merge_all(s for _, s in recent), recent[0][0], recent[-1][0]

    def evidence_window(self, slices: int) -> list[dict]:
        return [dict(s.summary(), slice_end=end) for end, s in list(self.history)[-slices:]]


def _look_threshold(looks: int, cfg) -> float:
    """Nats a test must hold at one of ``looks`` last looks at a gate of false-alarm budget
    ``cfg.false_alarms_per_key_hour`` (`KeyMonitor.last_look`)."""
    return math.log(looks / cfg.false_alarms_per_key_hour)


class KeyMonitor(_Windowed):
    """Acceptance, speedup, latency and error gates for one (bundle, bucket, cohort).

    Parameters
    ----------
    policy
        The policy the gates are tuned by.
    bucket
        Used to look up a pinned baseline for this bucket.
    pool
        The bundle's `BaselinePool`: this key feeds it while learning and borrows from it
        when its own traffic is too thin for a baseline.
    """

    _counted = (0, 0)  # own requests and failures counted into the pool since learning

    def __init__(self, policy: Policy, bucket: str, pool: BaselinePool | None = None) -> None:
        p = policy
        super().__init__(p, p.latency.window_slices, p.errors.window_slices,
                         p.acceptance.max_window_slices, p.speedup.window_slices)
        self.bucket = bucket
        self.learner = BaselineLearner(p.baseline, p.baseline.pinned.get(bucket), pool=pool, bucket=bucket,
                                       tail_factor=p.latency.p99_factor)
        self._load = [0.0, 0.0]  # verify ms and steps, smoothed over about _LOAD_SLICES slices
        # metric -> load band -> [requests past the limit, requests] while the band learns, then its share
        self._bands: dict[str, dict[int, list[float] | float]] = {}
        self.stalls = StalledRequests()
        self._reset()

    def _reset(self) -> None:
        p = self.policy
        self.acceptance_gate = ConsecutiveGate(p.acceptance.consecutive)
        self.acceptance_drift = DropDetector(min_drop=p.acceptance.tolerance)
        self.speedup_gate = ConsecutiveGate(p.speedup.consecutive)
        self._error_tests: list[BernoulliCusum] | None = None
        self._tail_tests: dict[str, tuple[list[BernoulliCusum], float, float]] | None = None  # metric -> (tests, limit ms, share)
        self.stalls.forget()

    def update(self, stats: SliceStats, slice_end: float, speculating: bool = True) -> list[Finding]:
        self.push(slice_end, stats)
        if not self.learner.done:
            self.learner.update(stats, slice_end)
        drafting = speculating or bool(stats.rounds)
        e2e = self._tail_tests.get("e2e") if drafting and self._tail_tests else None
        stalled, finished = self.stalls.update(stats, slice_end, e2e[1] if e2e else None)
        findings: list[Finding] = []
        # The gates judge the speculative evidence a slice holds even where the flags say off: a
        # fallback for one reason must not silence the others (an open loop keeps drafting, and
        # requests that began speculative before a switch still finish and may fail). Latency
        # is judged where the key still drafts: a request the switch caught mid-way decodes its
        # rest the slow way, so its time is the fallback's doing once the key's engines stopped
        # drafting, but where they draft on (an open loop, engines that ignore the switch) its
        # time is speculation's. What a key held when a fallback for another reason ended its
        # evidence is judged once more: `last_look`.
        if drafting:
            findings += self._acceptance(stats.max_ts)
            findings += self._speedup(stats.max_ts)
        # a slice with no speculative request says nothing about speculation
        if self.learner.latency_ready and (stats.speculative_requests or (drafting and stalled)):
            self._count(stats)
            if drafting:
                findings += self._latency(stats, slice_end, stalled, finished)
            findings += self._errors(stats, slice_end)
        return findings

    def last_look(self, keys: int, at: float) -> list[Finding]:
        """Findings of the rate tests (errors, latency tails) at one last look, taken when a
        fallback for another reason switches this key's speculation off and so ends its evidence.

        The rule: a key another incident's fallback covers is still decided on its own evidence,
        the speculated requests it finished before the switch. On healthy traffic a CUSUM's
        statistic, looked at once, passes ``s`` nats with probability at most ``e**-s`` (Ville's
        inequality on the likelihood ratio since its last zero). So each test decides at this
        look once its statistic passes ``ln(looks / budget)``, where ``looks`` counts the tests
        of its gate over the ``keys`` the fallback covers and ``budget`` is the gate's false
        alarms per key-hour: the looks one fallback takes at a gate stay within one key-hour's
        budget. A test that passes its usual threshold decides as usual, not here. The finding
        names the look (``last_look``) and is dated ``at``, the fallback's time; the policy records
        it with its own reason beside the fallback already in force (`FallbackPolicy.decide`).
        """
        found: list[Finding] = []
        if self._error_tests:
            found += self._looked(self._error_tests, keys, at, self.policy.errors, "error_rate",
                                  "error_rate_cusum", "error_rate")
        for metric, (tests, limit, _) in (self._tail_tests or {}).items():
            found += self._looked(tests, keys * len(self._tail_tests), at, self.policy.latency, "latency_slo",
                                  "latency_tail_cusum", f"{metric}_tail_share", {"limit_ms": limit})
        # one decision per key: the test furthest past its look
        return sorted(found, key=lambda f: f.details["look_threshold_nats"] - f.details["evidence_nats"])[:1]

    def rate_evidence(self, keys: int = 1) -> dict[str, dict]:
        """Per rate gate (``error_rate``, ``latency_slo``): its strongest test's evidence now, its
        usual threshold, and the threshold of a last look over ``keys`` covered keys
        (`last_look`); a gate not yet armed is left out. What a postmortem reads when a
        fallback for another reason covered this key.

        >>> from specwatch.schemas.policy import Policy
        >>> KeyMonitor(Policy(), "coding").rate_evidence()
        {}
        """
        gates = []
        if self._error_tests:
            gates.append(("error_rate", self._error_tests, keys * len(self._error_tests), self.policy.errors))
        tails = self._tail_tests or {}
        for tests, _, _ in tails.values():
            gates.append(("latency_slo", tests, keys * len(tails) * len(tests), self.policy.latency))
        out: dict[str, dict] = {}
        for reason, tests, looks, cfg in gates:
            test = max(tests, key=lambda t: t.statistic)
            row = {"evidence_nats": round(test.statistic, 3), "evidence_threshold_nats": round(test.threshold, 3),
                   "look_threshold_nats": round(_look_threshold(looks, cfg), 3),
                   "hits": test.hits, "trials": test.trials}
            if reason not in out or row["evidence_nats"] > out[reason]["evidence_nats"]:
                out[reason] = row
        return out

    def _looked(self, tests: list[BernoulliCusum], keys: int, at: float, cfg, reason: str, detector: str,
                metric: str, extra: dict | None = None) -> list[Finding]:
        looks = keys * len(tests)
        threshold = _look_threshold(looks, cfg)
        min_hits = tests[0].min_hits
        passed = [t for t in tests if t.statistic >= threshold and t.hits >= min_hits]
        if not passed:
            return []
        test = max(passed, key=lambda t: t.statistic)
        return [Finding(reason, detector, at, metric, test.hits / test.trials, test.p1, test.p0,
                        test.started_at - self.policy.windows.slice_seconds, at,
                        {"requests": test.trials, ("failures" if reason == "error_rate" else "requests_above_limit"):
                         test.hits, "evidence_nats": test.statistic, "evidence_threshold_nats": test.threshold,
                         "last_look": True, "look_threshold_nats": threshold, "looks": looks,
                         "baseline_source": (self.baseline.error_source if reason == "error_rate"
                                             else self.baseline.latency_source), **(extra or {})})]

    def _acceptance(self, ts: float) -> list[Finding]:
        cfg = self.policy.acceptance
        if not self.learner.acceptance_ready:
            return []
        found = self.window_of_requests(cfg.window_slices, cfg.min_requests, cfg.max_window_slices,
                                        trim=self._acceptance_deficits)
        if found is None or found[0].rounds < cfg.min_rounds:
            self.acceptance_gate.update(None)
            return []
        window, start, end = found
        expected = self.baseline.expected_acceptance_length(window.drafted_at_least, window.rounds)
        if math.isnan(expected):
            return []
        observed = window.acceptance_length
        relative = observed / expected
        threshold = 1.0 - cfg.tolerance
        self.acceptance_gate.update(relative < threshold)
        self.acceptance_drift.update(relative)
        detector = ("acceptance_gate" if self.acceptance_gate.drift_detected
                    else "acceptance_adwin" if self.acceptance_drift.drift_detected and relative < threshold
                    else None)
        if detector is None:
            return []
        return [Finding("acceptance_drop", detector, ts, "acceptance_length", observed, expected * threshold,
                        expected, start, end,
                        {"relative_to_baseline": relative, "rounds": window.rounds,
                         "mean_draft_length": window.drafted_tokens / window.rounds,
                         "consecutive": self.acceptance_gate.streak})]

    def _acceptance_deficits(self, slices: list[SliceStats]) -> list[float]:
        """Accepted tokens each slice fell short of what the baseline predicts for its rounds."""
        rates = self.baseline.position_rates
        return [sum(d * r for d, r in zip(s.drafted_at_least, rates) if not math.isnan(r)) - s.accepted_tokens
                for s in slices]

    def _speedup(self, ts: float) -> list[Finding]:
        cfg = self.policy.speedup
        acceptance = self.policy.acceptance
        found = self.window_of_requests(cfg.window_slices, acceptance.min_requests,
                                        max(cfg.window_slices, acceptance.max_window_slices), trim=speedup_losses)
        if found is None or found[0].rounds < acceptance.min_rounds or found[0].steps == 0:
            self.speedup_gate.update(None)
            return []
        window, start, end = found
        speedup = window.speedup
        self.speedup_gate.update(speedup < cfg.min_speedup)
        if not self.speedup_gate.drift_detected:
            return []
        return [Finding("no_speedup", "speedup_gate", ts, "estimated_speedup", speedup, cfg.min_speedup,
                        math.nan, start, end,
                        {"acceptance_length": window.acceptance_length,
                         "draft_overhead": window.draft_overhead, "rounds": window.rounds})]

    def _tail_limits(self) -> dict[str, tuple[float, float]]:
        """Latency limit (ms) and the baseline's share past it, per metric with a limit."""
        cfg, b = self.policy.latency, self.baseline
        out = {}
        for metric, slo, base, share in (("e2e", cfg.e2e_p99_slo_ms, b.e2e_p99_ms, b.e2e_tail_share),
                                         ("tpot", cfg.tpot_p99_slo_ms, b.tpot_p99_ms, b.tpot_tail_share)):
            relative = base * cfg.p99_factor if not math.isnan(base) else math.inf
            if slo is not None and slo < relative:
                out[metric] = (slo, _SLO_SHARE)
            elif math.isfinite(relative):
                out[metric] = (relative, share if not math.isnan(share) else _SLO_SHARE)
        return out

    def to_state(self) -> dict:
        state = super().to_state()
        tail = self._tail_tests
        state.update(
            load=list(self._load),
            bands={metric: [[band, learned] for band, learned in bands.items()] for metric, bands in self._bands.items()},
            stalls=self.stalls.to_state(), acceptance_gate=self.acceptance_gate.to_state(),
            acceptance_drift=self.acceptance_drift.to_state(), speedup_gate=self.speedup_gate.to_state(),
            error_tests=None if self._error_tests is None else [t.to_state() for t in self._error_tests],
            tail_tests=None if tail is None else {metric: [[t.to_state() for t in tests], limit, share]
                                                  for metric, (tests, limit, share) in tail.items()},
            counted=list(self._counted))
        return state

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self._load = [float(v) for v in state["load"]]
        self._bands = {str(metric): {int(band): (float(learned) if isinstance(learned, (int, float))
                                                 else [float(learned[0]), int(learned[1])])
                                     for band, learned in bands} for metric, bands in state["bands"].items()}
        self.stalls.load_state(state["stalls"])
        self.acceptance_gate.load_state(state["acceptance_gate"])
        self.acceptance_drift.load_state(state["acceptance_drift"])
        self.speedup_gate.load_state(state["speedup_gate"])
        errors, tail = state["error_tests"], state["tail_tests"]
        self._error_tests = None if errors is None else [BernoulliCusum.from_state(t) for t in errors]
        self._tail_tests = None if tail is None else {
            str(metric): ([BernoulliCusum.from_state(t) for t in tests], float(limit), float(share))
            for metric, (tests, limit, share) in tail.items()}
        self._counted = (int(state["counted"][0]), int(state["counted"][1]))

    def _load_factor(self, stats: SliceStats) -> float:
        """The key's verify time per step, smoothed, over what it was while the baseline learned."""
        keep = 1.0 - 1.0 / _LOAD_SLICES
        load = self._load
        load[0] = load[0] * keep + stats.verify_ms
        load[1] = load[1] * keep + stats.steps
        learned = self.baseline.verify_ms_per_step
        return load[0] / load[1] / learned if load[1] and learned > 0 else math.nan

    def _band_share(self, metric: str, band: int, share: float, past: float, requests: int) -> float:
        """The baseline share past the limit at load ``band`` (0: as learned); learns the band from this slice."""
        bands = self._bands.setdefault(metric, {})
        below = share
        for lower in range(1, band):
            learned = bands.get(lower)
            if isinstance(learned, float):
                below = learned
        if band <= 0 or isinstance(bands.get(band), float):
            return bands.get(band, share) if band > 0 else share
        tally = bands.setdefault(band, [0.0, 0])
        tally[0] += past
        tally[1] += requests
        if tally[1] >= _BAND_REQUESTS:
            learned = (tally[0] + 1.0) / (tally[1] + 2.0)
            if learned <= tail_rates(self.policy.latency, below)[1]:
                bands[band] = max(below, learned)
            else:  # the band below would call this a tail: learn again, still judged by it
                bands[band] = [0.0, 0]
        return below

    def _latency(self, stats: SliceStats, slice_end: float, stalled: int = 0, finished: int = 0) -> list[Finding]:
        """Tail tests on the slice's finished requests; e2e also counts ``stalled`` requests
        that passed its limit while running, and not again the ``finished`` ones among them."""
        cfg = self.policy.latency
        if self._tail_tests is None:
            self._tail_tests = {}
            for metric, (limit, share) in self._tail_limits().items():
                tests = rate_tests(*tail_rates(cfg, share), self.baseline.requests_per_second,
                                    cfg.false_alarms_per_key_hour, cfg.min_tail_requests)
                if tests:
                    self._tail_tests[metric] = (tests, limit, share)
        load = self._load_factor(stats)
        band = int((load - 1.0) / _LOAD_BAND + 1e-9) if load > 1.0 else 0
        fired = []
        for metric, (tests, limit, share) in self._tail_tests.items():
            sketch = getattr(stats, metric)
            requests, past = (sketch.count, sketch.count_past(limit)) if sketch is not None else (0, 0.0)
            trials, hits = requests, past
            if metric == "e2e":
                trials, hits = trials + stalled - finished, hits + stalled - finished
            if sketch is None and trials <= 0:
                continue
            hits = max(0.0, hits)
            band_share = self._band_share(metric, band, share, past, requests)  # learned from finished requests
            retune(tests, *tail_rates(cfg, band_share))
            test = first_to_fire(tests, trials, hits, slice_end)
            if test is not None:
                fired.append((test.statistic, metric, test, limit, band_share))
        if not fired:
            return []
        _, metric, test, limit, band_share = max(fired, key=lambda f: f[0])
        stalls = {}  # requests counted past the e2e limit while still running
        if metric == "e2e" and self.stalls.counted:
            stalls = {"requests_running_past_limit": len(self.stalls.counted),
                      "oldest_running_s": self.stalls.oldest_age(slice_end)}
        window, _, end = self.window(cfg.window_slices)
        return [Finding("latency_slo", "latency_tail_cusum", stats.max_ts, f"{metric}_tail_share",
                        test.hits / test.trials, test.p1, test.p0, test.started_at - self.policy.windows.slice_seconds,
                        end, {"limit_ms": limit, "requests": test.trials, "requests_above_limit": test.hits,
                              "evidence_nats": test.statistic, "evidence_threshold_nats": test.threshold,
                              f"{metric}_p99_ms": window.quantile(metric, 0.99),
                              f"{metric}_p50_ms": window.quantile(metric, 0.5),
                              "baseline_source": self.baseline.latency_source,
                              "load_factor": load, "load_band": band, "band_tail_share": band_share,
                              **stalls})]

    def _count(self, stats: SliceStats) -> None:
        """Count a speculating slice into the bundle's error rate, and remember this key's part."""
        pool = self.learner.pool
        if pool is not None and stats.speculative_requests:
            pool.count(stats)
            self._counted = (self._counted[0] + stats.requests,
                             self._counted[1] + stats.errors + stats.timeouts)

    def _error_baseline(self) -> float:
        """The learned error rate, or lower where the bundle's traffic since, this key's own left
        out, shows a lower rate; never higher: the other keys' rise is their own incident."""
        base, pool, pin = self.baseline.error_rate, self.learner.pool, self.learner.pinned
        if pool is None or self.baseline.error_source != "bundle" or (pin is not None and pin.error_rate is not None):
            return base
        return min(base, pool.error_rate(without=self._counted))

    def _errors(self, stats: SliceStats, slice_end: float) -> list[Finding]:
        cfg = self.policy.errors
        base = self._error_baseline()
        if self._error_tests is None:
            self._error_tests = rate_tests(base, error_rate_limit(cfg, base), self.baseline.requests_per_second,
                                            cfg.false_alarms_per_key_hour, cfg.min_errors)
        else:
            retune(self._error_tests, base, error_rate_limit(cfg, base))
        test = first_to_fire(self._error_tests, stats.requests, stats.errors + stats.timeouts, slice_end)
        if test is None:
            return []
        return [Finding("error_rate", "error_rate_cusum", stats.max_ts, "error_rate", test.hits / test.trials,
                        test.p1, test.p0, test.started_at - self.policy.windows.slice_seconds, slice_end,
                        {"requests": test.trials, "failures": test.hits, "evidence_nats": test.statistic,
                         "evidence_threshold_nats": test.threshold,
                         "baseline_requests": self.baseline.requests, "baseline_failures": self.baseline.failures,
                         "baseline_source": self.baseline.error_source,
                         "bundle_error_rate": (test.p0 if self.baseline.error_source == "bundle"
                                               else self.baseline.bundle_error_rate)})]


class BundleMonitor(_Windowed):
    """Step-level gates for a bundle, whose engine steps mix every bucket: KV and draft cost."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy, policy.draft_overhead.window_slices)
        self.learner = BaselineLearner(policy.baseline, None, broad_acceptance=True)
        self._reset()

    def _reset(self) -> None:
        self.kv_gate = ConsecutiveGate(self.policy.kv.consecutive)
        self.draft_gate = ConsecutiveGate(self.policy.draft_overhead.consecutive)

    def to_state(self) -> dict:
        state = super().to_state()
        state.update(kv_gate=self.kv_gate.to_state(), draft_gate=self.draft_gate.to_state())
        return state

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.kv_gate.load_state(state["kv_gate"])
        self.draft_gate.load_state(state["draft_gate"])

    def recovery_evidence(self, since: float, seconds: float) -> RecoveryEvidence | None:
        """Peak KV usage of the bundle's engine steps in the last ``seconds`` after ``since``."""
        found = self.since(since, seconds)
        if found is None:
            return None
        window, start, end = found
        return RecoveryEvidence("kv", start, end, kv_peak=window.kv_peak, kv_limit=self.policy.kv.watermark)

    def update(self, stats: SliceStats, slice_end: float, speculating: bool = True) -> list[Finding]:
        self.push(slice_end, stats)
        if not self.learner.done:
            self.learner.update(stats, slice_end)
        findings: list[Finding] = []
        if stats.steps == 0:
            return findings
        kv = self.policy.kv
        self.kv_gate.update(stats.kv_peak > kv.watermark if speculating else None)
        if self.kv_gate.drift_detected:
            findings.append(Finding("kv_pressure", "kv_watermark_gate", stats.max_ts, "kv_peak", stats.kv_peak,
                                    kv.watermark, math.nan, slice_end - kv.consecutive * 1.0, slice_end,
                                    {"consecutive": self.kv_gate.streak}))
        cfg = self.policy.draft_overhead
        base = self.baseline.draft_to_verify
        window, start, end = self.window(cfg.window_slices, sketches=False, trim=draft_costs)
        if speculating and self.learner.acceptance_ready and not math.isnan(base) and window.rounds:
            value = window.draft_to_verify
            # a larger drafting share of a batch raises draft per verify, not cost per token
            per_token_base = self.baseline.draft_ms_per_drafted_token
            per_token = window.draft_ms / window.drafted_tokens if window.drafted_tokens else math.nan
            costlier = math.isnan(per_token_base) or per_token > per_token_base * cfg.factor
            self.draft_gate.update(value > base * cfg.factor and costlier)
            if self.draft_gate.drift_detected:
                findings.append(Finding("draft_overhead", "draft_cost_gate", stats.max_ts, "draft_to_verify",
                                        value, base * cfg.factor, base, start, end,
                                        {"draft_overhead": window.draft_overhead,
                                         "draft_ms_per_step": window.draft_ms / window.steps,
                                         "draft_ms_per_drafted_token": per_token,
                                         "baseline_draft_ms_per_drafted_token": per_token_base,
                                         "speedup": window.speedup}))
        return findings
