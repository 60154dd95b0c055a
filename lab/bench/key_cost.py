"""The keys section of `specwatch bench`: what one (bundle, bucket, cohort) key costs per slice,
with one round per key-slice (docs/BENCHMARKS.md, "Cost per key")."""

from __future__ import annotations

import json
from typing import Iterator

from specwatch.lab.bench import alternated, timed
from specwatch.schemas import Policy
from specwatch.schemas.codec import encode_record
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.schemas.native_walks import DECODERS
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.gc_policy import STREAM_THRESHOLDS
from specwatch.streams.combine import Stage1
from specwatch.streams.merge import Stage2
from specwatch.streams.slice_batch import SliceBatch
from specwatch.streams.sources import Ingest

__all__ = ["bench_keys", "closed_batches", "fed_pipeline", "line_blocks", "plot_keys",
           "stage2_outputs", "step_lines"]

_SEED = 17
_REQUESTS_PER_STEP = 16
# The 1-key alternative: the stream section's shape (16 requests per step, 20 steps a slice).
_ONE_KEY_ROUNDS_PER_SLICE = 20 * _REQUESTS_PER_STEP
_IDLE_KEYS = 10_000
_CPYTHON_THRESHOLDS = (700, 10, 10)  # the interpreter's own: what a process runs with untuned
_BLOCK_LINES = 4096  # as `specwatch replay` reads them


def step_lines(keys: int, slices: int, rounds_per_slice: int,
               requests_per_step: int = _REQUESTS_PER_STEP) -> tuple[list[bytes], int]:
    """A bundle card, then ``slices`` 1 s slices of ``rounds_per_slice`` rounds in steps, the n-th
    round on key ``bucket{n % keys}``.

    >>> lines, rounds = step_lines(keys=20, slices=2, rounds_per_slice=20)
    >>> len(lines), rounds, [len(json.loads(line)["requests"]) for line in lines[1:3]]
    (5, 40, [16, 4])
    """
    bundle = next(r for r in Simulator("healthy", seed=_SEED, minutes=0.01).records() if r.kind == "bundle")
    lines = [encode_record(bundle).encode()]
    steps_per_slice = -(-rounds_per_slice // requests_per_step)
    rounds, seq, k = 0, 0, 0
    for s in range(slices):
        left = rounds_per_slice
        for i in range(steps_per_slice):
            ts = bundle.ts + s + i / steps_per_slice
            requests = [{"id": f"r{seq}-{n}", "bucket": f"bucket{n % keys}", "cohort": "main",
                         "drafted": 4, "accepted": (seq + n) % 5}
                        for n in range(k, k + min(requests_per_step, left))]
            k += len(requests)
            left -= len(requests)
            # in the writer's layout (`encode_record`'s), which the compiled step walk reads
            lines.append(json.dumps({"v": 1, "ts": ts, "kind": "step", "worker": "w1", "seq": seq,
                                     "bundle_id": bundle.bundle_id, "draft_ms": 1.0, "verify_ms": 10.0,
                                     "kv_usage": 0.5, "requests": requests}, separators=(",", ":")).encode())
            rounds += len(requests)
            seq += 1
    return lines, rounds


def _cpu(fn, thresholds: tuple[int, int, int] | None = STREAM_THRESHOLDS) -> float:
    return timed(fn, thresholds)[0]


def line_blocks(lines: list[bytes]) -> list[list[bytes]]:
    """``lines`` in blocks, as `specwatch replay` feeds them to the batch mode."""
    return [lines[start:start + _BLOCK_LINES] for start in range(0, len(lines), _BLOCK_LINES)]


def fed_pipeline(lines: list[bytes], columnar: bool = True, native: bool = True,
                 pipeline: EmbeddedPipeline | None = None) -> EmbeddedPipeline:
    """A pipeline (``pipeline``, or a new one) fed ``lines`` in blocks (the batch mode) or one at a
    time (the reference path); ``native=False``: the batch mode without the compiled step walk."""
    pipeline = EmbeddedPipeline() if pipeline is None else pipeline
    if columnar:
        for block in line_blocks(lines):
            pipeline.feed_lines(block, native)
    else:
        for line in lines:
            pipeline.feed_line(line)
    return pipeline


def _pipeline(lines: list[bytes], native: bool = True) -> None:
    fed_pipeline(lines, native=native).finish()


def closed_batches(lines: list[bytes]) -> list[SliceBatch]:
    """The batches stage 1 closes for ``lines``, all of them (stage 2 reads them, never writes them)."""
    ingest = Ingest(Stage1(Policy(), source="bench"))
    batches: list[SliceBatch] = []
    for block in line_blocks(lines):
        batches.extend(ingest.block(decode_lines_block(block)).closed)
    batches.extend(ingest.release())
    return batches


def stage2_outputs(stage: Stage2, batches: list[SliceBatch]) -> Iterator:
    """What ``stage`` puts out for ``batches``, then for its flush."""
    for batch in batches:
        yield from stage.add(batch)
    yield from stage.flush()


def _stage2(batches: list[SliceBatch]) -> Stage2:
    stage = Stage2(Policy())
    for _ in stage2_outputs(stage, batches):
        pass
    return stage


def _idle_keys(idle: int, slices: int) -> dict:
    """Stage 2 per slice with one busy key (a second worker's), knowing ``idle`` more or none."""
    warm, _ = step_lines(idle, 1, idle)
    busy, _ = step_lines(1, slices + 1, 1)
    later = [json.dumps({**json.loads(line), "worker": "w2"}, separators=(",", ":")).encode() for line in busy[2:]]
    first_slice = int(json.loads(warm[1])["ts"])

    def run(lines: list[bytes]) -> tuple[float, int]:
        batches = closed_batches(lines)
        stage = _stage2([b for b in batches if b.slice_index <= first_slice])
        after = [b for b in batches if b.slice_index > first_slice]
        return timed(lambda: sum(len(out.window_rows) for out in stage2_outputs(stage, after)))

    timings = alternated({"all": lambda: run(warm + later),
                          "one": lambda: run(busy[:1] + later)}, 3)
    all_s, all_updates = min(timings["all"])
    one_s, one_updates = min(timings["one"])
    return {"idle_keys": idle, "slices": slices, "us_per_slice_with_idle_keys": all_s / slices * 1e6,
            "us_per_slice_without": one_s / slices * 1e6, "with_over_without": all_s / max(one_s, 1e-9),
            "key_updates_with_idle_keys": all_updates, "key_updates_without": one_updates}


def bench_keys(quick: bool, smoke: bool) -> dict:
    """Rounds/s and us per key-slice at 1 .. 10,000 keys with one round per key-slice, beside the 1-key rate."""
    sizes = (1, 10, 100) if smoke else (1, 10, 100, 1_000, 10_000)
    slices = 4 if smoke else 12
    repeats = 1 if smoke or quick else 2
    one_key_lines, one_key_rounds = step_lines(1, slices, _ONE_KEY_ROUNDS_PER_SLICE)
    one_key: list[float] = []
    curve = []
    for keys in sizes:
        lines, rounds = step_lines(keys, slices, keys)
        batches = closed_batches(lines)
        runs = alternated({  # the 1-key run among them, so load falls on all alike
            "pipeline": lambda: _cpu(lambda: _pipeline(lines)),
            "without_native": lambda: _cpu(lambda: _pipeline(lines, native=False)),
            "one_key": lambda: _cpu(lambda: _pipeline(one_key_lines)),
            "default": lambda: _cpu(lambda: _pipeline(lines), _CPYTHON_THRESHOLDS),
            "stage2": lambda: _cpu(lambda: _stage2(batches)),
            "stage2_off": lambda: _cpu(lambda: _stage2(batches), None)}, repeats)
        one_key += runs["one_key"]
        us = {name: min(values) / (keys * slices) * 1e6 for name, values in runs.items()}
        curve.append({"keys": keys, "slices": slices, "rounds": rounds, "key_slices": keys * slices,
                      "rounds_per_s": rounds / min(runs["pipeline"]),
                      "us_per_key_slice": us["pipeline"],
                      "us_per_key_slice_without_native": us["without_native"],
                      "us_per_key_slice_default_collector": us["default"],
                      "stage2_us_per_key_slice": us["stage2"],
                      "stage2_collector_off_us_per_key_slice": us["stage2_off"]})
    one_key_rate = one_key_rounds / min(one_key)
    for row in curve:
        row["over_one_key_rate"] = row["rounds_per_s"] / one_key_rate
    return {"curve": curve, "decoder": DECODERS["jsonl"], "one_key_rounds_per_s": one_key_rate, "collector_thresholds": list(STREAM_THRESHOLDS),
            "one_key_rounds_per_slice": _ONE_KEY_ROUNDS_PER_SLICE,
            "idle_keys": _idle_keys(500 if smoke else _IDLE_KEYS, 4 if smoke else 20)}


def plot_keys(keys: dict, path) -> None:
    """Rounds/s and us per key-slice against keys (log scale), with the 1-key rate, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = keys["curve"]
    counts = [row["keys"] for row in curve]
    fig, left = plt.subplots(figsize=(6.5, 4.2))
    left.plot(counts, [row["rounds_per_s"] / 1e3 for row in curve], "o-", label="k rounds/s, 1 round per key-slice")
    left.axhline(keys["one_key_rounds_per_s"] / 1e3, color="tab:gray", linestyle=":",
                 label=f"1 key, {keys['one_key_rounds_per_slice']} rounds a slice")
    left.set_xscale("log")
    left.set_xlabel("(bundle, bucket, cohort) keys")
    left.set_ylabel("thousand rounds/s per core")
    right = left.twinx()
    right.plot(counts, [row["us_per_key_slice"] for row in curve], "s--", color="tab:red", label="us per key-slice")
    right.plot(counts, [row["stage2_us_per_key_slice"] for row in curve], "^:", color="tab:purple",
               label="us per key-slice, stage 2 alone")
    right.axhline(10.0, color="tab:red", linestyle="-", linewidth=0.6, label="goal: 10 us per key-slice")
    right.set_yscale("log")
    right.set_ylabel("us per key-slice (log)", color="tab:red")
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    left.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper center")
    left.set_title("cost per key as keys grow (decode + stage 1 + stage 2 + detectors)", fontsize=9)
    fig.tight_layout()
    from specwatch.outputs import save_figure

    save_figure(fig, path)
    plt.close(fig)
