"""Cheap keys: what stage 2 and the detectors keep and do per key and slice."""

import gc
import random

from specwatch.lab.bench.key_cost import step_lines
from specwatch.detectors.baseline import BaselineLearner, BaselinePool
from specwatch.detectors.monitor import KeyMonitor
from specwatch.schemas.slice_stats import SliceStats, sample_record
from specwatch.schemas import Policy
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.combine import Stage1
from specwatch.streams.merge import Stage2
from specwatch.streams.slice_batch import SliceBatch
from specwatch.streams.sources import Ingest


def _batches(lines, source="s"):
    ingest = Ingest(Stage1(Policy(), source=source))
    return ingest.block(decode_lines_block(lines)).closed + ingest.release()


def test_stage2_keeps_a_partial_one_source_holds_and_copies_one_two_hold():
    # before: every partial was copied into a new SliceStats, whatever held it
    lines, _ = step_lines(keys=40, slices=3, rounds_per_slice=40)
    one, other = _batches(lines, "a"), _batches(lines[:1] + lines[1:4], "b")
    first = next(b for b in one if b.partials)
    key = next(k for k in first.partials if k[1] is not None)
    stage = Stage2(Policy())
    for batch in one:
        stage.add(batch)
    stage.flush()
    assert stage.decider.monitors[key].history[0][1] is first.partials[key]

    # two sources hold the same key in the same slice: merged into a slice-own copy,
    # neither source's partial written to
    twice = Stage2(Policy())
    first_a = next(b for b in _batches(lines, "a") if b.partials)
    first_b = next(b for b in other if b.partials)
    assert first_a.slice_index == first_b.slice_index
    before = (first_a.partials[key].to_dict(), first_b.partials[key].to_dict())
    for batch in (first_a, first_b):  # neither vouches for the slice: both are pending when it is decided
        twice.add(SliceBatch(batch.source, batch.slice_index, batch.slice_index - 1, batch.partials))
    twice.flush()
    merged = twice.decider.monitors[key].history[0][1]
    assert merged is not first_a.partials[key] and merged is not first_b.partials[key]
    assert merged.rounds == first_a.partials[key].rounds + first_b.partials[key].rounds == 2
    assert (first_a.partials[key].to_dict(), first_b.partials[key].to_dict()) == before


def _plain_window_of_requests(monitor, slices, min_requests, max_slices):
    """The walk over the history `window_of_requests` answered with before its running count."""
    count, requests = 0, 0
    for end, stats in reversed(monitor.history):
        if end <= monitor.floor or count >= max_slices:
            break
        count += 1
        requests += stats.requests
        if count >= slices and requests >= min_requests:
            return monitor.window(count, sketches=False)
    return None


def test_window_of_requests_matches_the_plain_walk_on_seeded_histories():
    rng = random.Random(5)
    policy = Policy()
    found = 0
    for trial in range(40):
        monitor = KeyMonitor(policy, "coding")
        for t in range(rng.randrange(1, 150)):
            stats = SliceStats()
            for _ in range(rng.choice((0, 0, 0, 1, 3, 20))):
                stats.add_request(50.0, 5.0, 500.0, True, "stop", float(t))
            stats.add_round(4, rng.randrange(5))
            monitor.push(float(t + 1), stats)
            if rng.random() < 0.02:
                monitor.floor = float(t + 1)
        for slices, min_requests, max_slices in ((5, 50, 60), (1, 0, 1), (3, 7, 10), (5, 1000, 60)):
            quick = monitor.window_of_requests(slices, min_requests, max_slices)
            plain = _plain_window_of_requests(monitor, slices, min_requests, max_slices)
            assert (quick is None) == (plain is None)
            if quick is not None:
                found += 1
                assert (quick[0].to_dict(), quick[1:]) == (plain[0].to_dict(), plain[1:])
    assert found == 91  # both answers occur on these seeds


def test_a_quiet_key_is_answered_without_walking_its_history():
    # before: every slice walked up to 60 slices of a key that had no requests in any
    class NoWalk(list):
        def __reversed__(self):
            raise AssertionError("the history was walked")

    monitor = KeyMonitor(Policy(), "coding")
    for t in range(60):
        stats = SliceStats()
        stats.add_round(4, 2)
        monitor.push(float(t + 1), stats)
    monitor.history = NoWalk(monitor.history)
    assert monitor.window_of_requests(5, 50, 60) is None


def test_a_monitor_restored_from_its_state_keeps_the_running_count():
    monitor = KeyMonitor(Policy(), "coding")
    for t in range(8):
        stats = SliceStats()
        for _ in range(10):
            stats.add_request(50.0, 5.0, 500.0, True, "stop", float(t))
        monitor.push(float(t + 1), stats)
    restored = KeyMonitor(Policy(), "coding")
    restored.load_state(monitor.to_state())
    assert restored._requests_pushed == 80 and list(restored._requests_before) == list(range(0, 80, 10))
    assert restored.window_of_requests(5, 50, 60)[0].requests == 50


def test_baselines_learn_from_counts_and_sketches_without_samples():
    # before: the learner and the bundle's pool merged every slice's samples too, never read
    stats = SliceStats()
    stats.add_request(80.0, 9.0, 900.0, True, "stop", 1.0)
    stats.offer_sample("control_request", (1, "r1"), lambda: {"id": "r1"})
    pool = BaselinePool()
    learner = BaselineLearner(Policy().baseline, pool=pool, bucket="coding")
    learner.update(stats, 1.0)
    assert learner._acc.requests == 1 and learner._acc.e2e.count == 1 and learner._acc.samples == {}
    assert pool.buckets["coding"].requests == 1 and pool.buckets["coding"].samples == {}
    whole = SliceStats()
    whole.merge(stats)
    assert [sample_record(s) for s in whole.samples["control_request"]] == [{"id": "r1"}]


def _tracked_per_key_slice(keys, slices):
    lines, _ = step_lines(keys, slices, keys)
    gc.collect()
    before = len(gc.get_objects())
    pipeline = EmbeddedPipeline()
    pipeline.feed_lines(lines)
    pipeline.finish()
    gc.collect()
    # Stage 1's running-request tracker holds a list per request the steps list (here every
    # round is a request that never ends): a cost per running request, not per key-slice.
    kept = len(gc.get_objects()) - before - len(pipeline.stage1.running)
    del pipeline
    return kept / (keys * slices)


def test_objects_the_collector_tracks_per_retained_key_slice():
    # The cyclic collector walks every tracked object a key keeps: with many keys that walk
    # was most of the cost of a key-slice. before: 16.8 per key-slice (a partial and its
    # arguments per kept sample, a copy of every partial).
    assert _tracked_per_key_slice(500, 12) <= 13.0


def test_a_key_without_traffic_is_not_judged():
    # stage 2 knows 2,000 keys; the slices after the first carry one key's rounds
    warm, _ = step_lines(2_000, 1, 2_000)
    busy, _ = step_lines(1, 6, 1)
    stage = Stage2(Policy())
    rows = []
    for batch in _batches(warm + busy[2:]):
        for output in stage.add(batch):
            rows.append(len(output.window_rows))
    rows += [len(output.window_rows) for output in stage.flush()]
    assert len(stage.decider.monitors) == 2_001  # every key and the bundle
    assert rows == [2_001, 2, 2, 2, 2, 2]  # then the busy key and its bundle only
