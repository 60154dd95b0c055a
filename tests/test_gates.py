"""Baselines that borrow from the bundle and limits that follow load: seeded streams, exact outcomes."""

import random

import msgspec

from specwatch.detectors.baseline import BaselinePool
from specwatch.detectors.monitor import KeyMonitor
from specwatch.schemas.slice_stats import SliceStats
from specwatch.schemas import Policy
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams.embedded import EmbeddedPipeline

from telemetry_log import replayed


def _counts(requests, failures):
    """A slice of finished speculative requests as counts only (no latency sketches)."""
    stats = SliceStats()
    stats.requests = stats.speculative_requests = requests
    stats.errors = failures
    return stats


def _failures(rng, requests, rate):
    return sum(rng.random() < rate for _ in range(requests))


def _update(monitor, stats, t):
    """The findings of ``monitor`` on ``stats``, the slice that ends at second ``t + 1``."""
    stats.max_ts = float(t)
    return monitor.update(stats, float(t + 1))


def _error_alarms(monitor, rng, slices, requests, rate, start):
    return sum(f.reason == "error_rate" for t in range(start, start + slices)
               for f in _update(monitor, _counts(requests, _failures(rng, requests, rate)), t))


def _learned_minute(rng, key_rate):
    """reasoning (43 requests a second failing at ``key_rate``; None: none fails) and coding (150,
    0.2 % fail) learn their first minute into one bundle's pool; the reasoning key's monitor."""
    pool = BaselinePool()
    key, sibling = KeyMonitor(Policy(), "reasoning", pool), KeyMonitor(Policy(), "coding", pool)
    for t in range(61):
        for monitor, requests, rate in ((key, 43, key_rate), (sibling, 150, 0.002)):
            failures = 0 if rate is None else _failures(rng, requests, rate)
            _update(monitor, _counts(requests, failures), t)
    return key


def test_an_unlucky_minute_takes_its_bundles_error_rate():
    # reasoning/main at 32 x 16: 0 failures in its first minute of about 2,560 requests, where
    # 0.2 % fail. Shrunk toward the bundle with two failures' weight, its baseline was a third
    # of the true rate, and its error test raised false alarms at the true rate (1 in these 5
    # key-hour). Its failures are consistent with the bundle's rate, so it now takes that.
    rng = random.Random(31)
    key = _learned_minute(rng, None)
    b = key.baseline
    assert (b.requests, b.failures, b.error_source) == (2623, 0, "bundle")
    assert b.error_rate == b.bundle_error_rate == (21 + 1) / (11623 + 1)
    assert _error_alarms(key, rng, 5 * 3600, 43, 0.002, start=61) == 0


def test_a_key_whose_failures_differ_keeps_its_own_rate():
    # a busy key failing at five times its bundle's rate shows it within its first minute:
    # its baseline is its own, and the same rate later raises nothing
    rng = random.Random(32)
    key = _learned_minute(rng, 0.01)
    b = key.baseline
    assert b.error_source == "key"
    assert b.error_rate > 2 * b.bundle_error_rate  # the bundle's rate holds its own failures too
    assert _error_alarms(key, rng, 3600, 43, 0.01, start=61) == 0


def _timed_slice(rng, verify_ms, tail_share, slow_share=0.0, requests=20):
    """A slice of one key: ten steps at ``verify_ms``; TPOT follows the step time, and
    ``tail_share`` of the requests (load: KV preemption) plus ``slow_share`` (a tail of the
    key's own) run three to four times slower."""
    stats = SliceStats()
    for _ in range(10):
        stats.add_step_time(3.0, verify_ms, 0.5, 0.0)
    for _ in range(requests):
        tpot = verify_ms * (0.8 + 0.4 * rng.random())
        if rng.random() < tail_share + slow_share:
            tpot *= 3.0 + rng.random()
        stats.add_request(50.0, tpot, 100.0 * tpot, True, "stop", 0.0)
    return stats


def _tail_findings(slices_by_key, pool):
    """Feed every key slice by slice, in one order (as stage 2 does); the latency findings per key."""
    monitors = {key: KeyMonitor(Policy(), key, pool) for key in slices_by_key}
    found = []
    for t in range(len(next(iter(slices_by_key.values())))):
        for key, slices in slices_by_key.items():
            findings = _update(monitors[key], slices[t], t)
            found += [(t, key) for f in findings if f.reason == "latency_slo"]
    return found, monitors


def _day(rng, key_tail=0.0, minutes=10):
    """Four keys: a minute at the trough (learning), then load rises over five minutes to the
    peak: steps 25 % slower, and up to 3 % of every key's requests preempted (in step with the
    load). ``key_tail`` adds a tail of extraction's own from the eighth minute."""
    keys = ("extraction", "coding", "reasoning", "structured")
    out = {key: [] for key in keys}
    for t in range(60 * minutes):
        rise = min(1.0, max(0.0, (t - 60) / 300))
        for key in keys:
            own = key_tail if t >= 480 and key == "extraction" else 0.0
            out[key].append(_timed_slice(rng, 10.0 + 2.5 * rise, 0.03 * rise, own))
    return out


def test_a_healthy_peak_is_within_the_limit():
    # before: the limit learned at the trough held 3 % of the peak's requests past it, and
    # every key went off for latency_slo (the false alarm of the day-shaped cycle at 8 x 16);
    # now each band of load learns its own share on the way up
    found, monitors = _tail_findings(_day(random.Random(41)), BaselinePool())
    assert found == []
    assert monitors["extraction"].baseline.verify_ms_per_step == 10.0


def test_a_tail_of_its_own_at_the_peak_is_caught():
    # the same day, and from the eighth minute 10 % more of extraction's requests slow: judged
    # against what its load band learned, extraction alone goes off
    found, _ = _tail_findings(_day(random.Random(41), key_tail=0.10), BaselinePool())
    assert found[:1] == [(491, "extraction")]
    assert {key for _, key in found} == {"extraction"}


def test_key_monitors_restored_from_their_state_mid_incident_decide_the_same():
    # Every key monitor goes through its plain state (as a checkpoint carries it) halfway through
    # a latency incident, load bands and tail tests included: the same decisions, figure for figure.
    sim = Simulator("latency_tail", seed=11, workers=4, minutes=4.0, incident_at=120.0)
    records = list(sim.records())
    whole = replayed(records)
    half = len(records) // 2
    restored = EmbeddedPipeline()
    restored.feed_many(records[:half])
    stage = restored.stage2.decider
    with_tail_tests = 0
    for key, monitor in list(stage.monitors.items()):
        if not isinstance(monitor, KeyMonitor):
            continue
        state = msgspec.msgpack.decode(msgspec.msgpack.encode(monitor.to_state()))
        with_tail_tests += state["tail_tests"] is not None
        again = KeyMonitor(Policy(), key[1], stage.pools[key[0]])
        again.load_state(state)
        stage.monitors[key] = again
    assert with_tail_tests > 0
    restored.feed_many(records[half:])
    restored.finish()
    assert [d.to_json_line() for d in restored.decisions] == [d.to_json_line() for d in whole.decisions]
    assert [(d.reason, d.bucket) for d in whole.decisions] == [("latency_slo", "reasoning")]


def _learned_high_then(rng, burst_from, sibling_rate=0.002, minutes=12):
    """extraction and coding learn a minute in which the bundle drew 6 failures in 1,205
    requests (0.58 %, where 0.2 % fail); then coding runs on at ``sibling_rate`` and, from
    ``burst_from``, extraction fails at 4 %. The slices each key's error test fires at."""
    pool = BaselinePool()
    key, sibling = KeyMonitor(Policy(), "extraction", pool), KeyMonitor(Policy(), "coding", pool)
    fired = {"extraction": [], "coding": []}
    for t in range(60 * minutes):
        learning = t <= 60
        for name, monitor, requests in (("extraction", key, 5), ("coding", sibling, 15)):
            if learning:
                failures = int(name == "coding" and t % 10 == 0)  # 6 failures in its 900 requests
            else:
                rate = 0.04 if name == "extraction" and t >= burst_from else \
                    sibling_rate if name == "coding" else 0.002
                failures = _failures(rng, requests, rate)
            findings = _update(monitor, _counts(requests, failures), t)
            fired[name] += [t for f in findings if f.reason == "error_rate"]
    return key, fired


def test_a_noisy_bundle_rate_is_refined_by_the_bundles_later_traffic():
    # the bundle's rate learned from one minute is noisy: here three times the true rate. The
    # burst was judged against it for as long as it ran; now the bundle's traffic since then
    # (the key's own left out, it may be the incident) refines it
    key, fired = _learned_high_then(random.Random(51), burst_from=120)
    b = key.baseline
    assert (b.requests, b.failures, b.error_source) == (305, 0, "bundle")
    assert b.error_rate == (6 + 1) / (1205 + 1)
    assert (fired["extraction"][:1], fired["coding"]) == ([164], [])  # 184 against the learned rate alone
    assert round(key._error_tests[0].p0, 6) == 0.002161  # near the true 0.2 % by the run's end


def test_a_sibling_incident_does_not_raise_a_keys_error_baseline():
    # coding failing at 5 % raises the bundle's rate, never the extraction key's baseline:
    # the refined rate is capped at what the key learned
    key, fired = _learned_high_then(random.Random(52), burst_from=10 ** 6, sibling_rate=0.05)
    assert key._error_baseline() == key.baseline.error_rate
    assert fired["extraction"] == []


def test_an_error_burst_early_in_a_run_is_decided_against_the_refined_rate():
    # 3 workers, the burst 75 s in: the bundle's rate learned from those 75 s was 0.46 %
    # (the true rate is 0.2 %), and the burst was decided 147 s after its start, past this
    # run's end. Refined by the bundle's traffic since, the key's baseline is 0.31 % when it
    # is decided, 56 s after the start
    sim = Simulator("error_burst", seed=11, workers=3, minutes=3.5, incident_at=75.0)
    pipeline = replayed(sim.records())
    got = [(round(d.ts - sim.start_ts, 2), d.reason, d.bucket, d.cohort, d.evidence["baseline"],
            d.evidence["failures"], d.evidence["requests"]) for d in pipeline.decisions]
    assert got == [(130.99, "error_rate", "extraction", "main", 0.00310318, 9.0, 173)]
