"""The JSON Lines block decoder: a block of contract-v1 lines as one `StepBlock`, the steps' fields
by msgspec and their rounds' counts read by position (or by the compiled walk); docs/STREAMS.md."""

from __future__ import annotations

import gc
import math
import re
from functools import partial
from operator import attrgetter
from typing import Annotated, Callable, Sequence, Union

import msgspec
import numpy as np

from .codec import MAX_LINE_BYTES, Rejection, decode_line, decode_object
from .contract import MAX_DRAFT_TOKENS, MAX_NAME_CHARS, MAX_REQUESTS_PER_STEP, TelemetryRecord, scope_name_ok
from .native_walks import LINE_WALK
from .step_block import MAX_EXACT_INT, StepBlock, interned_block, is_name

__all__ = ["decode_lines_block"]

_INF = math.inf
_INT64_SIGN = 1 << 63
_MISSING = object()
_BlockName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]


# A step's own fields; its requests stay bytes (`_read_rounds` reads them). gc=False: a
# block makes a struct per step and holds them all at once; they hold no containers.
class _BlockStep(msgspec.Struct, tag_field="kind", tag="step", gc=False):
    v: int
    ts: float
    worker: _BlockName
    seq: Annotated[int, msgspec.Meta(ge=0, le=_INT64_SIGN - 1)]
    bundle_id: _BlockName
    draft_ms: float
    verify_ms: float
    kv_usage: float
    requests: msgspec.Raw


_BlockCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_DRAFT_TOKENS)]


# A step's round as `_any_layout` decodes it; gc=False as `_BlockStep`.
class _BlockRound(msgspec.Struct, gc=False):
    id: _BlockName
    bucket: _BlockName
    cohort: _BlockName
    drafted: _BlockCount
    accepted: _BlockCount


_ROUNDS_DECODER = msgspec.json.Decoder(Annotated[list[_BlockRound], msgspec.Meta(max_length=MAX_REQUESTS_PER_STEP)])
_ROUND_ID = attrgetter("id")
_SCOPE = attrgetter("bucket", "cohort")
_DRAFTED = attrgetter("drafted")
_ACCEPTED = attrgetter("accepted")


# Records of the other kinds, read no further here: each is decoded again, alone, by `_decode_other`.
_OTHER_KIND_NAMES = ("request", "shadow", "bundle")
_OTHER_KINDS = tuple(msgspec.defstruct(f"_Other{kind.title()}", [], tag_field="kind", tag=kind)
                     for kind in _OTHER_KIND_NAMES)
_BLOCK_DECODER = msgspec.json.Decoder(list[Union[(_BlockStep, *_OTHER_KINDS)]])
# a union even for one line: msgspec requires the tag only to choose among types, and a line
# without "kind" is no step
_LINE_DECODER = msgspec.json.Decoder(Union[(_BlockStep, *_OTHER_KINDS)])
_ANY_DECODER = msgspec.json.Decoder()
_LINE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)
_STEP_FIELDS = attrgetter("ts", "worker", "seq", "bundle_id", "draft_ms", "verify_ms", "kv_usage", "v")
_REQUESTS = attrgetter("requests")


def _line_step(line: bytes) -> _BlockStep | None:
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        return _LINE_DECODER.decode(line)
    except _LINE_ERRORS:
        return None


def _decode_other(line: bytes) -> TelemetryRecord | Rejection | None:
    """What `codec.decode_line` gives for a line the block does not hold as columns."""
    if len(line) <= MAX_LINE_BYTES:
        try:
            obj = _ANY_DECODER.decode(line)
        except _LINE_ERRORS:
            return decode_line(line)  # blank, invalid, or JSON the stdlib reads and msgspec does not (NaN, 1e999)
        if type(obj) is dict and obj.get("kind") in _OTHER_KIND_NAMES:
            record = decode_object(obj)
            if not isinstance(record, Rejection):
                return record
    return decode_line(line)


def _parsed_lines(lines: Sequence[bytes]) -> list:
    """Each line as a `_BlockStep` when msgspec reads it as one, else something else."""
    if lines and all(len(line) <= MAX_LINE_BYTES for line in lines):
        try:  # one parse of the whole block: most blocks hold only records of known kinds
            parsed = _BLOCK_DECODER.decode(b"[" + b",".join(lines) + b"]")
        except _LINE_ERRORS:
            pass  # a blank or bad line somewhere: line by line
        else:
            if len(parsed) == len(lines):  # else a line held two objects and a comma: line by line
                return parsed
    return [_line_step(line) for line in lines]


# ---------------------------------------------- round columns read by position from the bytes
# How: docs/STREAMS.md, "Round columns read by position".

_QUOTES_PER_ROUND = 16
_DRAFTED_QUOTE, _ACCEPTED_QUOTE = 13, 15  # the closing quotes of the keys "drafted" and "accepted"
_TEXT = rb'[\x20\x21\x23-\x5b\x5d-\x7e]{1,%d}' % MAX_NAME_CHARS  # a Name: printable ASCII, no quote or backslash
_COUNT = rb'[1-9]?[0-9]'  # 0-99 as JSON writes it; the bounds are checked on the numbers
_ROUND_LAYOUT = (rb'\{"id":"' + _TEXT + rb'","bucket":"' + _TEXT + rb'","cohort":"' + _TEXT + rb'","drafted":'
                 + _COUNT + rb',"accepted":' + _COUNT + rb'\}')
_REQUESTS_LAYOUT = re.compile(rb'\[(?:' + _ROUND_LAYOUT + rb'(?:,' + _ROUND_LAYOUT + rb')*)?\]')
_ROUND_NAMES = re.compile(rb'\{"id":"([^"]*)","bucket":"([^"]*)","cohort":"([^"]*)"')
_MASK = ord("1")  # a count's digits, overwritten: "4" and "7" read alike, "12" and "4" do not
_ZERO = ord("0")


def _digits(buf: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The counts of one or two digits at ``at``: (value, whether two digits, whether a count at all)."""
    first, second = buf[at].astype(np.int64) - _ZERO, buf[at + 1].astype(np.int64) - _ZERO
    two = (second >= 0) & (second <= 9)
    valid = (first >= 0) & (first <= 9) & ~(two & (first == 0))
    return np.where(two, first * 10 + second, first), two, valid


def _step_names(masked: bytes, pairs: dict) -> tuple | None:
    """A step's requests (counts masked) as (ids, each round's index in ``pairs``), None if not read here."""
    if _REQUESTS_LAYOUT.fullmatch(masked) is None:
        return None
    names = _ROUND_NAMES.findall(masked)
    if len(names) > MAX_REQUESTS_PER_STEP:
        return None
    ids, buckets, cohorts = zip(*names) if names else ((), (), ())
    scopes = list(zip(buckets, cohorts))
    index: dict[tuple[bytes, bytes], int] = {}
    for scope in dict.fromkeys(scopes):
        bucket, cohort = scope[0].decode(), scope[1].decode()
        if not (scope_name_ok(bucket) and scope_name_ok(cohort)):
            return None
        index[scope] = pairs.setdefault((bucket, cohort), len(pairs))
    return tuple(rid.decode() for rid in ids), np.fromiter(map(index.__getitem__, scopes), np.int64, len(scopes))


def _read_rounds(raws: list) -> tuple[list, np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
    """Each step's requests (msgspec.Raw, valid JSON) read as round columns, without a Python object per round.

    Returns ``(names, round_step, drafted, accepted, pair, pairs)``: per step, ``(ids, its
    rounds' indices in pairs)``, or None if its requests are not read here; per round of
    the steps read, its step, counts and (bucket, cohort) index; ``pairs``, (bucket,
    cohort) -> index.
    """
    n_steps = len(raws)
    lengths = np.fromiter(map(len, raws), np.int64, n_steps)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    joined = b"".join(raws)
    buf = np.frombuffer(joined + b"\0\0\0", dtype=np.uint8)  # reads just past a step stay inside
    quotes = np.flatnonzero(buf == 0x22)
    per_step = np.diff(np.append(np.searchsorted(quotes, starts), len(quotes)))
    plain = per_step % _QUOTES_PER_ROUND == 0
    if not plain.all():
        quotes = quotes[np.repeat(plain, per_step)]
        per_step = np.where(plain, per_step, 0)
    quotes = quotes.reshape(-1, _QUOTES_PER_ROUND)
    round_step = np.repeat(np.arange(n_steps), per_step // _QUOTES_PER_ROUND)
    drafted_at, accepted_at = quotes[:, _DRAFTED_QUOTE] + 2, quotes[:, _ACCEPTED_QUOTE] + 2
    drafted, two_drafted, drafted_ok = _digits(buf, drafted_at)
    accepted, two_accepted, accepted_ok = _digits(buf, accepted_at)
    # only digits are overwritten, and only inside their own round: a quote follows drafted,
    # `}]` at least follows accepted
    ok = (drafted_ok & accepted_ok & (drafted_at + 1 < quotes[:, _DRAFTED_QUOTE + 1])
          & (accepted_at + 2 < ends[round_step]))
    plain[round_step[~ok]] = False
    masked = buf.copy()
    for at, two in ((drafted_at, two_drafted), (accepted_at, two_accepted)):
        masked[at[ok]] = _MASK
        masked[at[ok & two] + 1] = _MASK
    masked_bytes = masked.tobytes()
    memo: dict[bytes, tuple | None] = {}
    pairs: dict[tuple[str, str], int] = {}
    names: list = []
    append = names.append
    for start, end, read in zip(starts.tolist(), ends.tolist(), plain.tolist()):
        if not read:
            append(None)
            continue
        key = masked_bytes[start:end]
        found = memo.get(key, _MISSING)
        if found is _MISSING:
            found = memo[key] = _step_names(key, pairs)
        append(found)
    others = [i for i, found in enumerate(names) if found is None]
    if others:
        round_step, drafted, accepted = _merged(names, round_step, drafted, accepted,
                                                {i: _any_layout(raws[i], pairs) for i in others})
    return names, round_step, drafted, accepted, pairs


def _merged(names: list, round_step: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
            decoded: dict[int, tuple | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The round columns with each step in ``decoded`` (by `_any_layout`) in place of what was read by position."""
    bounds = np.searchsorted(round_step, np.arange(len(names) + 1)).tolist()
    drafted_parts, accepted_parts = [], []
    for i, found in enumerate(names):
        if i not in decoded:
            drafted_parts.append(drafted[bounds[i]:bounds[i + 1]])
            accepted_parts.append(accepted[bounds[i]:bounds[i + 1]])
            continue
        found = decoded[i]
        names[i] = None if found is None else found[:2]
        drafted_parts.append(found[2] if found else drafted[:0])
        accepted_parts.append(found[3] if found else accepted[:0])
    round_step = np.repeat(np.arange(len(names)), [len(part) for part in drafted_parts])
    return round_step, np.concatenate(drafted_parts), np.concatenate(accepted_parts)


def _any_layout(raw: msgspec.Raw, pairs: dict) -> tuple | None:
    """A step's requests decoded round by round, for a layout `_read_rounds` does not read by position.

    Returns ``(ids, each round's index in pairs, drafted, accepted)``, or None if they fail
    the contract's checks.
    """
    try:
        rounds = _ROUNDS_DECODER.decode(raw)
    except _LINE_ERRORS:
        return None
    ids = tuple(map(_ROUND_ID, rounds))
    scopes = list(map(_SCOPE, rounds))
    drafted = np.fromiter(map(_DRAFTED, rounds), np.int64, len(rounds))
    accepted = np.fromiter(map(_ACCEPTED, rounds), np.int64, len(rounds))
    if not all(map(is_name, set(ids))):  # counts are checked with every other round's
        return None
    distinct = dict.fromkeys(scopes)
    if not all(is_name(name) and scope_name_ok(name) for scope in distinct for name in scope):
        return None
    index = {scope: pairs.setdefault(scope, len(pairs)) for scope in distinct}
    return ids, np.fromiter(map(index.__getitem__, scopes), np.int64, len(scopes)), drafted, accepted


def decode_lines_block(lines: Sequence[bytes | str], native: bool = True) -> StepBlock:
    """A block of JSON lines as one `StepBlock`, positions being line numbers in the block.

    ``native=False`` keeps to the reference path even where the compiled walk is loaded.

    >>> step = (b'{"kind":"step","v":1,"ts":%d,"worker":"w1","seq":%d,"bundle_id":"b","draft_ms":1.0,'
    ...         b'"verify_ms":9.0,"kv_usage":0.5,"requests":[{"id":"r","bucket":"chat","cohort":"main",'
    ...         b'"drafted":4,"accepted":3}]}')
    >>> block = decode_lines_block([step % (10, 1), step % (11, 2), b"", b"{", step % (12, 3)])
    >>> block.at, [(at, type(item).__name__) for at, item in block.others]
    ([0, 1, 4], [(3, 'Rejection')])
    >>> block.seqs, block.keys, block.round_key.tolist(), block.step_ids, block.record(1).seq
    ([1, 2, 3], [('b', 'chat', 'main'), ('b', None, None)], [0, 0, 0], [('r',), ('r',), ('r',)], 2)
    """
    lines = [line.encode() if type(line) is str else line for line in lines]
    if native and LINE_WALK is not None:
        return _walked_lines_block(lines)
    return _reference_lines_block(lines, lambda position: partial(decode_line, lines[position]))


def _walked_lines_block(lines: list[bytes]) -> StepBlock:
    """`decode_lines_block` with the compiled walk reading the steps in the writer's layout; the
    lines it declines take the reference path, and their steps join the walk's by position."""
    (at, declined, ts, workers, seqs, bundles, draft_ms, verify_ms, kv_usage, step_ids, round_step, pair_index,
     pairs, drafted, accepted) = LINE_WALK.block(lines)

    def build(position: int) -> Callable:
        return partial(decode_line, lines[position])

    header = (np.frombuffer(ts), workers, seqs, bundles, np.frombuffer(draft_ms), np.frombuffer(verify_ms),
              np.frombuffer(kv_usage))
    walked = interned_block(header, np.frombuffer(round_step, dtype=np.int64),
                            np.frombuffer(pair_index, dtype=np.int64), pairs, np.frombuffer(drafted, dtype=np.uint8),
                            np.frombuffer(accepted, dtype=np.uint8), at, [], step_ids, build)
    if not declined:
        return walked
    rest = _reference_lines_block([lines[i] for i in declined], build)
    rest.at = [declined[i] for i in rest.at]
    rest.others = [(declined[i], item) for i, item in rest.others]
    if not len(rest):  # lines of other kinds, blank or bad ones: no step to place among the walk's
        walked.others = rest.others
        return walked
    return _joined(walked, rest, build)


def _joined(first: StepBlock, second: StepBlock, build: Callable) -> StepBlock:
    """One block of the steps and other records of two blocks over the same lines, in line order,
    (bucket, cohort) pairs numbered in the order the steps list them."""
    rows = sorted([(position, block, row) for block in (first, second) for row, position in enumerate(block.at)],
                  key=lambda item: item[0])
    pairs: dict[tuple[str, str], int] = {}
    columns: list[list] = [[] for _ in range(7)]
    pair_index, drafted, accepted, step_ids, counts = [], [], [], [], []
    for _, block, row in rows:
        start, end = np.searchsorted(block.round_step, (row, row + 1)).tolist()
        for column, value in zip(columns, (block.ts[row], block.workers[row], block.seqs[row],
                                           block.keys[block.bundle_key[row]][0], block.draft_ms[row],
                                           block.verify_ms[row], block.kv_usage[row])):
            column.append(value)
        pair_index += [pairs.setdefault(block.keys[k][1:], len(pairs)) for k in block.round_key[start:end].tolist()]
        drafted.append(block.drafted[start:end])
        accepted.append(block.accepted[start:end])
        step_ids.append(block.step_ids[row])
        counts.append(end - start)
    round_step = np.repeat(np.arange(len(rows)), counts)
    return interned_block(columns, round_step, np.asarray(pair_index, dtype=np.int64), list(pairs),
                          np.concatenate(drafted), np.concatenate(accepted), [position for position, _, _ in rows],
                          sorted(first.others + second.others, key=lambda item: item[0]), step_ids, build)


def _reference_lines_block(lines: list[bytes], build: Callable) -> StepBlock:
    """`decode_lines_block` on the reference path: msgspec for the steps' fields, their rounds read by position."""
    collecting = gc.isenabled()
    gc.disable()  # a block is many objects made at once, none of them in a cycle
    try:
        parsed = _parsed_lines(lines)
        at = [i for i, item in enumerate(parsed) if type(item) is _BlockStep]
        steps = [parsed[i] for i in at]
        header = list(zip(*map(_STEP_FIELDS, steps))) or ((),) * 8
        names, round_step, drafted, accepted, pairs = _read_rounds(list(map(_REQUESTS, steps)))
    finally:
        if collecting:
            gc.enable()
    good = _checked(header, names)
    if len(drafted):
        bad_round = (accepted > drafted) | (drafted > MAX_DRAFT_TOKENS)
        if bad_round.any():
            good[round_step[bad_round]] = False
    keep_round = good[round_step]
    kept = good.tolist()
    if not all(kept):  # a few steps left to `codec.decode_line`
        at = [position for position, keep in zip(at, kept) if keep]
        header = [[value for value, keep in zip(column, kept) if keep] for column in header]
        names = [found for found, keep in zip(names, kept) if keep]
        drafted, accepted = drafted[keep_round], accepted[keep_round]
        round_step = (np.cumsum(good) - 1)[round_step[keep_round]]
    pair = np.concatenate([found[1] for found in names]) if names else np.zeros(0, dtype=np.int64)
    taken = set(at)
    others = [(position, decoded) for position, line in enumerate(lines) if position not in taken
              and (decoded := _decode_other(line)) is not None]
    return interned_block(header, round_step, pair, list(pairs), drafted, accepted, at, others,
                          [found[0] for found in names], build)


def _checked(header, names: list) -> np.ndarray:
    """Which steps pass the contract's checks that msgspec and `_read_rounds` did not make."""
    ts, workers, seqs, bundles, draft_ms, verify_ms, kv_usage, v = header
    ts, draft_ms, verify_ms, kv_usage = (np.asarray(column, dtype=np.float64)
                                         for column in (ts, draft_ms, verify_ms, kv_usage))
    good = ((np.asarray(v, dtype=np.float64) == 1) & (ts >= 0) & (ts < MAX_EXACT_INT) & (draft_ms >= 0)
            & (draft_ms < _INF) & (verify_ms >= 0) & (verify_ms < _INF) & (kv_usage >= 0) & (kv_usage <= 1))
    good &= np.fromiter((found is not None for found in names), bool, len(names))
    bad_names = {name for name in set(workers) | set(bundles) if not is_name(name)}
    if bad_names:
        good &= np.fromiter((w not in bad_names and b not in bad_names for w, b in zip(workers, bundles)), bool,
                            len(workers))
    return good


