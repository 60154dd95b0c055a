"""However telemetry is keyed (not, by worker, by resource) and partitioned (1, 3 or 4), the
topology decides what `replay` decides, byte for byte, in a seeded interleaving."""

from __future__ import annotations

import random
from collections import defaultdict
from functools import lru_cache

import pytest
from kafka.partitioner.default import murmur2

from specwatch.simulation.simulator import Simulator
from specwatch.schemas import Policy
from specwatch.schemas.otlp import encode_records
from specwatch.streams.faust_tasks import Stage1Task, encode_partial, route_batches

from telemetry_log import exporter_batches, replayed
from test_faust_tasks import stage2_decisions

_FLUSH_EVENT_SECONDS = 0.5  # how much event time one exporter batch holds
# How far in event time one stage-1 partition may run ahead of another: consumers that keep
# up, as the guarantee requires (every record within the policy's lateness, 1 s). A partition
# left further behind is a lagging consumer, whose late slices stage 2 folds forward.
_MAX_CONSUMER_SKEW_SECONDS = 0.5
_STAGE2_PARTITIONS = 3


@lru_cache(maxsize=None)
def _records(scenario: str) -> tuple:
    # the incident two minutes in: a key's error baseline (its bundle's rate, when its own
    # failures agree with it) learned from 75 s of traffic came out at twice the true rate,
    # and the burst was decided only after the run's end
    sim = Simulator(scenario, seed=11, workers=3, minutes=3.5, incident_at=120.0)
    return tuple(sim.records())


def _telemetry_log(records, keying: str, partitions: int, seed: int = 7) -> dict[int, list[tuple[float, bytes]]]:
    """OTLP messages per partition, each with its first event time: one per worker (or bundle,
    for shadows) per flush interval."""
    rng = random.Random(seed)
    log: dict[int, list[tuple[float, bytes]]] = defaultdict(list)

    def partition(source: str) -> int:
        if keying == "unkeyed":
            return rng.randrange(partitions)
        key = source if keying == "worker" else f"service.name=engine,service.instance.id={source}"
        return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions

    for source, first_ts, chunk in exporter_batches(records, _FLUSH_EVENT_SECONDS):
        log[partition(source)].append((first_ts, chunk))
    return log


def _distributed(log: dict[int, list[tuple[float, bytes]]], partitions: int, seed: int) -> list[str]:
    """Decision lines of the per-partition tasks over ``log``, to the end, in a seeded interleaving
    of partitions that stay within `_MAX_CONSUMER_SKEW_SECONDS` of each other."""
    rng = random.Random(seed)
    sources = tuple(f"t/{p}" for p in range(partitions))
    stage1 = {p: Stage1Task(Policy(), f"t/{p}") for p in range(partitions)}
    partials: dict[int, list[bytes]] = defaultdict(list)
    position = {p: 0 for p in range(partitions)}

    def send(closed):
        for q, batch in route_batches(closed, _STAGE2_PARTITIONS):
            partials[q].append(encode_partial(batch))

    while any(position[p] < len(log[p]) for p in range(partitions)):
        waiting = {p: log[p][position[p]][0] for p in range(partitions) if position[p] < len(log[p])}
        oldest = min(waiting.values())
        p = rng.choice([p for p, ts in waiting.items() if ts <= oldest + _MAX_CONSUMER_SKEW_SECONDS])
        _, closed = stage1[p].fold(position[p], log[p][position[p]][1])
        send(closed)
        position[p] += 1
    for p in range(partitions):  # the end of the stream: every open slice closes
        send(stage1[p].stage.close_ready(final=True))
    silent = [f"t/{p}" for p in range(partitions) if not log.get(p)]
    decided = stage2_decisions(partials, _STAGE2_PARTITIONS, sources, silent, flush=True)
    return sorted(d.to_json_line() for d in decided)


def _replayed(records) -> list[str]:
    return sorted(d.to_json_line() for d in replayed(records).decisions)


@pytest.fixture(scope="module", params=["bundle_change", "acceptance_drop", "error_burst"])
def scenario(request):
    records = _records(request.param)
    expected = _replayed(records)
    assert expected
    return records, expected


@pytest.mark.parametrize("keying,partitions", [
    ("unkeyed", 4), ("unkeyed", 3), ("unkeyed", 1), ("worker", 4), ("worker", 3), ("resource", 4),
])
def test_every_partitioning_decides_as_replay_byte_for_byte(scenario, keying, partitions):
    records, expected = scenario
    log = _telemetry_log(records, keying, partitions)
    assert _distributed(log, partitions, seed=partitions) == expected


def test_a_bundle_change_split_over_partitions_is_decided_at_the_change():
    """The worker's old card on one partition, its new card on another: still decided at the change."""
    records = _records("bundle_change")
    (expected,) = [line for line in _replayed(records) if '"invalidate_bundle"' in line]
    cards = [r for r in records if r.kind == "bundle"]
    changed = next(r for r in cards if r.bundle_id != cards[0].bundle_id)
    before = [r for r in cards if r.worker == changed.worker and r.ts < changed.ts][-1]
    log: dict[int, list[tuple[float, bytes]]] = defaultdict(list)
    for record in records:
        # the worker's cards alternate partitions; everything else on partition 0
        log[1 if record is changed else 0].append((record.ts, encode_records([record])))
    assert before is not changed
    assert expected in _distributed(log, 2, seed=1)
