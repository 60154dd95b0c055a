"""The step samples and round counts a block of steps folds into each key: the ones folding the
same steps one record at a time keeps, however the ranks tie and however the rounds drafted."""

from __future__ import annotations

import json
import zlib

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Policy
from specwatch.schemas.codec import encode_record
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.schemas.slice_stats import sample_record
from specwatch.streams.combine import Stage1
from specwatch.streams.sources import Ingest

from test_fastpath import batches_json

# Two step ids with one CRC-32: their steps rank alike until the ids themselves are compared.
TIED = (("worker-51352", 368141), ("worker-15018", 80931))


def _lines(steps: list[tuple[str, int, float, list[tuple[str, int, int]]]]) -> list[str]:
    """A bundle card, then ``(worker, seq, ts offset, [(bucket, drafted, accepted)])`` steps."""
    bundle = next(r for r in Simulator("healthy", seed=5, minutes=0.01).records() if r.kind == "bundle")
    lines = [encode_record(bundle)]
    for n, (worker, seq, offset, rounds) in enumerate(steps):
        requests = [{"id": f"r{n}-{i}", "bucket": bucket, "cohort": "main", "drafted": drafted, "accepted": accepted}
                    for i, (bucket, drafted, accepted) in enumerate(rounds)]
        lines.append(json.dumps({"v": 1, "ts": bundle.ts + offset, "kind": "step", "worker": worker, "seq": seq,
                                 "bundle_id": bundle.bundle_id, "draft_ms": 1.0, "verify_ms": 10.0, "kv_usage": 0.5,
                                 "requests": requests}, separators=(",", ":")))
    return lines


def _one_at_a_time(lines: list[str]) -> list:
    ingest = Ingest(Stage1(Policy(), source="w"))
    closed = [batch for line in lines for batch in ingest(line).closed]
    return closed + ingest.stage.close_ready(final=True)


def _in_blocks(lines: list[str], size: int) -> list:
    ingest = Ingest(Stage1(Policy(), source="w"))
    closed = [batch for start in range(0, len(lines), size)
              for batch in ingest.block(decode_lines_block(lines[start:start + size])).closed]
    return closed + ingest.stage.close_ready(final=True)


def _kept(batches: list, bucket: str, kind: str) -> list[tuple[str, int]]:
    """The (worker, seq) of the ``kind`` samples each slice kept for ``bucket``."""
    return [(record["worker"], record["seq"]) for batch in batches for key, stats in batch.partials.items()
            if key[1] == bucket for record in map(sample_record, stats.samples.get(kind, []))]


def test_steps_whose_ids_share_a_crc32_are_ranked_by_their_ids_in_a_block_as_one_at_a_time():
    assert len({zlib.crc32(f"{worker}:{seq}".encode()) for worker, seq in TIED}) == 1
    # the later id comes first in the block: the tie is not settled by position
    steps = [(*TIED[0], 0.1, [("chat", 4, 2), ("code", 4, 1)]), (*TIED[1], 0.2, [("chat", 4, 2), ("code", 4, 3)]),
             ("w3", 1, 0.3, [("code", 2, 2)])]
    lines = _lines(steps)
    reference = _one_at_a_time(lines)
    # chat: both steps accept half of what they drafted, so the tie goes to the lower id for both kinds
    assert _kept(reference, "chat", "lowest_acceptance") == [TIED[1]]
    assert _kept(reference, "chat", "control_step") == [TIED[1]]
    # code: the first step accepted least; the control is the lowest rank among three steps
    assert _kept(reference, "code", "lowest_acceptance") == [TIED[0]]
    assert _kept(reference, "code", "control_step") == [min([*TIED, ("w3", 1)],
                                                            key=lambda s: (zlib.crc32(f"{s[0]}:{s[1]}".encode()),
                                                                           f"{s[0]}:{s[1]}"))]
    for size in (1, 2, len(lines)):
        assert batches_json(_in_blocks(lines, size)) == batches_json(reference), size


def test_rounds_of_every_length_count_per_key_in_a_block_as_one_at_a_time():
    """Plain entries (nothing drafted), rounds that accept nothing, and draft lengths that grow
    and shrink across blocks of one slice: the same counts and positions per key and bundle."""
    steps = [(f"w{n % 3}", n, 0.01 * n, [("chat", (n * 5) % 9, (n * 3) % ((n * 5) % 9 + 1)),
                                         ("code", 0, 0), ("chat", 1, n % 2), ("math", n % 7, 0)])
             for n in range(1, 240)]
    lines = _lines(steps)
    reference = _one_at_a_time(lines)
    whole = [stats for batch in reference for key, stats in batch.partials.items() if key[1] is None]
    chat = [stats for batch in reference for key, stats in batch.partials.items() if key[1] == "chat"]
    assert sum(s.plain_entries for s in whole) == sum(1 + (n % 7 == 0) + ((n * 5) % 9 == 0) for n in range(1, 240))
    assert max(len(s.drafted_at_least) for s in chat) == 8 and len(reference) >= 3
    for size in (1, 7, 50, len(lines)):
        assert batches_json(_in_blocks(lines, size)) == batches_json(reference), size
