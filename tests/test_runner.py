"""The partition runner on the in-memory twin of Kafka: restore, skip, gap read, catch-up."""

from __future__ import annotations

import asyncio
import json
import math
import zlib
from collections import Counter
from dataclasses import replace

import pytest

from specwatch.schemas import Decision, Policy
from specwatch.schemas.checkpoint import CHECKPOINT_VERSION, Checkpoint, pack_checkpoint
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams.stage_tasks import checkpoint_entries, decode_partial, read_checkpoint
from specwatch.streams.checkpoint_log import CheckpointLog
from specwatch.streams.partition_runner import Stage1Runner, Stage2Runner, StreamSettings
from specwatch.transport.codec import decode_decision, is_heartbeat_key
from specwatch.transport.memory import MemoryKafka, MemoryReader, MemoryWriter
from specwatch.transport.signing import Keyring

from telemetry_log import decision_key, embedded_decisions, exporter_batches, replayed

PARTITIONS = 4
_SETTINGS = StreamSettings(bootstrap="memory:0", telemetry_topics=("t",), partials_topic="p", decisions_topic="d",
                           deadletter_topic="dl", app_id="sw", telemetry_partitions=PARTITIONS,
                           partials_partitions=PARTITIONS, checkpoint_seconds=5.0, policy=Policy())


@pytest.fixture(scope="module")
def scenario():
    sim = Simulator("kv_pressure", seed=11, workers=3, minutes=1.0, incident_at=30.0)
    records = list(sim.records())
    cutoff = sim.end_ts - 5.0
    # OTLP chunks keyed by worker, as the OTel Kafka exporter writes them
    chunks = [(source.encode(), chunk) for source, _, chunk in exporter_batches(records)]
    return chunks, cutoff, embedded_decisions(records, cutoff)


class Rig:
    """Topics in memory, a hand-driven clock, and the runners of one worker that owns every partition."""

    def __init__(self, chunks: list[tuple[bytes, bytes]]) -> None:
        self.kafka = MemoryKafka({"t": PARTITIONS, "p": PARTITIONS, "dl": PARTITIONS, "d": 1,
                                  "sw.stage1-checkpoints": PARTITIONS, "sw.stage2-checkpoints": PARTITIONS})
        for key, value in chunks:
            self.kafka.append("t", value, key=key)
        self.now = 0.0
        self.acknowledged: list[tuple[str, int, int]] = []
        self.assigned = {(topic, p) for topic in ("t", "p") for p in range(PARTITIONS)}
        self._loop = asyncio.new_event_loop()  # one loop: sends' futures are awaited at the next checkpoint

    def run(self, coroutine):
        return self._loop.run_until_complete(coroutine)

    def runner(self, kind: type, settings: StreamSettings = _SETTINGS) -> Stage1Runner | Stage2Runner:
        writer, reader = MemoryWriter(self.kafka), MemoryReader(self.kafka)
        options = {"keyring": Keyring()} if kind is Stage2Runner else {}
        return kind(settings, writer, reader, CheckpointLog(settings.checkpoint_topic(kind.stage), writer, reader),
                    assignment=lambda: self.assigned, clock=lambda: self.now,
                    acknowledge=lambda m: self.acknowledged.append((m.topic, m.partition, m.offset)), **options)

    @property
    def busiest(self) -> int:
        return max(range(PARTITIONS), key=lambda p: len(self.kafka.records("t", p)))

    def deliver(self, runner, topic: str, partition: int, start: int = 0, tick: float = 1.0, fetch: int = 1,
                end: float = math.inf) -> None:
        """Hand the runner every message of a partition from ``start`` (to before ``end``), as the consumer
        would: ``fetch`` messages at a time, one clock tick apart."""
        records = [record for record in self.kafka.records(topic, partition) if start <= record.offset < end]
        for i in range(0, len(records), fetch):
            self.now += tick
            self.run(runner.handle(records[i:i + fetch]))

    def deliver_all(self, runner, fetch: int = 1, but: int | None = None) -> None:
        """`deliver` every telemetry partition (but one)."""
        for p in range(PARTITIONS):
            if p != but:
                self.deliver(runner, "t", p, fetch=fetch)

    def partials(self) -> set[tuple[int, str]]:
        """Every slice batch with content sent to stage 2, with its partition, however the batches were
        grouped into messages (the empty ones only carry a watermark, and a fetch sends one at its end)."""
        return {(record.partition, json.dumps(batch.to_dict(), sort_keys=True))
                for record in self.kafka.topic_records("p") for batch in decode_partial(record.value).batches
                if batch.partials or batch.events or batch.late_records}

    def catch_up(self, runner) -> None:
        self.run(runner.catch_up())  # assigned now; overdue 3 s later
        self.now += 3.0
        self.run(runner.catch_up())

    def decide(self, stage1: Stage1Runner, settings: StreamSettings = _SETTINGS) -> list[Decision]:
        """Every telemetry partition goes idle (the empty ones caught up first) and releases itself;
        stage 2 then catches up on every partials partition and decides."""
        self.catch_up(stage1)
        self.now += settings.source_silence_seconds
        self.run(stage1.release_idle_sources())
        self.catch_up(self.runner(Stage2Runner, settings))
        decisions = [decode_decision(r.value) for r in self.kafka.topic_records("d") if not is_heartbeat_key(r.key)]
        assert len({d.id for d in decisions}) == len(decisions), "a decision was published twice"
        return decisions


def _straight(chunks, fetch: int = 1, settings: StreamSettings = _SETTINGS) -> tuple[Rig, Stage1Runner]:
    rig = Rig(chunks)
    stage1 = rig.runner(Stage1Runner, settings)
    rig.deliver_all(stage1, fetch=fetch)
    return rig, stage1


@pytest.fixture(scope="module")
def straight(scenario):
    """The partials stage 1 sends when nothing goes wrong."""
    return _straight(scenario[0])[0].partials()


@pytest.fixture
def rig(scenario):
    return Rig(scenario[0])


def _assert_decides_as_embedded(rig: Rig, stage1: Stage1Runner, scenario,
                                settings: StreamSettings = _SETTINGS) -> list[Decision]:
    _, cutoff, expected = scenario
    decisions = rig.decide(stage1, settings)
    assert sorted(decision_key(d) for d in decisions if d.ts < cutoff) == expected
    return decisions


def test_runners_on_the_twin_decide_as_embedded(scenario):
    """Catch-up reads every partials partition, silent telemetry partitions are released: embedded's decisions."""
    rig, stage1 = _straight(scenario[0])
    silent = [p for p in range(PARTITIONS) if not rig.kafka.records("t", p)]
    assert silent, "the scenario leaves no telemetry partition empty: the release path would go untested"
    _assert_decides_as_embedded(rig, stage1, scenario)


def test_whole_fetches_send_fewer_partials_messages_with_the_same_batches_and_decisions(scenario, straight):
    """The runner folds a fetch at once and sends one partials message per stage-2 partition for it."""
    one_by_one, _ = _straight(scenario[0])
    rig, stage1 = _straight(scenario[0], fetch=8)
    assert rig.partials() == straight
    messages, singly = len(rig.kafka.topic_records("p")), len(one_by_one.kafka.topic_records("p"))
    assert stage1.partials_sent == messages < singly / 2
    _assert_decides_as_embedded(rig, stage1, scenario)


def test_slices_sent_as_they_close_are_the_same_batches_in_more_messages_with_the_same_decisions(scenario, straight):
    """With ``partials_after_seconds=0`` stage 1 sends after every message that closed a slice, not
    once per fetch: the batches and their order per stage-2 partition are the same, so are the decisions."""
    at_fetch_end, _ = _straight(scenario[0], fetch=8)
    eager = replace(_SETTINGS, partials_after_seconds=0.0)
    rig, stage1 = _straight(scenario[0], fetch=8, settings=eager)
    assert rig.partials() == straight
    assert len(rig.kafka.topic_records("p")) > 2 * len(at_fetch_end.kafka.topic_records("p"))
    for partition in range(PARTITIONS):  # per source, the slices go to each partition in close order
        for source in {b.source for r in rig.kafka.records("p", partition) for b in decode_partial(r.value).batches}:
            sent = [b.slice_index for r in rig.kafka.records("p", partition)
                    for b in decode_partial(r.value).batches if b.source == source]
            assert sent == sorted(sent) and len(set(sent)) == len(sent)
    _assert_decides_as_embedded(rig, stage1, scenario, eager)


def test_the_decision_trace_writes_each_decision_with_its_path_in_order(scenario, tmp_path):
    """Stage 1 stamps its partials; stage 2 writes one line per published decision, its times in path order."""
    traced = replace(_SETTINGS, decision_trace=str(tmp_path / "trace.jsonl"))
    rig = Rig(scenario[0])
    stage1 = rig.runner(Stage1Runner, traced)
    # the partitions without telemetry go idle first, so that the data's partials finalize slices
    everything, rig.assigned = rig.assigned, {("t", p) for p in range(PARTITIONS) if not rig.kafka.records("t", p)}
    rig.catch_up(stage1)
    rig.now += traced.source_silence_seconds
    rig.run(stage1.release_idle_sources())
    rig.assigned = everything
    released = {(r.partition, r.offset) for r in rig.kafka.topic_records("p")}
    rig.deliver_all(stage1, fetch=8)
    # every message sent for a fetch is stamped (what a release of an idle source sends is not)
    sent = [r for r in rig.kafka.topic_records("p") if (r.partition, r.offset) not in released]
    assert sent and all("specwatch-trace" in dict(r.headers) for r in sent)
    decisions = _assert_decides_as_embedded(rig, stage1, scenario, traced)
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [(line["id"], line["ts"]) for line in lines] == [(d.id, d.ts) for d in decisions] and lines
    order = ("telemetry_produced", "fetch_taken", "slice_closed", "partials_sent", "stage2_received", "decided",
             "checkpointed", "published")
    stamped = [line for line in lines if line["telemetry_produced"] is not None]
    assert stamped, "no decision came from a stamped partials message"
    for line in lines:
        # a decision a release of an idle source let through has stage 2's times only
        times = [line[name] for name in (order if line in stamped else order[4:])]
        assert None not in times and times == sorted(times), line
        assert line["merge_s"] >= 0 and line["decide_s"] > 0
        assert line["checkpointed"] == line["decided"]  # published first, checkpointed on the schedule


def test_a_fetch_of_a_whole_partition_is_split_below_the_message_limit(scenario, straight):
    rig, stage1 = _straight(scenario[0], fetch=10_000)
    sizes = [len(record.value) for record in rig.kafka.topic_records("p")]
    assert max(sizes) <= 512 * 1024 < sum(sizes) / PARTITIONS  # one message would not have fitted
    assert rig.partials() == straight
    _assert_decides_as_embedded(rig, stage1, scenario)


def test_a_restarted_stage1_skips_what_its_checkpoint_covers(scenario, rig, straight):
    busiest = rig.busiest
    first = rig.runner(Stage1Runner)
    rig.deliver(first, "t", busiest)
    saved = rig.run(first._checkpoints.load(first.task_name(("t", busiest)), busiest))
    # one tick a message, a checkpoint every 5 s of clock: the last one covers all but the tail
    total = len(rig.kafka.records("t", busiest))
    assert saved.next_offset == total - total % 5
    restarted = rig.runner(Stage1Runner)  # the worker died; the group redelivers from its committed offset 0
    rig.deliver_all(restarted)
    assert restarted.skipped == saved.next_offset
    assert rig.partials() == straight
    _assert_decides_as_embedded(rig, restarted, scenario)


def test_what_the_consumer_skipped_is_read_from_the_log(rig, straight):
    busiest = rig.busiest
    first = rig.runner(Stage1Runner)
    rig.deliver(first, "t", busiest, end=12)
    restarted = rig.runner(Stage1Runner)
    rig.deliver(restarted, "t", busiest, start=17)  # the group committed up to 17 without delivering 10..16
    assert rig.acknowledged == [("t", busiest, offset) for offset in range(10, 17)]
    assert restarted.skipped == 0
    rig.deliver_all(restarted, but=busiest)
    assert rig.partials() == straight


def test_a_partition_that_delivers_nothing_is_caught_up_after_a_while(rig, straight):
    runner = rig.runner(Stage1Runner)
    rig.assigned = {("t", p) for p in range(PARTITIONS)} | {("other", 0)}
    rig.run(runner.catch_up())
    assert runner._tasks == {}  # just assigned: the consumer may still deliver
    rig.now += 3.0
    rig.run(runner.catch_up())
    assert sorted(runner._tasks) == [("t", p) for p in range(PARTITIONS)]
    for p in range(PARTITIONS):
        end = len(rig.kafka.records("t", p))
        assert runner._tasks[("t", p)].next_offset == end
        if end:  # read to its end and checkpointed there
            saved = rig.run(runner._checkpoints.load(runner.task_name(("t", p)), p))
            assert saved.next_offset == end
    assert rig.partials() == straight


def test_a_revoked_partition_is_rebuilt_from_its_checkpoint_not_from_memory(rig, straight):
    busiest = rig.busiest
    runner = rig.runner(Stage1Runner)
    rig.deliver(runner, "t", busiest, end=8)  # checkpointed at the 5th message (offset 4), so it resumes at 5
    runner.forget([("p", busiest), ("t", busiest)])
    assert ("t", busiest) not in runner._tasks
    rig.deliver(runner, "t", busiest, start=8)
    assert rig.acknowledged == [("t", busiest, offset) for offset in (5, 6, 7)]
    rig.deliver_all(runner, but=busiest)
    assert rig.partials() == straight


def test_messages_gone_to_retention_are_skipped_with_a_warning(rig, caplog):
    busiest = rig.busiest
    runner = rig.runner(Stage1Runner)
    rig.run(runner.handle([rig.kafka.records("t", busiest)[0]]))
    rig.kafka.expire("t", busiest, 4)
    rig.deliver(runner, "t", busiest, start=6)
    assert rig.acknowledged == [("t", busiest, 4), ("t", busiest, 5)]
    assert "offsets 1..3 are gone from the log" in caplog.text


class SliceCounts:
    """The counts of every key's final slices, as the operations view of a stage-2 runner is fed them."""

    def __init__(self) -> None:
        self.view = self
        self.rows: list[tuple] = []
        self.late = 0

    def observe(self, output, now: float | None = None) -> None:
        self.rows += [row[:4] + (row.steps, row.plain_entries, tuple(row.accepted_at_least),
                                 tuple(row.drafted_at_least)) for row in output.windows]
        self.late += output.late_records

    def published(self, decisions) -> None:
        pass


def test_a_worker_that_goes_idle_is_decided_as_embedded_to_the_very_end():
    """Live: telemetry arrives as the clock runs, one engine worker (alone on its partition) stops
    halfway. Its partition goes idle: it closes its open slices and releases itself, and so do
    the others at the end. Every decision, to the end and byte for byte, is the embedded pipeline's."""
    sim = Simulator("kv_pressure", seed=11, workers=3, minutes=1.0, incident_at=30.0)
    quitter, stop = "w2", sim.start_ts + 25.0
    records = [r for r in sim.records() if getattr(r, "worker", None) != quitter or r.ts < stop]
    embedded_slices = SliceCounts()
    embedded = replayed(records, sinks=[embedded_slices.observe])

    rig = Rig([])
    stage1, stage2 = rig.runner(Stage1Runner), rig.runner(Stage2Runner)
    stage2.operations = twin_slices = SliceCounts()
    read = {p: 0 for p in range(PARTITIONS)}

    def decide_what_came():
        for p in range(PARTITIONS):
            rig.deliver(stage2, "p", p, start=read[p], tick=0.0)
            read[p] = len(rig.kafka.records("p", p))

    for source, first_ts, chunk in exporter_batches(records):
        rig.now = first_ts - sim.start_ts  # live: the clock runs with event time
        # the quitter alone on the last partition, the others over the rest
        partition = PARTITIONS - 1 if source == quitter else zlib.crc32(source.encode()) % (PARTITIONS - 1)
        message = rig.kafka.append("t", chunk, key=source.encode(), partition=partition)
        rig.run(stage1.handle([message]))
        rig.run(stage1.catch_up())
        rig.run(stage1.release_idle_sources())
        decide_what_came()
    rig.now += _SETTINGS.source_silence_seconds
    rig.run(stage1.release_idle_sources())
    decide_what_came()
    decided = [decode_decision(r.value) for r in rig.kafka.topic_records("d") if not is_heartbeat_key(r.key)]
    assert any(d.ts > stop for d in embedded.decisions)
    assert twin_slices.late == embedded_slices.late == 0
    assert Counter(twin_slices.rows) == Counter(embedded_slices.rows)  # every slice, the quitter's last ones too
    assert sorted(d.to_json_line() for d in decided) == sorted(d.to_json_line() for d in embedded.decisions)


def test_a_partition_with_data_waiting_is_never_idle(rig):
    """Silent far past the silence, but with messages left to read: no release until they are folded."""
    busiest = rig.busiest
    runner = rig.runner(Stage1Runner)
    rig.run(runner.handle(rig.kafka.records("t", busiest)[:3]))
    rig.now += 10 * _SETTINGS.source_silence_seconds
    rig.run(runner.release_idle_sources())

    def releases() -> list[tuple[int, str]]:
        return [(r.partition, decode_partial(r.value).release_source) for r in rig.kafka.topic_records("p")
                if decode_partial(r.value).release_source is not None]

    assert releases() == []
    rig.deliver(runner, "t", busiest, start=3)
    rig.now += _SETTINGS.source_silence_seconds
    rig.run(runner.release_idle_sources())
    assert releases() == [(p, f"t/{busiest}") for p in range(PARTITIONS)]
    assert runner._tasks[("t", busiest)].stage.close_ready(final=True) == []  # all closed and sent before it


@pytest.mark.parametrize("damage, reason", [("garbage", "not_a_checkpoint"), ("flipped_byte", "undecodable"),
                                            ("next_version", "unsupported_version")])
def test_a_refused_stage2_checkpoint_republishes_no_decision(scenario, rig, damage, reason):
    """Stage 2 decided and checkpointed; at its restart every checkpoint is refused, so each task
    rebuilds from the start of its partials partition and decides it all again: the decisions
    topic still holds each decision once."""
    stage1 = rig.runner(Stage1Runner)
    rig.deliver_all(stage1)
    first = rig.decide(stage1)
    assert first  # the scenario decides: there is something to republish
    stage2 = rig.runner(Stage2Runner)
    saved = {}
    for p in range(PARTITIONS):
        name = stage2.task_name(("p", p))
        found = read_checkpoint(name, {r.key.decode(): r.value for r in rig.kafka.records("sw.stage2-checkpoints", p)
                                       if r.key is not None}.get)
        if found is not None:
            saved[p] = found
    assert saved  # what the restart refuses
    for p, (sequence, data) in saved.items():
        name = stage2.task_name(("p", p))
        bad = {"garbage": b"not a checkpoint", "flipped_byte": data[:40] + bytes([data[40] ^ 1]) + data[41:],
               "next_version": pack_checkpoint(Checkpoint(CHECKPOINT_VERSION + 1, "stage2", name, {}, {}))}[damage]
        for key, value in checkpoint_entries(name, sequence + 1, bad):
            rig.kafka.append("sw.stage2-checkpoints", value, key=key.encode(), partition=p)

    restarted = rig.runner(Stage2Runner)
    rig.catch_up(restarted)
    assert restarted.checkpoints.refused == Counter({reason: len(saved)})
    assert sorted(restarted._tasks) == [("p", p) for p in range(PARTITIONS)]  # rebuilt, every one
    after = [decode_decision(r.value) for r in rig.kafka.topic_records("d") if not is_heartbeat_key(r.key)]
    assert sorted(d.id for d in after) == sorted(d.id for d in first)  # each once, none lost
