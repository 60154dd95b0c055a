"""However telemetry is keyed (not, by worker, by resource) and partitioned (1, 3 or 4), the
topology decides what `replay` decides, byte for byte, in a seeded interleaving."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from functools import lru_cache

import pytest
from kafka.partitioner.default import murmur2

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Decision, Policy
from specwatch.schemas.otlp import encode_records
from specwatch.streams.stage_tasks import (
    BundleOwner,
    Stage1Task,
    Stage2Task,
    decode_checkpoint,
    decode_partial,
    encode_checkpoint,
    encode_partial,
    encode_release,
    route_batches,
)

from telemetry_log import exporter_batches, replayed

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


def telemetry_log(records, keying: str, partitions: int,
                  seed: int = 7) -> dict[int, list[tuple[float, bytes]]]:
    """OTLP messages per partition, each with its first event time: one per worker (or bundle,
    for shadows) per flush interval."""
    rng = random.Random(seed)
    log: dict[int, list[tuple[float, bytes]]] = defaultdict(list)

    def partition(source: str) -> int:
        if keying == "unkeyed":
            return rng.randrange(partitions)
        key = source if keying == "worker" else f"service.name=engine,service.instance.id={source}"
        return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions

    for source, first_ts, chunk in exporter_batches(records):
        log[partition(source)].append((first_ts, chunk))
    return log


def distributed(log: dict[int, list[tuple[float, bytes]]], partitions: int, seed: int,
                restart_every: int = 0, skew: float = math.inf, stage2_partitions: int = 4,
                end: bool = False) -> list[Decision]:
    """What the per-partition tasks decide over ``log``: stage 1 per telemetry partition in a
    seeded interleaving of partitions within ``skew`` event-time seconds of each other, then
    stage 2 per partials partition (`stage2_decisions`); to the end of the stream if ``end``.

    ``restart_every``: a task checkpoints every so many messages, and about as often is
    replaced by its last checkpoint, as a restarted worker would be: stage 1 then folds
    and sends again what it had sent since (stage 2 must drop the repeats).
    """
    rng = random.Random(seed)
    sources = tuple(f"t/{p}" for p in range(partitions))
    stage1 = {p: Stage1Task(Policy(), f"t/{p}") for p in range(partitions)}
    saved = {p: encode_checkpoint(task) for p, task in stage1.items()}
    partials: dict[int, list[bytes]] = defaultdict(list)
    position = {p: 0 for p in range(partitions)}

    def send(closed):
        for q, batch in route_batches(closed, stage2_partitions):
            partials[q].append(encode_partial(batch))

    while any(position[p] < len(log[p]) for p in range(partitions)):
        waiting = {p: log[p][position[p]][0] for p in range(partitions) if position[p] < len(log[p])}
        oldest = min(waiting.values())
        p = rng.choice([p for p, ts in waiting.items() if ts <= oldest + skew])
        offset, task = position[p], stage1[p]
        send(task.fold(offset, log[p][offset][1])[1])
        position[p] = task.next_offset
        if restart_every and offset % restart_every == 0:
            saved[p] = encode_checkpoint(task)
        elif restart_every and rng.random() < 1 / restart_every:
            stage1[p] = decode_checkpoint(saved[p])  # back to the checkpoint: fold and send again
            position[p] = stage1[p].next_offset or 0
    for p in range(partitions if end else 0):  # the end of the stream: every open slice closes
        send(stage1[p].stage.close_ready(final=True))
    silent = [f"t/{p}" for p in range(partitions) if not log.get(p)]
    return stage2_decisions(partials, stage2_partitions, sources, silent, flush=end,
                            restart=lambda: restart_every and rng.random() < 1 / restart_every)


def stage2_decisions(partials: dict[int, list[bytes]], partitions: int, sources: tuple[str, ...],
                     silent: list[str], restart=lambda: False, flush: bool = False
                     ) -> list[Decision]:
    """What the stage-2 task of each partials partition decides: it folds the release of every
    ``silent`` source (as the app releases a drained one), then its messages; it is replaced by
    its checkpoint after a message whenever ``restart()``, and flushed at the end if ``flush``."""
    decided = []
    for q in range(partitions):
        task = Stage2Task(Policy(), sources, BundleOwner(q, partitions))
        releases = [encode_release(source, -1) for source in silent]
        for offset, value in enumerate(releases + partials[q]):
            outputs = task.fold(offset, decode_partial(value))
            decided += [a.decision for output in outputs for a in output.actions]
            if restart():
                task = decode_checkpoint(encode_checkpoint(task))
        if flush:
            decided += [a.decision for output in task.stage.flush() for a in output.actions]
    return decided


def _distributed(log: dict[int, list[tuple[float, bytes]]], partitions: int,
                 seed: int) -> list[str]:
    decided = distributed(log, partitions, seed, skew=_MAX_CONSUMER_SKEW_SECONDS,
                          stage2_partitions=_STAGE2_PARTITIONS, end=True)
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
    log = telemetry_log(records, keying, partitions)
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
