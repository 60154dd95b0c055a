"""The Faust topology's per-partition tasks, no broker: routing, dedupe, release, checkpoints."""

from __future__ import annotations

import random
from collections import defaultdict

import msgspec
import pytest

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas.latency_sketch import LatencySketch
from specwatch.schemas.slice_stats import SliceStats
from specwatch.schemas import Decision, Policy, Rejection
from specwatch.schemas.outputs import ActionRecord
from specwatch.streams.stage_tasks import (
    CheckpointError,
    PartialMessage,
    Stage1Task,
    Stage2Task,
    decode_checkpoint,
    decode_partial,
    decisions_in,
    encode_checkpoint,
    encode_partial,
    encode_release,
    outbox_pending,
    route_batches,
    stage2_partition,
)
from specwatch.streams.slice_batch import SliceBatch

from telemetry_log import decision_key, embedded_decisions
from test_partitioning import distributed, telemetry_log

PARTITIONS = 4


@pytest.fixture(scope="module", params=["kv_pressure", "bundle_change"])
def scenario(request):
    sim = Simulator(request.param, seed=11, workers=2, minutes=2.0, incident_at=75.0)
    records = list(sim.records())
    cutoff = sim.end_ts - 5.0
    return telemetry_log(records, "worker", PARTITIONS), cutoff, embedded_decisions(records, cutoff)


@pytest.fixture(scope="module")
def straight(scenario):
    log, _, _ = scenario
    return distributed(log, PARTITIONS, seed=1)


def test_partitioned_topology_decides_as_embedded(scenario, straight):
    _, cutoff, expected = scenario
    assert sorted(decision_key(d) for d in straight if d.ts < cutoff) == expected
    assert len({d.id for d in straight}) == len(straight)


def test_decisions_survive_checkpoints_restores_and_resends(scenario, straight):
    """Another interleaving, restarts from checkpoints, batches sent twice: the very same decisions."""
    log, _, _ = scenario
    restarted = distributed(log, PARTITIONS, seed=2, restart_every=10)
    assert sorted(d.id for d in restarted) == sorted(d.id for d in straight)


def test_route_batches_sends_keys_and_events_to_the_bundle_partition_and_a_watermark_everywhere():
    stats = SliceStats()
    batch = SliceBatch("t/0", 5, 6, partials={("b-1", "coding", "main"): stats, ("b-1", None, None): stats,
                                              ("b-2", "chat", "main"): stats},
                       events=[{"type": "bundle", "bundle_id": "b-2", "ts": 5.5}], late_records=3)
    later = SliceBatch("t/0", 6, 6)
    routed = route_batches([batch, later], 4)
    by_partition = defaultdict(list)
    for partition, part in routed:
        by_partition[partition].append(part)
    assert {k for part in by_partition[stage2_partition("b-1", 4)] for k in part.partials} == {
        ("b-1", "coding", "main"), ("b-1", None, None)}
    assert [e["bundle_id"] for part in by_partition[stage2_partition("b-2", 4)] for e in part.events] == ["b-2"]
    assert set(by_partition) == {0, 1, 2, 3}  # every partition hears that the source moved on
    assert sum(part.late_records for _, part in routed) == 3
    for parts in by_partition.values():
        indexes = [part.slice_index for part in parts]
        assert indexes == sorted(set(indexes))
        assert all(part.watermark == 6 for part in parts)


def test_stage2_drops_batches_it_has_merged():
    task = Stage2Task(Policy(), ("t/0",))
    first = encode_partial(SliceBatch("t/0", 10, 10, partials={("b-1", "coding", "main"): SliceStats()}))
    task.fold(0, decode_partial(first))
    task.fold(1, decode_partial(first))
    task.fold(2, decode_partial(encode_partial(SliceBatch("t/0", 9, 10))))
    assert (task.batches, task.duplicates, task.next_offset) == (1, 2, 3)


def _t0_slice(index: int) -> PartialMessage:
    stats = SliceStats()
    stats.add_step_time(1.0, 10.0, 0.5, 40.5)
    batch = SliceBatch("t/0", index, index, partials={("b-1", None, None): stats})
    return decode_partial(encode_partial(batch))


# 44: stage 2 lagged, the release was decided at slice 44 and t/0 had already sent up to 59
@pytest.mark.parametrize("watermark", [-1, 44])
def test_a_source_that_never_reported_holds_slices_until_released(watermark):
    task = Stage2Task(Policy(), ("t/0", "t/1"))  # t/0's slices 40 to 59 folded, t/1 not heard from
    assert [out for index in range(40, 60) for out in task.fold(index, _t0_slice(index))] == []
    released = task.fold(60, decode_partial(encode_release("t/1", watermark)))
    assert [o.slice_index for o in released] == list(range(40, 60))
    more = task.fold(61, _t0_slice(60))
    assert [o.slice_index for o in more] == [60]  # a released source no longer holds anything back


def test_invalid_partials_are_counted_not_fatal():
    task = Stage2Task(Policy(), ())
    message = decode_partial(b"\x00not json")
    assert isinstance(message, Rejection) and message.reason == "invalid_partial"
    assert task.fold(0, message) == [] and task.invalid == 1 and task.next_offset == 1
    assert isinstance(decode_partial(b'{"kind": "batch"}'), Rejection)
    assert decode_partial(encode_release("t/0", 3)) == PartialMessage(release_source="t/0")


def test_checkpoint_errors_are_refused_with_a_reason():
    with pytest.raises(CheckpointError, match="bad header") as refused:
        decode_checkpoint(b"something else")
    assert refused.value.reason == "not_a_checkpoint"
    with pytest.raises(CheckpointError, match="does not inflate") as refused:
        decode_checkpoint(b"SWCK" + msgspec.msgpack.encode({"payload": b"\x78\x01garbage"}))
    assert refused.value.reason == "undecodable"
    with pytest.raises(CheckpointError, match="does not inflate") as refused:
        decode_checkpoint(b"SWCP1" + b"\x78\x01garbage")
    assert refused.value.reason == "undecodable"


def test_outbox_keeps_only_what_the_topic_does_not_hold():
    decisions = [Decision(ts=float(i), bundle_id="b-1", bucket="coding", action="disable_speculation",
                          reason="acceptance_drop", detector="gate") for i in range(3)]
    outbox = [ActionRecord(d, {}, []) for d in decisions]
    on_topic = decisions_in([decisions[0].to_json_line().encode(), b"not a decision", b"{}"])
    assert [a.decision for a in outbox_pending(outbox, on_topic)] == decisions[1:]


def test_restored_stage2_keeps_its_flags_and_outbox():
    task = Stage2Task(Policy(), ("t/0",))
    decision = Decision(ts=1.0, bundle_id="b-1", bucket=None, action="invalidate_bundle", reason="bundle_changed",
                        detector="card")
    task.stage.decider.flags.apply(decision)
    task.outbox = [ActionRecord(decision, {"k": 1}, [])]
    task.outbox_mark = {0: 7}
    restored = decode_checkpoint(encode_checkpoint(task))
    assert restored.stage.decider.flags.lookup("b-1", "coding", "main").enabled is False
    assert restored.stage.decider.fallback.flags is restored.stage.decider.flags
    assert [a.decision for a in restored.outbox] == [decision] and restored.outbox_mark == {0: 7}


def test_a_checkpoint_does_not_change_what_it_saves():
    """Quantiles after a restore are the quantiles without one: nothing is folded early."""
    rng = random.Random(5)
    values = [rng.expovariate(0.01) for _ in range(2000)]
    straight, saved = LatencySketch(), LatencySketch()
    for i, value in enumerate(values):
        straight.add(value)
        saved.add(value)
        if i % 97 == 0:  # through the checkpoint's own encoding
            saved = LatencySketch.from_state(msgspec.msgpack.decode(msgspec.msgpack.encode(saved.to_state())))
    assert straight.to_bytes() == saved.to_bytes()
