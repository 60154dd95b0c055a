"""`specwatch bench`: throughput, latency and cost figures, each beside an alternative measured in
the same run: on a shared machine the ratios are what carry over."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import tracemalloc
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from specwatch.lab.bench import SECTIONS, alternated, timed
from specwatch.lab.bench.archive_path import run_archive_bench
from specwatch.lab.bench.broker import OwnBroker
from specwatch.lab.bench.engine import run_engine_bench
from specwatch.lab.bench.export_cpu import run_export_bench
from specwatch.lab.bench.gateway_latency import run_gateway_bench
from specwatch.lab.bench.key_cost import (bench_keys, closed_batches, fed_pipeline, line_blocks,
                                  stage2_outputs, step_lines)
from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Policy, RoundEntry, StepRecord
from specwatch.schemas.codec import encode_record
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.schemas.native_walks import DECODERS
from specwatch.schemas.otlp import decode_request, encode_records
from specwatch.schemas.otlp_block import request_block
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.intake import NATIVE_ADMISSION, EventClock

__all__ = ["run_bench", "judge_targets", "plot_report", "keys_picture", "NaiveRoundPipeline", "TARGETS", "SECTIONS"]

_SEED = 17
_OTLP_RECORDS_PER_MESSAGE = 200
_PACED_SHARE_OF_CAPACITY = 0.8  # where the decision latency target is set
TARGETS = {
    "stream_rounds_per_core_s_at_16": 1_000_000,
    "kafka_rounds_per_s": 200_000,  # 2 workers on this 2-core machine
    "kafka_decision_latency_p99_s": 3.0,  # paced at 80 % of the 2-worker capacity
    "collector_us_per_step": 20.0,
    "engine_on_over_off": 1.02,
    "sdk_over_direct": 3.0,
    "capture_share_of_collector": 0.05,
    "state_bytes_per_key": 64 * 1024,
    "us_per_key_slice": 10.0,
    # "a key with no traffic costs nothing": stage 2 knowing 10,000 idle keys within the
    # run-to-run spread of the same run without them (0.91-1.04x in earlier runs)
    "idle_keys_over_none": 1.10,
    "archive_rows_per_s": 1_000_000,
    "replay_over_json_loads": 1.0,
    "startup_s": 0.5,
    # what a client waits for more through `specwatch gateway` than calling the server directly
    "gateway_over_direct": 1.10,
}


# ------------------------------------------------------------------ the per-round alternative


class RoundRecord(BaseModel):
    """One speculative round as its own record: the per-round design the step record replaces."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    kind: str
    v: int
    ts: float = Field(ge=0, allow_inf_nan=False)
    worker: str = Field(min_length=1, max_length=256)
    seq: int = Field(ge=0)
    bundle_id: str = Field(min_length=1, max_length=256)
    id: str = Field(min_length=1, max_length=256)
    bucket: str = Field(min_length=1, max_length=256)
    cohort: str = Field(min_length=1, max_length=256)
    drafted: int = Field(ge=0, le=64)
    accepted: int = Field(ge=0, le=64)
    draft_ms: float = Field(ge=0)
    verify_ms: float = Field(ge=0)
    kv_usage: float = Field(ge=0, le=1)


def per_round_lines(step: StepRecord) -> list[bytes]:
    """A step as one JSON line per round (the step's timings repeated on each)."""
    head = {"kind": "round", "v": 1, "ts": step.ts, "worker": step.worker, "seq": step.seq,
            "bundle_id": step.bundle_id, "draft_ms": step.draft_ms, "verify_ms": step.verify_ms,
            "kv_usage": step.kv_usage}
    return [json.dumps({**head, "id": e.id, "bucket": e.bucket, "cohort": e.cohort, "drafted": e.drafted,
                        "accepted": e.accepted}).encode() for e in step.requests]


def per_round_otlp(rounds: list[dict]) -> bytes:
    """One OTel log record per round, in one ExportLogsServiceRequest."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    request = ExportLogsServiceRequest()
    scope = request.resource_logs.add().scope_logs.add()
    for body in rounds:
        record = scope.log_records.add()
        record.event_name = "specwatch.round"
        record.time_unix_nano = int(body["ts"] * 1e9)
        for key, value in body.items():
            attribute = record.attributes.add()
            attribute.key = "specwatch." + key
            if isinstance(value, str):
                attribute.value.string_value = value
            elif isinstance(value, int):
                attribute.value.int_value = value
            else:
                attribute.value.double_value = value
    return request.SerializeToString()


class NaiveRoundPipeline(EmbeddedPipeline):
    """The straightforward processor: one record per round, each decoded and validated on its own,
    gathered back into its step for the same folds and stage 2 (other kinds: the reference path)."""

    def __init__(self, policy: Policy | None = None) -> None:
        super().__init__(policy)
        self._rounds: list[RoundRecord] = []

    def feed_round(self, body: dict) -> list:
        round_ = RoundRecord.model_validate(body)
        decided = []
        if self._rounds and (self._rounds[0].worker, self._rounds[0].seq) != (round_.worker, round_.seq):
            decided = self._fold_step()
        self._rounds.append(round_)
        return decided

    def _fold_step(self) -> list:
        """The rounds gathered so far, folded as their step (already validated, round by round)."""
        rounds, self._rounds = self._rounds, []
        if not rounds:
            return []
        first = rounds[0]
        requests = [RoundEntry.model_construct(id=r.id, bucket=r.bucket, cohort=r.cohort, drafted=r.drafted,
                                               accepted=r.accepted) for r in rounds]
        return self.feed(StepRecord.model_construct(
            kind="step", v=1, ts=first.ts, worker=first.worker, seq=first.seq, bundle_id=first.bundle_id,
            draft_ms=first.draft_ms, verify_ms=first.verify_ms, kv_usage=first.kv_usage, requests=requests))

    def feed_round_line(self, line: bytes) -> list:
        body = json.loads(line)
        if body.get("kind") == "round":
            return self.feed_round(body)
        return self._fold_step() + self.feed_line(line)

    def feed_round_otlp(self, payload: bytes) -> list:
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

        decided = []
        for resource_logs in ExportLogsServiceRequest.FromString(payload).resource_logs:
            for scope_logs in resource_logs.scope_logs:
                for record in scope_logs.log_records:
                    decided += self.feed_round({
                        pair.key[10:]: getattr(pair.value, pair.value.WhichOneof("value"))
                        for pair in record.attributes})
        return decided + self._fold_step()

    def finish(self) -> list:
        return self._fold_step() + super().finish()


# ------------------------------------------------------------------ inputs


def _records(requests_per_step: int, minutes: float, workers: int = 4) -> list:
    return list(Simulator("healthy", seed=_SEED, minutes=minutes, workers=workers,
                          concurrency=requests_per_step).records())


# ------------------------------------------------------------------ sections


def bench_stream(quick: bool, smoke: bool) -> list[dict]:
    """Decode + stage 1 + stage 2 + detectors, per CPU second (one process = one core)."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    rows = []
    minutes = 0.05 if smoke else (0.25 if quick else 1.0)
    for rps in (8, 16, 64):
        records = _records(rps, minutes)
        steps = [r for r in records if r.kind == "step"]
        rounds = sum(len(s.requests) for s in steps)
        lines = [encode_record(r).encode() for r in records]
        chunks = [records[i:i + _OTLP_RECORDS_PER_MESSAGE] for i in range(0, len(records), _OTLP_RECORDS_PER_MESSAGE)]
        otlp = [encode_records(chunk) for chunk in chunks]
        naive_lines, naive_otlp = [], []
        for chunk in chunks:
            bodies = []
            for record in chunk:
                if record.kind == "step":
                    per_round = per_round_lines(record)
                    naive_lines += per_round
                    bodies += [json.loads(b) for b in per_round]
                else:
                    naive_lines.append(encode_record(record).encode())
            naive_otlp.append((per_round_otlp(bodies), encode_records([r for r in chunk if r.kind != "step"])))
        blocks = line_blocks(lines)
        for encoding in ("jsonl", "otlp"):
            jsonl = encoding == "jsonl"
            # the batch mode's decoder alone (what of the columnar path is decoding), and the
            # floor: a plain parse of every payload into plain objects, and nothing else
            decode_only = (decode_lines_block, blocks) if jsonl else (request_block, otlp)
            parse_floor = ((msgspec.json.Decoder().decode, lines) if jsonl
                           else (ExportLogsServiceRequest.FromString, otlp))

            def pipeline(columnar: bool, native: bool = True, admission: bool = True) -> list[str]:
                # the batch mode, or the per-record reference path: one record at a time through the pydantic
                # codecs; ``native=False``: the batch mode without the compiled step walks and admission,
                # ``admission=False``: without the compiled admission (stage 1's clock and step loop) only
                p = EmbeddedPipeline()
                if not (native and admission):
                    p.stage1.clock = EventClock(p.policy.windows.max_ahead_seconds)
                if jsonl:
                    fed_pipeline(lines, columnar, native, p)
                else:
                    for payload in otlp:
                        if columnar:
                            p.feed_block(request_block(payload, native))
                        else:
                            p.feed_many(decode_request(payload))
                return [d.to_json_line() for d in p.decisions + p.finish()]

            def naive():
                p = NaiveRoundPipeline()
                if jsonl:
                    for line in naive_lines:
                        p.feed_round_line(line)
                else:
                    for rounds_payload, others in naive_otlp:
                        p.feed_round_otlp(rounds_payload)
                        for item in decode_request(others):
                            p.feed(item)
                p.finish()

            # where the compiled step walk ran, the batch mode without it alternates too
            compiled = DECODERS[encoding] == "native"
            candidates = {"columnar": lambda: timed(lambda: pipeline(columnar=True)),
                          "floor": lambda: timed(lambda: deque(map(*parse_floor), maxlen=0)),
                          "decode": lambda: timed(lambda: deque(map(*decode_only), maxlen=0))}
            if compiled:
                candidates["columnar_without_native"] = lambda: timed(lambda: pipeline(columnar=True, native=False))
            if NATIVE_ADMISSION:
                candidates["columnar_without_native_admission"] = lambda: timed(
                    lambda: pipeline(columnar=True, admission=False))
            runs = alternated(candidates, 1 if smoke else 3)
            t_columnar, t_floor, t_decode = (min(t for t, _ in runs[name])
                                             for name in ("columnar", "floor", "decode"))
            columnar_out = runs["columnar"][0][1]
            t_ref, ref_out = timed(lambda: pipeline(columnar=False))
            t_naive, _ = timed(naive)
            rows.append({
                "encoding": encoding, "requests_per_step": round(rounds / max(1, len(steps)), 1),
                "concurrency": rps, "rounds": rounds, "steps": len(steps),
                "columnar_rounds_per_s": rounds / t_columnar, "reference_rounds_per_s": rounds / t_ref,
                "naive_rounds_per_s": rounds / t_naive, "parse_floor_rounds_per_s": rounds / t_floor,
                "columnar_share_of_parse_floor": t_floor / t_columnar,
                "columnar_decode_rounds_per_s": rounds / t_decode, "columnar_decode_share": t_decode / t_columnar,
                "columnar_decode_share_of_parse_floor": t_floor / t_decode,
                "speedup_vs_naive": t_naive / t_columnar, "speedup_vs_reference": t_ref / t_columnar,
                "same_decisions_as_reference": ref_out == columnar_out,
                "decoder": "native" if compiled else "reference",
                "admission": "native" if NATIVE_ADMISSION else "reference",
            })
            if NATIVE_ADMISSION:
                t_without = min(t for t, _ in runs["columnar_without_native_admission"])
                rows[-1].update({"columnar_without_native_admission_rounds_per_s": rounds / t_without,
                                 "native_admission_over_reference": t_without / t_columnar,
                                 "native_admission_same_decisions":
                                     runs["columnar_without_native_admission"][0][1] == columnar_out})
            if compiled:
                t_without = min(t for t, _ in runs["columnar_without_native"])
                rows[-1].update({"columnar_without_native_rounds_per_s": rounds / t_without,
                                 "native_over_reference": t_without / t_columnar,
                                 "native_same_decisions": runs["columnar_without_native"][0][1] == columnar_out})
    return rows


def bench_collector(quick: bool, smoke: bool) -> dict:
    """Engine-thread time of one `emit(step)` (direct and SDK paths) against the step's own time,
    the SDK's own floor (``Logger.emit`` of ready-made attributes) split off."""
    from opentelemetry.attributes import BoundedAttributes
    from opentelemetry.sdk._logs import LoggerProvider, LogRecordProcessor

    from specwatch.collectors.export import InMemoryExporter
    from specwatch.collectors.otel import TelemetryEmitter
    from specwatch.schemas.otlp import encode_entries, log_entry

    steps = [r for r in _records(16, 0.05 if smoke else 0.2) if r.kind == "step"]

    def us_per_step(fn) -> float:
        return timed(fn, clock=time.thread_time)[0] / len(steps) * 1e6

    out: dict[str, Any] = {"steps": len(steps), "requests_per_step": sum(len(s.requests) for s in steps) / len(steps)}
    for name, sdk in (("direct", False), ("sdk", True)):
        # nothing is exported while the emit loop is timed: the export thread would compete
        # for the interpreter, and it does different work on the two paths
        emitter = TelemetryEmitter(InMemoryExporter(), sdk=sdk, max_queue_size=len(steps) + 10,
                                   max_batch_size=len(steps) + 10, schedule_delay_millis=3_600_000)
        out[f"{name}_us_per_step"] = us_per_step(lambda: [emitter.emit(step) for step in steps])
        emitter.shutdown()

    class _Nothing(LogRecordProcessor):
        def on_emit(self, log_record) -> None:
            pass

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            return True

    provider = LoggerProvider(shutdown_on_exit=False)
    provider.add_log_record_processor(_Nothing())
    logger = provider.get_logger("specwatch", "1")
    entries = [log_entry(step) for step in steps]

    def emit(entry, **fields) -> None:
        logger.emit(timestamp=entry.time_unix_nano, observed_timestamp=entry.time_unix_nano,
                    event_name=entry.event_name, **fields)

    def clean(attributes) -> None:
        BoundedAttributes(attributes=attributes, immutable=False)

    # Beside the floor, what would move the SDK path: a record with no attributes at all (the
    # least any SDK emit costs), and one whose body is the record encoded on the calling thread.
    for name, fn in (("attributes", lambda: [log_entry(step) for step in steps]),
                     ("floor", lambda: [emit(e, attributes=e.attributes) for e in entries]),
                     ("attribute_cleaning", lambda: [clean(e.attributes) for e in entries]),
                     ("minimal_record", lambda: [emit(entry) for entry in entries]),
                     ("preencoded_body", lambda: [emit(entry, body=encode_entries([entry]))
                                                  for entry in map(log_entry, steps)])):
        out[f"sdk_{name}_us_per_step"] = us_per_step(fn)
    provider.shutdown()
    direct = out["direct_us_per_step"]
    for name in ("minimal_record", "preencoded_body", "floor"):
        out[f"sdk_{name}_over_direct"] = out[f"sdk_{name}_us_per_step"] / direct
    out["sdk_ours_us_per_step"] = out["sdk_us_per_step"] - out["sdk_floor_us_per_step"]
    engine_ms = sum(s.draft_ms + s.verify_ms for s in steps) / len(steps)
    out["engine_step_ms_simulated"] = engine_ms
    out["direct_share_of_step"] = direct / (engine_ms * 1e3)
    out["sdk_share_of_step"] = out["sdk_us_per_step"] / (engine_ms * 1e3)
    out["sdk_over_direct"] = out["sdk_us_per_step"] / direct
    return out


def bench_export(bootstrap: str | None, quick: bool, smoke: bool) -> dict:
    """Export-thread CPU per step record: OTLP/HTTP through OpenTelemetry's exporter against the direct Kafka path."""
    steps = [r for r in _records(16, 0.05 if smoke else (0.2 if quick else 0.5)) if r.kind == "step"]
    return run_export_bench(steps, bootstrap)


def bench_archive(quick: bool, smoke: bool) -> dict:
    """Window-stats rows/s into chDB: the sink beside the row path it replaced, the writer
    alone, each insert transport and one INSERT per row (`specwatch.lab.bench.archive_path`)."""
    pipeline = EmbeddedPipeline()
    template: list = []
    pipeline.sinks.append(lambda out: template.append(out.windows))
    for record in _records(16, 0.2, workers=2):
        pipeline.feed(record)
    pipeline.finish()
    return run_archive_bench(template, 20_000 if smoke else (100_000 if quick else 500_000), 50 if smoke else 200,
                             pairs=1 if smoke else 3)


def _installed_command_env(workdir: Path) -> dict:
    """The environment to time a `specwatch` command in as an installed one runs: bytecode
    compiled once and cached. A shell with PYTHONDONTWRITEBYTECODE set would otherwise time the
    compiling of every module (0.15-0.3 s here); the cache goes to a folder of the bench's own,
    not the source tree."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(workdir / "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def bench_replay(quick: bool, smoke: bool, workdir: Path) -> dict:
    """`specwatch replay` of a simulated contract-v1 file vs plain json.loads of its lines."""
    target_mb = 2 if smoke else (10 if quick else 70)
    path = workdir / "replay.jsonl"
    # ~50 MB per simulated minute with the default fleet (8 workers); the incident starts
    # early so that the replay has decisions to make
    minutes = max(0.2, target_mb / 50.0)
    cli = [sys.executable, "-m", "specwatch.cli"]
    subprocess.run(cli + ["simulate", "--scenario", "acceptance_drop", "--seed", str(_SEED), "--minutes",
                          f"{minutes:.2f}", "--incident-at", f"{minutes * 30:.1f}", "--output", str(path)],
                   check=True, capture_output=True)
    size = path.stat().st_size
    import resource

    env = _installed_command_env(workdir)
    first = workdir / "first-record.jsonl"
    with path.open("rb") as source:
        first.write_bytes(source.readline())
    subprocess.run(cli + ["replay", str(first), "--output", os.devnull], check=True, capture_output=True,
                   env=env)  # fills the bytecode cache

    def replay(native: str) -> tuple[float, float, dict, bytes]:
        """Wall and CPU seconds of one `specwatch replay`, its summary and decisions; SPECWATCH_NATIVE=``native``."""
        out = workdir / f"decisions-{native}.jsonl"
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(cli + ["replay", str(path), "--output", str(out), "--json"], check=True,
                              capture_output=True, text=True, env={**env, "SPECWATCH_NATIVE": native})
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
        return wall, cpu, json.loads(done.stdout.strip().splitlines()[-1]), out.read_bytes()

    def loads() -> tuple[float, float]:
        """Wall and CPU seconds of a plain json.loads loop over the file's lines, in this process."""
        gc.collect()
        with path.open("rb") as source:
            start, cpu_start = time.perf_counter(), time.process_time()
            deque(map(json.loads, source), maxlen=0)
            return time.perf_counter() - start, time.process_time() - cpu_start

    # with the compiled step walk, without it, and the json.loads loop, alternated (on, off,
    # loads, loads, off, on), the least wall time of each kept
    runs = alternated({"native": lambda: replay("1"), "reference": lambda: replay("0"), "json_loads": loads},
                      1 if smoke else 2)
    replay_s, replay_cpu_s, summary, decided = min(runs["native"], key=lambda run: run[0])
    without_s, without_cpu_s, _, decided_without = min(runs["reference"], key=lambda run: run[0])
    loads_s, loads_cpu_s = min(runs["json_loads"])
    return {"bytes": size, "lines": summary["lines"], "decisions": summary["decisions"], "decoder": DECODERS["jsonl"],
            "replay_s": replay_s, "replay_records_per_s": summary["lines"] / replay_s,
            "json_loads_s": loads_s, "json_loads_records_per_s": summary["lines"] / loads_s,
            "replay_over_json_loads": replay_s / loads_s,
            # CPU seconds: on a shared machine wall time also counts the wait for a core
            "replay_cpu_s": replay_cpu_s, "json_loads_cpu_s": loads_cpu_s,
            "replay_cpu_over_json_loads_cpu": replay_cpu_s / max(loads_cpu_s, 1e-9),
            "replay_cpu_s_per_70mb": replay_cpu_s * (70 << 20) / size,
            "replay_s_per_70mb": replay_s * (70 << 20) / size,
            # SPECWATCH_NATIVE=0: the same replay on the reference path
            "replay_s_without_native": without_s, "replay_cpu_s_without_native": without_cpu_s,
            "replay_without_native_over_json_loads": without_s / loads_s,
            "same_decisions_without_native": decided == decided_without,
            "bytecode": "cached",
            "pairs": {name: [list(run[:2]) for run in values] for name, values in runs.items()}}


def bench_startup(quick: bool, smoke: bool) -> dict:
    """Least wall seconds of `specwatch replay` of one record (the first bundle record of a
    simulated fleet) and of a bare interpreter (``python -c pass``), alternated."""
    repeats = 1 if smoke else (3 if quick else 5)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "one.jsonl"
        path.write_text(encode_record(_records(16, 0.05, workers=1)[0]) + "\n")
        replay = [sys.executable, "-m", "specwatch.cli", "replay", str(path), "--output",
                  str(Path(tmp) / "out.jsonl")]
        bare = [sys.executable, "-c", "pass"]
        env = _installed_command_env(Path(tmp))

        def wall(argv: list[str]) -> float:
            return timed(lambda: subprocess.run(argv, check=True, capture_output=True, env=env),
                         clock=time.perf_counter)[0]

        wall(replay)  # fills the bytecode cache
        runs = alternated({"replay": lambda: wall(replay), "bare": lambda: wall(bare)}, repeats)
    replay_s, bare_s = min(runs["replay"]), min(runs["bare"])
    return {"repeats": repeats, "replay_one_record_s": replay_s, "bare_interpreter_s": bare_s,
            "startup_over_bare_interpreter": replay_s / bare_s, "bytecode": "cached"}


def _growth_lines(keys: int, slices: int, requests_per_step: int = 16) -> tuple[list[bytes], int]:
    """Steps of ``requests_per_step`` over ``keys`` keys, at least 20 steps a slice."""
    return step_lines(keys, slices, requests_per_step * max(20, -(-keys // requests_per_step)), requests_per_step)


def bench_growth(quick: bool, smoke: bool) -> list[dict]:
    """Throughput and retained state as (bundle, bucket, cohort) keys grow."""
    out = []
    sizes = (1, 10, 100) if smoke else ((1, 10, 100, 1_000) if quick else (1, 10, 100, 1_000, 10_000))
    slices = 6 if smoke else 12
    for keys in sizes:
        lines, rounds = _growth_lines(keys, slices)

        t_columnar, _ = timed(lambda: fed_pipeline(lines))
        t_ref, _ = timed(lambda: fed_pipeline(lines, columnar=False))
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        pipeline = fed_pipeline(lines)
        pipeline.stage1.close_ready(final=True)
        gc.collect()
        state = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        del pipeline
        out.append({"keys": keys, "rounds": rounds, "columnar_rounds_per_s": rounds / t_columnar,
                    "reference_rounds_per_s": rounds / t_ref, "speedup_vs_reference": t_ref / t_columnar,
                    "state_bytes": state, "state_bytes_per_key": state / keys})
    return out


def bench_metrics(quick: bool, smoke: bool) -> dict:
    """Stage 2 with the metrics view fed every final slice, beside stage 2 without it, on the same
    batches, alternated; a scrape timed on its own (docs/BENCHMARKS.md, "Metrics view")."""
    from specwatch.streams.metrics import ServiceHealth
    from specwatch.streams.operations import Operations, OperationsSettings
    from specwatch.streams.merge import Stage2
    from specwatch.streams.slice_batch import SliceBatch

    keys = 50 if smoke else (500 if quick else 1_000)
    slices = 6 if smoke else 20
    lines, rounds = _growth_lines(keys, slices)
    wire = [batch.to_dict() for batch in closed_batches(lines)]  # each run rebuilds fresh batches
    stages: list = []
    operations = Operations(OperationsSettings(web_port=None, max_metric_keys=keys * 2), ServiceHealth,
                            stages=lambda: stages[-1:])

    outputs: list = []

    def run(metrics: bool) -> float:
        batches = [SliceBatch.from_dict(b) for b in wire]
        stage = Stage2(Policy())
        stages.append(stage)
        observe = operations.view.observe
        outputs.clear()

        def go():
            for output in stage2_outputs(stage, batches):
                if metrics:
                    observe(output)
                outputs.append(output)
        return timed(go)[0]

    runs = alternated({"off": lambda: run(False), "on": lambda: run(True)}, 1 if smoke else 5)
    off, on = runs["off"], runs["on"]
    # the view's per-slice work by itself, over the same outputs: below the noise of whole runs
    fresh = Operations(OperationsSettings(web_port=None), ServiceHealth).view
    observe_s = min(timed(lambda: [fresh.observe(o) for o in outputs])[0] for _ in range(5))
    scrapes = [timed(operations.render) for _ in range(1 if smoke else 3)]
    scrape_s, text = min(scrapes, key=lambda item: item[0])
    return {"keys": keys, "slices": slices, "rounds": rounds, "batches": len(wire),
            "stage2_off_s": min(off), "stage2_on_s": min(on),
            "overhead_ratio": min(on) / min(off) - 1.0,
            "observe_s": observe_s, "observe_share_of_stage2": observe_s / min(off),
            "scrape_ms": scrape_s * 1000.0, "scrape_bytes": len(text),
            "scrape_core_share_at_15s": scrape_s / 15.0}


# The moves for decisions sooner at load, each paced beside the default (docs/BENCHMARKS.md):
# name -> (worker environment, policy file text or None).
_PACED_VARIANTS = {
    "default": ({}, None),
    "partials sent after 50 ms of folding": ({"SPECWATCH_SEND_PARTIALS_AFTER_MS": "50"}, None),
    "lateness 0.25 s": ({}, "[windows]\nlateness_seconds = 0.25\n"),
    "slices closed once every writer passed them in order": ({}, "[windows]\nclose_on_writers = true\n"),
    "checkpoint before each publish (the earlier order)": ({"SPECWATCH_CHECKPOINT_BEFORE_PUBLISH": "1"}, None),
}
# (workers, partitions) of the scale-out runs, flat out; 2 workers on 4 partitions is the capacity
_SCALING = ((1, 4), (2, 4), (4, 4), (2, 8), (4, 8))


def bench_kafka(bootstrap: str, quick: bool, smoke: bool) -> dict:
    from functools import partial

    from specwatch.lab.bench.kafka_clients import run_client_bench
    from specwatch.lab.bench.kafka_path import LATENCY_PARTS, run_kafka_bench

    run = partial(run_kafka_bench, bootstrap, seconds=20 if quick else 60, smoke=smoke)
    # Capacity first: 1, 2 and 4 workers, on 4 and on 8 partitions (on 2 cores, 4 workers
    # measure contention, not scaling), then two workers paced at 80 % of the 2-worker
    # capacity, where the latency target is set, each move beside the default, alternated.
    scaling = [run(workers=workers, partitions=partitions)
               for workers, partitions in (_SCALING[:2] if smoke else _SCALING)]
    one, two = scaling[0], scaling[1]
    rate = two["rounds_per_s"] * _PACED_SHARE_OF_CAPACITY
    with tempfile.TemporaryDirectory() as tmp:
        def paced(env: dict, policy_text: str | None, name: str):
            policy = None
            if policy_text is not None:
                policy = str(Path(tmp) / f"{len(name)}-{abs(hash(name))}.toml")
                Path(policy).write_text(policy_text)
            return lambda: run(workers=2, rate=rate, worker_env=env, policy=policy)

        variants = dict(list(_PACED_VARIANTS.items())[:1 if smoke else None])
        runs = alternated({name: paced(env, text, name) for name, (env, text) in variants.items()},
                          turns=1 if smoke else 2)
    moves = {name: {"evidence_latency_p99_s": [r["evidence_latency_p99_s"] for r in measured],
                    "evidence_latency_p50_s": [r["evidence_latency_p50_s"] for r in measured],
                    "lag_max": [r["lag_max"] for r in measured],
                    "same_decisions_as_embedded": [r["same_decisions_as_embedded"] for r in measured],
                    "median_parts_s": {part: [r["evidence_breakdown"].get("median_s", {}).get(part)
                                              for r in measured] for part in LATENCY_PARTS}}
             for name, measured in runs.items()}
    base = runs["default"]
    # the default's slower turn is the figure of record: the p99 is the largest of a handful of decisions
    paced_run = max(base, key=lambda r: r["evidence_latency_p99_s"] or 0.0)
    for name, measured in runs.items():
        moves[name]["p99_over_default"] = [(r["evidence_latency_p99_s"] or 0.0) / (d["evidence_latency_p99_s"] or 1.0)
                                           for r, d in zip(measured, base)]
    # a turn with no decision has no p99: it ranks last, it is not a fast turn
    best_move = min((name for name in moves if name != "default"), default=None,
                    key=lambda name: max((math.inf if p99 is None else p99)
                                         for p99 in moves[name]["evidence_latency_p99_s"]))
    return {"flat_out": one, "two_workers": two, "paced": paced_run, "paced_runs": runs, "moves": moves,
            "best_move": best_move,
            "scaling": [{"workers": r["workers"], "partitions": r["partitions"], "rounds_per_s": r["rounds_per_s"],
                         "rounds_per_worker_cpu_s": r["rounds_per_worker_cpu_s"], "worker_cpu_s": r["worker_cpu_s"],
                         "lag_max": r["lag_max"], "over_one_worker": r["rounds_per_s"] / one["rounds_per_s"],
                         "same_decisions_as_embedded": r["same_decisions_as_embedded"]} for r in scaling],
            "scaling_runs": scaling[2:],
            "clients": run_client_bench(bootstrap, smoke=smoke),
            "capacity_rounds_per_s": two["rounds_per_s"], "paced_share_of_capacity": _PACED_SHARE_OF_CAPACITY,
            "rounds_per_s": max(r["rounds_per_s"] for r in scaling),
            "two_over_one_worker": two["rounds_per_s"] / one["rounds_per_s"],
            "decision_latency_p99_s": paced_run["evidence_latency_p99_s"],
            "incident_to_decision_p99_s": paced_run["decision_latency_p99_s"]}


# Issue 16's targets (docs/BENCHMARKS.md): (target, section, goal, goal_is, goal_on, figures);
# ``figures(section)`` returns (measured, alternative's name, alternative's value, note).
def _stream_row(encoding: str):
    def figures(stream):
        row = next(r for r in stream if r["concurrency"] == 16 and r["encoding"] == encoding)
        return (row["columnar_rounds_per_s"], "per-record reference path", row["reference_rounds_per_s"],
                f"parse floor {row['parse_floor_rounds_per_s']:,.0f} rounds/s; "
                f"{row['requests_per_step']} requests/step; decoder {row.get('decoder', 'reference')}"
                + (f", {row['native_over_reference']:.2f}x the batch mode without it"
                   if "native_over_reference" in row else "")
                + f"; admission {row.get('admission', 'reference')}"
                + (f", {row['native_admission_over_reference']:.2f}x the batch mode without it"
                   if "native_admission_over_reference" in row else ""))
    return figures


def _engine_row(figure: str):
    def figures(engine):
        return (engine[f"step_ms_{figure}_on"], "collector off, alternating blocks",
                engine[f"step_ms_{figure}_off"], f"load {engine['load_average_before'][0]:.1f} "
                f"-> {engine['load_average_after'][0]:.1f}")
    return figures


def _clients(kafka, side: str, alternative: str):
    rows = kafka["clients"][side]
    return (rows["default"]["cpu_us_per_message"], alternative, rows[alternative]["cpu_us_per_message"],
            f"{kafka['clients']['records_per_message']} step records, "
            f"{kafka['clients']['bytes_per_message']:,.0f} bytes per message")


_TARGET_ROWS = (
    ("stream rounds/s per core at 16 requests/step (JSON Lines)", "stream",
     TARGETS["stream_rounds_per_core_s_at_16"], "min", "measured", _stream_row("jsonl")),
    ("stream rounds/s per core at 16 requests/step (OTLP)", "stream",
     TARGETS["stream_rounds_per_core_s_at_16"], "min", "measured", _stream_row("otlp")),
    ("Kafka end to end, rounds/s with 2 workers (capacity)", "kafka", TARGETS["kafka_rounds_per_s"], "min", "measured",
     lambda k: (k["two_workers"]["rounds_per_s"], "the same telemetry through the embedded pipeline",
                k["two_workers"]["embedded_fast_rounds_per_s"],
                f"1 worker: {k['flat_out']['rounds_per_s']:,.0f} rounds/s")),
    ("Kafka decision p99 (s after the evidence) at 80 % of capacity", "kafka",
     TARGETS["kafka_decision_latency_p99_s"], "max", "measured",
     lambda k: (k["paced"]["evidence_latency_p99_s"], "2 workers flat out", k["two_workers"]["evidence_latency_p99_s"],
                f"paced at {k['paced']['paced_rounds_per_s']:,.0f} rounds/s, "
                f"{k['paced_share_of_capacity']:.0%} of {k['capacity_rounds_per_s']:,.0f}")),
    ("Kafka CPU us per telemetry message, producing (stated)", "kafka", None, "stated", "measured",
     lambda k: _clients(k, "produce", "linger 5 ms, batch 16 KiB")),
    ("Kafka CPU us per telemetry message, consuming (stated)", "kafka", None, "stated", "measured",
     lambda k: _clients(k, "consume", "max_poll_records 100")),
    ("us per key-slice at the most keys (1 round per key-slice)", "keys", TARGETS["us_per_key_slice"], "max",
     "measured",
     lambda k: (k["curve"][-1]["us_per_key_slice"], "CPython's default collector thresholds",
                k["curve"][-1]["us_per_key_slice_default_collector"], f"{k['curve'][-1]['keys']:,} keys; decoder "
                f"{k.get('decoder', 'reference')}" + (f", {k['curve'][-1]['us_per_key_slice_without_native']:.1f} us "
                                                      "without the compiled walk"
                                                      if "us_per_key_slice_without_native" in k["curve"][-1] else ""))),
    ("stage 2 us per slice knowing idle keys, over knowing none", "keys", TARGETS["idle_keys_over_none"], "max",
     "ratio",
     lambda k: (k["idle_keys"]["us_per_slice_with_idle_keys"], "no idle keys", k["idle_keys"]["us_per_slice_without"],
                f"{k['idle_keys']['idle_keys']:,} idle keys; key updates {k['idle_keys']['key_updates_with_idle_keys']}"
                f" with them, {k['idle_keys']['key_updates_without']} without")),
    ("archive sink rows/s into chDB (wall)", "archive", TARGETS["archive_rows_per_s"], "min", "measured",
     lambda a: (a["sink_rows_per_s"], "the row path it replaced", a["row_path_rows_per_s"],
                f"{a['sink_rows_per_s_cpu']:,.0f} rows per CPU second" + (
                    f"; percentiles read at once over sketch by sketch: {a['sink_bulk_over_per_sketch']:.2f}x wall, "
                    f"{a['sink_bulk_over_per_sketch_cpu']:.2f}x CPU (median of {len(a['sink_pairs'])} alternated pairs)"
                    if a.get("sink_pairs") else ""))),
    ("archive insert alone rows/s into chDB, in memory (wall)", "archive", TARGETS["archive_rows_per_s"], "min",
     "measured",
     lambda a: (a["insert_memory_rows_per_s"], "the file round trip", a["insert_file_rows_per_s"],
                f"{a['insert_memory_rows_per_s_cpu']:,.0f} rows per CPU second")),
    ("replay wall seconds, over a plain json.loads loop of the same file", "replay", TARGETS["replay_over_json_loads"],
     "max", "ratio",
     lambda r: (r["replay_s"], "json.loads loop", r["json_loads_s"], f"{r['bytes'] / 2**20:.0f} MB; decoder "
                f"{r.get('decoder', 'reference')}" + (f"; SPECWATCH_NATIVE=0 {r['replay_without_native_over_json_loads']:.2f}x"
                                                      if "replay_s_without_native" in r else ""))),
    ("start-up: wall seconds of `specwatch replay` of one record", "startup", TARGETS["startup_s"], "max", "measured",
     lambda s: (s["replay_one_record_s"], "bare interpreter (python -c pass)", s["bare_interpreter_s"], None)),
    ("collector inside vLLM, engine-thread CPU us per step (hook path)", "engine", TARGETS["collector_us_per_step"],
     "max", "measured",
     lambda e: (e["hook_path_us_per_step"], "collector switched off (wrappers only)", e["hook_path_off_us_per_step"],
                f"{e['requests_per_step']:.1f} requests/step; own wall-time account "
                f"{e['collector_us_per_step']:.1f} us")),
    ("vLLM step time median (ms), collector on", "engine", TARGETS["engine_on_over_off"], "max", "ratio",
     _engine_row("median")),
    ("vLLM step time mean (ms), collector on", "engine", TARGETS["engine_on_over_off"], "max", "ratio",
     _engine_row("mean")),
    ("vLLM step time p99 (ms), collector on", "engine", TARGETS["engine_on_over_off"], "max", "ratio",
     _engine_row("p99")),
    ("emit through the OpenTelemetry SDK, caller's CPU us per step", "collector", TARGETS["sdk_over_direct"], "max",
     "ratio",
     lambda c: (c["sdk_us_per_step"], "the direct path", c["direct_us_per_step"],
                f"the SDK's own floor {c['sdk_floor_us_per_step']:.1f} us; a record with no attributes "
                f"{c['sdk_minimal_record_us_per_step']:.1f} us")),
    ("export through OpenTelemetry's OTLP/HTTP exporter, CPU us per step", "export", TARGETS["sdk_over_direct"], "max",
     "ratio",
     lambda x: (x["otlp_http_us_per_step"], "direct Kafka exporter" if x.get("kafka_us_per_step") else
                "direct Kafka encoding alone", x.get("kafka_us_per_step") or x["kafka_encode_us_per_step"], None)),
    ("engine-thread us per step, direct emit", "collector", TARGETS["collector_us_per_step"], "max", "measured",
     lambda c: (c["direct_us_per_step"], "the simulated step's own time",
                c["engine_step_ms_simulated"] * 1e3, None)),
    ("sealed capture share of the collector's time per step", "engine", TARGETS["capture_share_of_collector"], "max",
     "ratio",
     lambda e: (e["capture_us_per_step"], "the collector's own account", e["collector_us_per_step"],
                f"capture rate {e['capture_rate']}")),
    ("state bytes per key (worst, >= 10 keys)", "growth", TARGETS["state_bytes_per_key"], "max", "measured",
     lambda g: max(((r["state_bytes_per_key"], "bytes per key at 1 key", g[0]["state_bytes_per_key"],
                     f"{r['keys']:,} keys") for r in g if r["keys"] >= 10), key=lambda row: row[0])),
    *((f"gateway {label}, ms through the gateway", "gateway", TARGETS["gateway_over_direct"], "max", "ratio",
       lambda g, name=name: (g[f"gateway_{name}_ms"], "the server called directly", g[f"direct_{name}_ms"],
                             f"{g['requests_per_side']} streamed requests per side, alternated"))
      for label, name in (("e2e p50", "e2e_p50"), ("e2e p99", "e2e_p99"), ("TTFT p50", "ttft_p50"),
                          ("TTFT p99", "ttft_p99"))),
)


def _section_gap(section: Any) -> str | None:
    """Why a section's report holds no figures (not selected, skipped, failed), or None."""
    if isinstance(section, dict):
        for reason in ("skipped", "error"):
            if section.get(reason):
                return f"{reason}: {section[reason]}"
    return None if section else "not run"


def judge_targets(report: dict) -> list[dict]:
    """Every target of issue 16 with its alternative, ratio and met; None where not measured (a
    figure its section lacks too); a "stated" target has no goal, and is met once measured.

    >>> rows = judge_targets({"replay": {"skipped": "not selected"}})
    >>> len(rows) == len(_TARGET_ROWS), {r["met"] for r in rows}
    (True, {None})
    >>> [r["note"] for r in rows if r["section"] == "replay"]
    ['not measured: skipped: not selected']
    """
    rows = []
    for target, name, goal, goal_is, goal_on, figures in _TARGET_ROWS:
        section = report.get(name)
        row = {"target": target, "section": name, "goal": goal, "goal_is": goal_is, "goal_on": goal_on,
               "measured": None, "alternative": None, "alternative_value": None, "ratio": None, "met": None,
               "note": None}
        gap = _section_gap(section)
        if gap is None:
            try:
                measured, alternative, value, note = figures(section)
            except (KeyError, IndexError, StopIteration, TypeError, ValueError) as error:
                gap = f"the {name} section has no figure for it ({type(error).__name__}: {error})"
        if gap is not None:
            row["note"] = f"not measured: {gap}"
            rows.append(row)
            continue
        ratio = measured / value if measured is not None and value else None
        bounded = measured if goal_on == "measured" else ratio
        if goal is None:
            met = measured is not None
        elif bounded is None:
            met = None
        else:
            met = bounded <= goal if goal_is == "max" else bounded >= goal
        row.update(measured=measured, alternative=alternative, alternative_value=value, ratio=ratio, met=met,
                   note=note)
        rows.append(row)
    return rows


def run_bench(quick: bool = False, smoke: bool = False, bootstrap: str | None = None,
              sections: tuple[str, ...] = (), log=lambda msg: None) -> dict:
    """Every section; ``smoke`` shrinks inputs to check the output's shape only. Without
    ``bootstrap``, the kafka and export sections run against a broker of this run's own. A
    section that raises is reported as its error and named in ``failed_sections``; the others run."""
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                          "load_average": os.getloadavg(), "quick": quick, "smoke": smoke,
                                          # the block decoder's step walks: compiled, or the Python reference
                                          "decoders": DECODERS},
                            "failed_sections": []}
    wanted = set(sections) or set(SECTIONS)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        broker_error = None
        if bootstrap:
            report["machine"]["broker"] = {"bootstrap": bootstrap, "own": False}
        elif wanted & {"kafka", "export"}:
            log("bench: starting a Kafka broker of this run (deploy/kafka/broker.sh) ...")
            try:
                bootstrap = stack.enter_context(OwnBroker.of_this_run())
                report["machine"]["broker"] = {"bootstrap": bootstrap, "own": True}
            except (RuntimeError, OSError, subprocess.SubprocessError) as error:
                broker_error = f"no broker: --bootstrap was not given and one could not be started: {error}"
                report["machine"]["broker"] = {"error": broker_error}
        steps = [("stream", lambda: bench_stream(quick, smoke)),
                 ("collector", lambda: bench_collector(quick, smoke)),
                 ("export", lambda: bench_export(bootstrap, quick, smoke)),
                 ("engine", lambda: run_engine_bench(quick, smoke)),
                 ("archive", lambda: bench_archive(quick, smoke)),
                 ("replay", lambda: bench_replay(quick, smoke, Path(tmp))),
                 ("startup", lambda: bench_startup(quick, smoke)),
                 ("growth", lambda: bench_growth(quick, smoke)),
                 ("keys", lambda: bench_keys(quick, smoke)),
                 ("metrics", lambda: bench_metrics(quick, smoke)),
                 ("gateway", lambda: run_gateway_bench(quick, smoke)),
                 ("kafka", lambda: bench_kafka(bootstrap, quick, smoke) if bootstrap else {"error": broker_error})]
        for name, fn in steps:
            if name in wanted:
                log(f"bench: {name} ...")
                try:
                    report[name] = fn()
                except Exception as error:  # one section's failure must not lose the hour the others took
                    log(f"bench: {name} failed:\n{traceback.format_exc()}")
                    report[name] = {"error": f"{type(error).__name__}: {error}"}
                    report["failed_sections"].append(name)
            else:
                report[name] = {"skipped": "not selected"}
    report["targets"] = judge_targets(report)
    return report


def keys_picture(path: str | os.PathLike) -> str:
    """Where `plot_report` puts the keys figure beside ``path``: ``b.png`` -> ``b-keys.png``."""
    return str(Path(path).with_name(f"{Path(path).stem}-keys.png"))


def plot_report(report: dict, path: str | os.PathLike) -> None:
    """Rounds/s per core of the batch, reference and per-round paths, and growth with keys, as a
    PNG; a keys section's picture goes beside it: ``benchmarks.png`` -> ``benchmarks-keys.png``."""
    if isinstance(report.get("keys"), dict) and "curve" in report["keys"]:
        from specwatch.lab.bench.key_cost import plot_keys

        plot_keys(report["keys"], keys_picture(path))
    if not (isinstance(report.get("stream"), list) and isinstance(report.get("growth"), list)):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = report["stream"]
    labels = [f"{r['encoding']}\n{r['requests_per_step']:.0f} req/step" for r in rows]
    x = range(len(rows))
    width = 0.27
    for offset, field, name in ((-width, "columnar_rounds_per_s", "step record, columnar batches"),
                                (0.0, "reference_rounds_per_s", "step record, pydantic path"),
                                (width, "naive_rounds_per_s", "one record per round")):
        left.bar([i + offset for i in x], [r[field] / 1e3 for r in rows], width, label=name)
    left.set_xticks(list(x), labels, fontsize=8)
    left.set_ylabel("thousand rounds/s per core")
    left.set_title("decode + stage 1 + stage 2 + detectors")
    left.legend(fontsize=8)
    growth = report["growth"]
    keys = [g["keys"] for g in growth]
    right.plot(keys, [g["columnar_rounds_per_s"] / 1e3 for g in growth], "o-", label="batch mode, k rounds/s")
    right.plot(keys, [g["reference_rounds_per_s"] / 1e3 for g in growth], "s--", label="reference, k rounds/s")
    right.set_xscale("log")
    right.set_xlabel("(bundle, bucket, cohort) keys")
    right.set_ylabel("thousand rounds/s per core")
    twin = right.twinx()
    twin.plot(keys, [g["state_bytes_per_key"] / 1024 for g in growth], "^:", color="tab:red", label="state KB/key")
    twin.set_ylabel("state KB per key", color="tab:red")
    right.set_title("cost growth with keys")
    right.legend(fontsize=8, loc="upper center")
    fig.suptitle(f"specwatch bench ({report['machine']['cpus']} shared cores; ratios carry over, "
                 "absolute rates depend on load)", fontsize=9)
    fig.tight_layout()
    from specwatch.outputs import save_figure

    save_figure(fig, path)
    plt.close(fig)
