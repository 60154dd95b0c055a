"""Per-partition tasks of the stream topology: stage 1 and stage 2, with dedupe and checkpoints.

A checkpoint is the task's state as plain data (`specwatch.schemas.checkpoint`), signed with the
decisions' keyring when one is configured; pickled ones of earlier versions convert once.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from specwatch.schemas import Decision, Policy, Rejection, RejectionCounter
from specwatch.schemas.checkpoint import (
    CHECKPOINT_VERSION,
    PICKLED_CHECKPOINT_MAGIC,
    Checkpoint,
    CheckpointError,
    pack_checkpoint,
    read_payload,
    unpack_checkpoint,
)
from specwatch.schemas.otlp import decode_request
from specwatch.schemas.otlp_block import request_block
from specwatch.schemas.outputs import ActionRecord, SliceOutput
from specwatch.transport.signing import SIGNATURE_HEADER, Keyring, Verdict, sign_line, verify

from .combine import Stage1
from .merge import Stage2
from .slice_batch import SliceBatch
from .sources import Ingest

__all__ = [
    "BundleOwner",
    "CheckpointError",
    "PartialMessage",
    "Stage1Task",
    "Stage2Task",
    "checkpoint_entries",
    "decode_checkpoint",
    "decode_partial",
    "dead_letter",
    "decisions_in",
    "encode_checkpoint",
    "encode_partial",
    "encode_partials",
    "encode_release",
    "outbox_pending",
    "read_checkpoint",
    "route_batches",
    "stage2_partition",
]

# Below Kafka's default 1 MiB message limit with room for the key and headers.
_DEFAULT_CHUNK_BYTES = 512 * 1024
_MAX_RAW_CHARS = 2048
# Partials messages stay well below Kafka's default 1 MB message limit.
_DEFAULT_PARTIALS_MESSAGE_BYTES = 512 * 1024
_BATCHES_OPEN = b'{"kind":"batches","batches":['
_BATCHES_CLOSE = b"]}"


def stage2_partition(bundle_id: str, partitions: int) -> int:
    """The stage-2 partition of a bundle: stable across processes and Python versions.

    >>> stage2_partition("b-1", 4), stage2_partition("b-2", 4)
    (1, 3)
    """
    return zlib.crc32(bundle_id.encode("utf-8")) % partitions


def route_batches(batches: Iterable[SliceBatch], partitions: int) -> list[tuple[int, SliceBatch]]:
    """Split one close of stage 1 into what each stage-2 partition receives, in send order.

    >>> from specwatch.schemas.slice_stats import SliceStats
    >>> batch = SliceBatch("t/0", 7, 7, partials={("b-1", "coding", "main"): SliceStats()})
    >>> [(p, b.slice_index, len(b.partials)) for p, b in route_batches([batch], 2)]
    [(1, 7, 1), (0, 7, 0)]
    """
    batches = list(batches)
    if not batches:
        return []
    out: list[tuple[int, SliceBatch]] = []
    vouched: dict[int, int] = {}  # partition -> the watermark its latest part carries
    for batch in batches:
        parts: dict[int, SliceBatch] = {}

        def part(target: int) -> SliceBatch:
            if target not in parts:
                parts[target] = SliceBatch(batch.source, batch.slice_index, batch.watermark)
            return parts[target]

        for key, stats in batch.partials.items():
            part(stage2_partition(key[0], partitions)).partials[key] = stats
        for event in batch.events:
            # A card goes to every partition: a worker's change from a bundle of one partition
            # to a bundle of another is seen where the new bundle is decided.
            targets = range(partitions) if event["type"] == "bundle" else (stage2_partition(event["bundle_id"],
                                                                                              partitions),)
            for target in targets:
                part(target).events.append(event)
        if batch.late_records:
            part(min(parts) if parts else 0).late_records = batch.late_records
        for target in sorted(parts):
            out.append((target, parts[target]))
            vouched[target] = parts[target].watermark
    last = batches[-1]
    for target in range(partitions):
        if vouched.get(target, -1) < last.watermark:
            out.append((target, SliceBatch(last.source, last.watermark, last.watermark)))
    return out


@dataclass(frozen=True)
class PartialMessage:
    """A partials message: one source's batches for a stage-2 partition, or its release."""

    batches: tuple[SliceBatch, ...] = ()
    release_source: str | None = None


def encode_partial(batches: SliceBatch | Sequence[SliceBatch]) -> bytes:
    """One partials message holding ``batches`` (one source's, for one stage-2 partition, in close order)."""
    if isinstance(batches, SliceBatch):
        batches = (batches,)
    return _message([_encode_batch(batch) for batch in batches])


def encode_partials(batches: Sequence[SliceBatch], max_bytes: int = _DEFAULT_PARTIALS_MESSAGE_BYTES) -> list[bytes]:
    """As few partials messages as hold ``batches`` in order, each under ``max_bytes`` (a batch larger
    than that travels alone).

    >>> batches = [SliceBatch("t/0", i, i) for i in range(5)]
    >>> [len(decode_partial(m).batches) for m in encode_partials(batches, max_bytes=250)]
    [2, 2, 1]
    >>> encode_partials(batches[:2]) == [encode_partial(batches[:2])]
    True
    """
    messages: list[list[bytes]] = []
    size = 0
    for batch in batches:
        part = _encode_batch(batch)
        if not messages or size + len(part) + 1 > max_bytes:
            messages.append([])
            size = len(_BATCHES_OPEN) + len(_BATCHES_CLOSE)
        messages[-1].append(part)
        size += len(part) + 1
    return [_message(parts) for parts in messages]


def _encode_batch(batch: SliceBatch) -> bytes:
    return json.dumps(batch.to_dict(), separators=(",", ":")).encode()


def _message(parts: list[bytes]) -> bytes:
    return _BATCHES_OPEN + b",".join(parts) + _BATCHES_CLOSE


def encode_release(source: str, watermark: int) -> bytes:
    """An idle source's release; its watermark (where its stage 1 closed) is for older readers only."""
    return json.dumps({"kind": "release", "source": source, "watermark": int(watermark)},
                      separators=(",", ":")).encode()


def decode_partial(data: bytes) -> PartialMessage | Rejection:
    """A partials message, or why it is not one (the topic is internal, but never trusted blindly).

    >>> decode_partial(encode_release("t/1", 12))
    PartialMessage(batches=(), release_source='t/1')
    >>> [b.slice_index for b in decode_partial(encode_partial([SliceBatch("t/0", 4, 4), SliceBatch("t/0", 5, 5)])).batches]
    [4, 5]
    >>> decode_partial(b"{}").reason
    'invalid_partial'
    """
    try:
        body = json.loads(data)
        kind = body.get("kind") if isinstance(body, dict) else None
        if kind == "batches":
            return PartialMessage(batches=tuple(SliceBatch.from_dict(batch) for batch in body["batches"]))
        if kind == "batch":
            return PartialMessage(batches=(SliceBatch.from_dict(body["batch"]),))
        if kind == "release":
            return PartialMessage(release_source=str(body["source"]))
        detail = "partials message is neither batches nor a release"
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        detail = f"undecodable partials message: {error!r}"
    raw = bytes(data[:_MAX_RAW_CHARS]).decode("utf-8", "replace")
    return Rejection("invalid_partial", detail, raw)


def dead_letter(rejection: Rejection, topic: str, partition: int, offset: int) -> bytes:
    """The dead-letter value of a rejected telemetry record: reason, detail, where it came from."""
    body = rejection.to_json()
    body.update(topic=topic, partition=partition, offset=offset)
    return json.dumps(body, separators=(",", ":")).encode()


class Stage1Task:
    """Stage 1 of one telemetry partition, with the offset of the next message to fold."""

    def __init__(self, policy: Policy, source: str) -> None:
        self.source = source
        self.stage = Stage1(policy, source=source)
        self.ingest = Ingest(self.stage, decode_request)  # `fold` takes each message as a block
        self.next_offset: int | None = None
        self.messages = 0

    def to_state(self) -> dict:
        return {"source": self.source, "stage": self.stage.to_state(), "ingest": self.ingest.to_state(),
                "next_offset": self.next_offset, "messages": self.messages}

    @classmethod
    def from_state(cls, state: dict, policy: Policy) -> "Stage1Task":
        task = cls(policy, str(state["source"]))
        task.stage.load_state(state["stage"])
        task.ingest.load_state(state["ingest"])
        task.next_offset = _offset(state["next_offset"])
        task.messages = int(state["messages"])
        return task

    @property
    def records(self) -> int:
        return self.stage.records

    @property
    def rejected(self) -> RejectionCounter:
        return self.ingest.rejected

    def fold(self, offset: int, payload: bytes, now: float | None = None,
             seen: dict[str, float] | None = None) -> tuple[Sequence[Rejection], Sequence[SliceBatch]]:
        """Fold one OTLP message; returns its rejected records and the slices it closed."""
        rejections, _, closed = self.ingest.block(request_block(payload), now, seen)[:3]
        self.messages += 1
        self.next_offset = offset + 1
        return rejections, closed


@dataclass(frozen=True)
class BundleOwner:
    """Whether a bundle is decided on stage-2 partition ``partition`` of ``partitions`` (picklable)."""

    partition: int
    partitions: int

    def __call__(self, bundle_id: str) -> bool:
        return stage2_partition(bundle_id, self.partitions) == self.partition


@dataclass
class Stage2Task:
    """Stage 2 of one partials partition: merges, detects, decides; deduplicates replays."""

    policy: Policy
    sources: tuple[str, ...] = ()
    owner: BundleOwner | None = None
    stage: Stage2 = field(init=False)
    next_offset: int | None = None
    last_slice: dict[str, int] = field(default_factory=dict)
    outbox: list[ActionRecord] = field(default_factory=list)
    outbox_mark: dict[int, int] = field(default_factory=dict)
    batches: int = 0
    duplicates: int = 0
    invalid: int = 0

    def __post_init__(self) -> None:
        self.stage = Stage2(self.policy, owns=self.owner)
        # Every telemetry partition is expected from the start: a partition whose first
        # batch arrives after the others' would otherwise find its first slices decided.
        for source in self.sources:
            self.stage.add(SliceBatch(source, -1, -1))

    def to_state(self) -> dict:
        owner = self.owner
        return {"sources": list(self.sources), "owner": None if owner is None else [owner.partition, owner.partitions],
                "stage": self.stage.to_state(), "next_offset": self.next_offset, "last_slice": self.last_slice,
                "outbox": [{"decision": action.decision.model_dump(), "audit": action.audit, "samples": action.samples}
                           for action in self.outbox],
                "outbox_mark": [[partition, offset] for partition, offset in self.outbox_mark.items()],
                "batches": self.batches, "duplicates": self.duplicates, "invalid": self.invalid}

    @classmethod
    def from_state(cls, state: dict, policy: Policy) -> "Stage2Task":
        owner = state["owner"]
        task = cls(policy, tuple(str(source) for source in state["sources"]),
                   None if owner is None else BundleOwner(int(owner[0]), int(owner[1])))
        task.stage.load_state(state["stage"])
        task.next_offset = _offset(state["next_offset"])
        task.last_slice = {str(source): int(index) for source, index in state["last_slice"].items()}
        task.outbox = [ActionRecord(Decision.model_validate(action["decision"]), dict(action["audit"]),
                                    [dict(sample) for sample in action["samples"]]) for action in state["outbox"]]
        task.outbox_mark = {int(partition): int(offset) for partition, offset in state["outbox_mark"]}
        task.batches, task.duplicates, task.invalid = (int(state["batches"]), int(state["duplicates"]),
                                                       int(state["invalid"]))
        return task

    def fold(self, offset: int, message: PartialMessage | Rejection) -> list[SliceOutput]:
        """Fold one partials message (exactly once per slice and source)."""
        self.next_offset = offset + 1
        if isinstance(message, Rejection):
            self.invalid += 1
            return []
        if message.release_source is not None:
            return self.stage.release(message.release_source)
        outputs: list[SliceOutput] = []
        for batch in message.batches:
            if batch.slice_index <= self.last_slice.get(batch.source, -1):
                self.duplicates += 1  # a restarted stage 1 re-sent what it had sent before
                continue
            self.last_slice[batch.source] = batch.slice_index
            self.batches += 1
            outputs += self.stage.add(batch)
        return outputs


def _offset(value) -> int | None:
    return None if value is None else int(value)


_KINDS: dict[str, type] = {"stage1": Stage1Task, "stage2": Stage2Task}


def encode_checkpoint(task: Stage1Task | Stage2Task, keyring: Keyring | None = None, name: str = "") -> bytes:
    """A task as bytes: its state as plain data (`specwatch.schemas.checkpoint`), signed with
    ``keyring``'s current key when it has one; ``name`` binds it to the task it is saved for.

    >>> task = Stage1Task(Policy(), "t/0")
    >>> task.next_offset = 41
    >>> decode_checkpoint(encode_checkpoint(task)).next_offset
    41
    """
    kind = "stage1" if isinstance(task, Stage1Task) else "stage2"
    checkpoint = Checkpoint(CHECKPOINT_VERSION, kind, name, task.stage.policy.model_dump(mode="json"), task.to_state())
    keyring = keyring if keyring is not None else Keyring()
    return pack_checkpoint(checkpoint, lambda payload: "".join(
        value.decode("ascii") for _, value in sign_line(payload, keyring)))


def decode_checkpoint(data: bytes, keyring: Keyring | None = None, name: str | None = None,
                      convert_pickled: bool | None = None) -> Stage1Task | Stage2Task:
    """The task a checkpoint holds, or `CheckpointError` saying why not (its ``reason``): a
    signature that does not verify against ``keyring``, a checkpoint for another task than
    ``name``, a format version or content this version does not read. A pickled checkpoint of an
    earlier version converts (`specwatch.streams.pickled_checkpoints`) if ``convert_pickled``, by
    default only without a signing key: it never was signed, and a stage-2 task publishes its
    outbox signed.
    """
    keyring = keyring if keyring is not None else Keyring()
    if bytes(data[:len(PICKLED_CHECKPOINT_MAGIC)]) == PICKLED_CHECKPOINT_MAGIC:
        if not (not keyring.enabled if convert_pickled is None else convert_pickled):
            raise CheckpointError("pickled_refused", "a pickled checkpoint of an earlier version, never signed; "
                                                     "conversion was not asked for while signing is on")
        from .pickled_checkpoints import load_pickled_task

        return load_pickled_task(data)
    payload, signature = unpack_checkpoint(data)
    verdict = verify(payload, [(SIGNATURE_HEADER, signature.encode("ascii", "replace"))] if signature else [], keyring)
    if not verdict.accepted:
        detail = {Verdict.UNSIGNED: "the checkpoint is not signed and a signing key is configured",
                  Verdict.UNKNOWN_KEY: "the checkpoint is signed with a key this worker does not hold"}.get(
            verdict, "the checkpoint's signature does not match its content")
        raise CheckpointError(verdict.value, detail)
    checkpoint = read_payload(payload)
    if name is not None and checkpoint.name != name:
        raise CheckpointError("wrong_task", f"the checkpoint is {checkpoint.name!r}'s, not {name!r}'s")
    try:
        policy = Policy.model_validate(checkpoint.policy)
        return _KINDS[checkpoint.kind].from_state(checkpoint.state, policy)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - a panic of a Rust extension (t-digest, ADWIN) too
        raise CheckpointError("undecodable", f"the {checkpoint.kind} state does not load: {error!r}") from error


def checkpoint_entries(name: str, sequence: int, data: bytes,
                       chunk_bytes: int = _DEFAULT_CHUNK_BYTES) -> list[tuple[str, bytes]]:
    """Table entries that store one checkpoint: chunks first, then the manifest naming them.

    >>> [key for key, _ in checkpoint_entries("s1/0", 3, b"x" * 10, chunk_bytes=4)]
    ['s1/0#1.0', 's1/0#1.1', 's1/0#1.2', 's1/0#1']
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    slot = sequence % 2
    chunks = [data[i:i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    manifest = json.dumps({"sequence": sequence, "chunks": len(chunks),
                           "sha256": hashlib.sha256(data).hexdigest()}).encode()
    entries = [(f"{name}#{slot}.{i}", chunk) for i, chunk in enumerate(chunks)]
    entries.append((f"{name}#{slot}", manifest))
    return entries


def read_checkpoint(name: str, lookup: Callable[[str], bytes | None]) -> tuple[int, bytes] | None:
    """The newest whole checkpoint stored under ``name``: (sequence, data), or None.

    >>> table = dict(checkpoint_entries("s1/0", 1, b"old") + checkpoint_entries("s1/0", 2, b"new"))
    >>> read_checkpoint("s1/0", table.get)
    (2, b'new')
    >>> table["s1/0#0.0"] = b"torn"  # the newer slot half-written: the older one is used
    >>> read_checkpoint("s1/0", table.get)
    (1, b'old')
    """
    best: tuple[int, bytes] | None = None
    for slot in (0, 1):
        raw = lookup(f"{name}#{slot}")
        if not raw:
            continue
        try:
            manifest = json.loads(raw)
            sequence, count, digest = int(manifest["sequence"]), int(manifest["chunks"]), manifest["sha256"]
        except (ValueError, KeyError, TypeError):
            continue
        parts = [lookup(f"{name}#{slot}.{i}") for i in range(count)]
        if any(part is None for part in parts):
            continue
        data = b"".join(parts)
        if hashlib.sha256(data).hexdigest() != digest:
            continue
        if best is None or sequence > best[0]:
            best = (sequence, data)
    return best


def decisions_in(values: Iterable[bytes]) -> set[str]:
    """Ids of the decisions among raw decisions-topic values (others are ignored)."""
    ids = set()
    for value in values:
        try:
            ids.add(Decision.model_validate_json(value).id)
        except ValueError:
            continue
    return ids


def outbox_pending(outbox: list[ActionRecord], published: Mapping[str, object] | set[str]) -> list[ActionRecord]:
    """The outbox actions whose decision is not among ``published`` ids, in order."""
    return [action for action in outbox if action.decision.id not in published]
