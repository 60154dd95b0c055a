"""Fuzzing the contract-v1 JSON Lines decoder and the embedded pipeline behind it.
Derandomized; set SPECWATCH_FUZZ_EXAMPLES to run more (e.g. 20000 before a release)."""

from __future__ import annotations

import copy
import json
import math
import os
from functools import lru_cache

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import MAX_LINE_BYTES, Rejection, decode_line, encode_record
from specwatch.schemas.contract import BundleRecord, RequestRecord, ShadowRecord, StepRecord
from specwatch.streams.embedded import EmbeddedPipeline

_EXAMPLES = int(os.environ.get("SPECWATCH_FUZZ_EXAMPLES", "300"))
_FUZZ = settings(max_examples=_EXAMPLES, derandomize=True, deadline=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much])
# Every reason the JSON Lines decoder may give (README: "The reasons are ...").
LINE_REASONS = frozenset({
    "invalid_json", "missing_field", "not_finite", "accepted_exceeds_drafted", "negative_time",
    "unknown_kind", "unsupported_version", "too_many_requests", "line_too_long", "not_an_object",
    "invalid_value",
})
_RECORD_TYPES = (BundleRecord, StepRecord, RequestRecord, ShadowRecord)


@lru_cache(maxsize=1)
def _valid_lines() -> tuple[str, ...]:
    """A few seconds of a seeded two-worker fleet whose bundle changes: one decision in them."""
    records = Simulator("bundle_change", seed=3, minutes=0.1, workers=2, concurrency=3, incident_at=0.5).records()
    return tuple(encode_record(r) for r in records)[:200]


@lru_cache(maxsize=1)
def _valid_objects() -> tuple[dict, ...]:
    by_kind: dict[str, dict] = {}
    for line in _valid_lines():
        body = json.loads(line)
        by_kind.setdefault(body["kind"], body)
    # A shadow record: the simulator's healthy run may not emit one in its first seconds.
    by_kind.setdefault("shadow", {"kind": "shadow", "v": 1, "ts": 5.0, "bundle_id": "b-1", "id": "r9",
                                  "bucket": "structured", "check": "token_exact", "match": False})
    return tuple(by_kind[k] for k in sorted(by_kind))


def _check_result(result) -> None:
    if result is None:
        return
    if isinstance(result, Rejection):
        assert result.reason in LINE_REASONS, result
        assert isinstance(result.detail, str) and result.detail, result
        json.dumps(result.to_json())  # dead-letter form is always serializable
        return
    assert isinstance(result, _RECORD_TYPES), type(result)
    # What was accepted obeys the contract, and survives the trip through its JSON form.
    assert math.isfinite(result.ts) and result.ts >= 0
    if isinstance(result, StepRecord):
        assert all(0 <= r.accepted <= r.drafted for r in result.requests)
        assert math.isfinite(result.draft_ms) and math.isfinite(result.verify_ms)
    assert decode_line(encode_record(result)) == result


_JSON_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                 | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
_JSON = st.recursive(_JSON_SCALARS, lambda inner: st.lists(inner, max_size=5)
                     | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=30)


@_FUZZ
@given(st.one_of(st.text(max_size=500), st.binary(max_size=500)))
@example("")
@example("   \t ")
@example(b"\xff\xfe{}")
@example("[" * 100_000 + "]" * 100_000)
@example('{"kind": "step", "v": 1e999}')
@example('{"kind": "step", "v": true}')
@example('{"kind": "request", "v": 1, "ts": 1, "tpot_ms": NaN}')
@example("x" * (MAX_LINE_BYTES + 1))
@example(b"{" * (MAX_LINE_BYTES + 1))
@example('{"kind": "\\ud800"}')
@example('{"kind": [], "v": 1}')
@example('{"kind": {"step": 1}, "v": 1}')
def test_any_text_or_bytes_decodes_or_is_rejected_with_a_reason(line):
    _check_result(decode_line(line))


@_FUZZ
@given(_JSON)
def test_any_json_value_decodes_or_is_rejected_with_a_reason(value):
    _check_result(decode_line(json.dumps(value)))


_ODD_VALUES = st.sampled_from([
    None, True, False, 0, -1, -0.0, 1e308, -1e308, 2**63, 2**64 + 1, float("nan"), float("inf"),
    float("-inf"), "", "x" * 300, "1", [], {}, [1, 2], {"a": 1}, 65, 4097, "\u0000", "\ud7ff",
])


@st.composite
def _mutated_object(draw) -> dict:
    """A valid record with a few of its fields (at any depth) deleted or replaced."""
    body = copy.deepcopy(draw(st.sampled_from(_valid_objects())))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path, container = [], body
        while True:
            keys = list(container) if isinstance(container, dict) else list(range(len(container)))
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            path.append(key)
            child = container[key]
            if isinstance(child, (dict, list)) and child and draw(st.booleans()):
                container = child
                continue
            if isinstance(container, dict) and draw(st.integers(0, 3)) == 0:
                del container[key]
            else:
                container[key] = draw(_ODD_VALUES | _JSON_SCALARS)
            break
    return body


@_FUZZ
@given(_mutated_object())
def test_mutated_records_decode_or_are_rejected_with_a_reason(body):
    _check_result(decode_line(json.dumps(body)))  # json.dumps writes NaN/Infinity as Python does


@_FUZZ
@given(st.sampled_from(range(4)), st.integers(min_value=0, max_value=64), st.integers(min_value=0, max_value=64))
def test_acceptance_beyond_drafts_is_always_named(index, drafted, accepted):
    body = copy.deepcopy([o for o in _valid_objects() if o["kind"] == "step"][0])
    body["requests"] = [{"id": f"r{index}", "bucket": "coding", "cohort": "c", "drafted": drafted,
                         "accepted": accepted}]
    result = decode_line(json.dumps(body))
    if accepted > drafted:
        assert result.reason == "accepted_exceeds_drafted"
    else:
        assert isinstance(result, StepRecord)


def _run(lines) -> tuple[dict, list, list]:
    rows: list = []
    pipeline = EmbeddedPipeline(sinks=[lambda out: rows.extend(out.window_rows)])
    for line in lines:
        pipeline.feed_line(line)
    decisions = [d.to_json_line() for d in pipeline.finish()] + [d.to_json_line() for d in pipeline.decisions]
    # NaN != NaN: compare the rows in a form where it equals itself.
    return pipeline.counters.as_dict(), [json.dumps(r, sort_keys=True) for r in rows], decisions


@lru_cache(maxsize=1)
def _clean_run() -> tuple[dict, list, list]:
    return _run(_valid_lines())


_BAD_LINE = st.one_of(
    st.text(max_size=200), st.binary(max_size=200), _JSON.map(json.dumps), _mutated_object().map(json.dumps),
).filter(lambda line: isinstance(decode_line(line), Rejection))


@settings(_FUZZ, max_examples=max(50, _EXAMPLES // 3))
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=len(_valid_lines())), _BAD_LINE), max_size=12),
       st.lists(st.integers(min_value=0, max_value=len(_valid_lines())), max_size=3))
def test_bad_lines_are_counted_and_change_nothing_else(bad, blanks):
    lines = list(_valid_lines())
    for position, line in sorted(bad, key=lambda p: p[0], reverse=True):
        lines.insert(position, line)
    for position in blanks:
        lines.insert(position, "")
    counters, rows, decisions = _run(lines)
    clean_counters, clean_rows, clean_decisions = _clean_run()
    assert clean_decisions and clean_rows  # the comparison is about something

    expected_reasons: dict[str, int] = {}
    for _, line in bad:
        reason = decode_line(line).reason
        expected_reasons[reason] = expected_reasons.get(reason, 0) + 1
    assert counters["lines"] == len(_valid_lines()) + len(bad) + len(blanks)
    assert counters["records"] == clean_counters["records"] == len(_valid_lines())
    assert counters["rejected"] == len(bad)
    assert counters["rejected_by_reason"] == dict(sorted(expected_reasons.items()))
    assert (rows, decisions) == (clean_rows, clean_decisions)
    assert counters["slices"] == clean_counters["slices"] and counters["late_records"] == clean_counters["late_records"]
