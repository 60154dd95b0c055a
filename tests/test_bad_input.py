"""Bad telemetry is rejected with a reason and counted; valid records around it still count."""

import json

from specwatch.schemas import decode_line
from specwatch.streams.embedded import EmbeddedPipeline

from machine import specwatch_ok

CARD = {"target": {"model_id": "m", "revision": "r1", "tokenizer_digest": "t", "quantization": "fp8"},
        "drafter": {"mechanism": "eagle3", "revision": "d1", "draft_length": 4},
        "runtime": {"engine": "vllm", "gpu": "H100", "parallelism": "tp1"},
        "policy": {"acceptance_rule": "strict", "fallback": "standard"}}


def _round(**override) -> dict:
    return {"id": "r", "bucket": "b", "cohort": "c", "drafted": 2, "accepted": 1, **override}


def _step(seq, **override):
    body = {"kind": "step", "v": 1, "ts": 100.0 + seq * 0.01, "worker": "w1", "seq": seq, "bundle_id": "b1",
            "draft_ms": 0.9, "verify_ms": 11.8, "kv_usage": 0.6,
            "requests": [{"id": "r1", "bucket": "coding", "cohort": "main", "drafted": 4, "accepted": 3}]}
    body.update(override)
    return json.dumps(body)


BAD_LINES = {
    "invalid_json": ['{"kind": "step", "v": 1', "not json at all"],
    "missing_field": [json.dumps({"kind": "step", "v": 1, "ts": 1.0, "worker": "w1"})],
    "not_finite": [_step(1000, draft_ms=float("nan")), _step(1001, ts=float("inf"))],
    "accepted_exceeds_drafted": [_step(1002, requests=[_round(drafted=2, accepted=3)])],
    "negative_time": [_step(1003, verify_ms=-1.0)],
    "unknown_kind": [json.dumps({"kind": "trace", "v": 1, "ts": 1.0})],
    "too_many_requests": [
        _step(1004, requests=[_round(id=f"r{i}", drafted=1, accepted=1) for i in range(5000)])],
    "not_an_object": ["[1, 2, 3]", "42"],
    "unsupported_version": [_step(1005, v=2), _step(1006, v=True), _step(1007, v=1.0)],
    # the contract is JSON: a count is a JSON integer, a time a JSON number, a flag a JSON
    # boolean; names hold no control characters, and no bucket or cohort can pass for a
    # decision scope's wildcard or separator
    "invalid_value": [
        _step(1008, draft_ms=True), json.dumps({**json.loads(_step(1009)), "seq": 3.0}), _step(1010, kv_usage=False),
        _step(1011, requests=[_round(drafted="4")]), _step(1012, requests=[_round(bucket="*")]),
        _step(1013, requests=[_round(cohort="*")]), _step(1014, requests=[_round(bucket="a/b")]),
        _step(1015, worker="w1\x1b[2J\x1b[H"), _step(1016, bundle_id="b1\n"),
        _step(1017, requests=[_round(id="r\u202e")]),
        _step(1018, requests=[_round(bucket="b\x07")]),
        json.dumps({"kind": "request", "v": 1, "ts": 1.0, "worker": "w1", "bundle_id": "b1", "id": "r1",
                    "bucket": "coding", "cohort": "main", "speculative": 1, "ttft_ms": 1.0, "tpot_ms": 1.0,
                    "e2e_ms": 2.0, "output_tokens": 4, "finish_reason": "stop"}),
        json.dumps({"kind": "request", "v": 1, "ts": 1.0, "worker": "w1", "bundle_id": "b1", "id": "r1",
                    "bucket": "coding", "cohort": "main", "speculative": True, "ttft_ms": "1.0", "tpot_ms": 1.0,
                    "e2e_ms": 2.0, "output_tokens": 4, "finish_reason": "stop"}),
        json.dumps({"kind": "shadow", "v": 1, "ts": 1.0, "bundle_id": "b1", "id": "r1", "bucket": "*",
                    "check": "token_exact", "match": False}),
        json.dumps({"kind": "shadow", "v": 1, "ts": 1.0, "bundle_id": "b1", "id": "r1", "bucket": "coding",
                    "check": "token_exact", "match": "false"}),
        json.dumps({"kind": "bundle", "v": 1, "ts": 1.0, "worker": "w1", "bundle_id": "b1",
                    "card": {**CARD, "drafter": {**CARD["drafter"], "draft_length": "4"}}}),
        json.dumps({"kind": "bundle", "v": 1, "ts": 1.0, "worker": "w1", "bundle_id": "b1",
                    "card": {**CARD, "target": {**CARD["target"], "revision": "r1\x1b]0;owned\x07"}}}),
    ],
}


def test_each_bad_line_gets_its_reason():
    for reason, lines in BAD_LINES.items():
        for line in lines:
            result = decode_line(line)
            assert getattr(result, "reason", None) == reason, (reason, line[:80], result)


def test_unknown_extra_fields_are_ignored():
    record = decode_line(_step(1, extra_field={"nested": True}))
    assert record.kind == "step" and record.seq == 1


def test_pipeline_counts_rejections_and_keeps_going():
    rows = []
    pipeline = EmbeddedPipeline(sinks=[lambda out: rows.extend(r for r in out.window_rows
                                                               if r["bucket"] == "coding")])
    valid = [json.dumps({"kind": "bundle", "v": 1, "ts": 100.0, "worker": "w1", "bundle_id": "b1", "card": CARD})]
    valid += [_step(i) for i in range(200)]
    mixed = []
    bad = [line for lines in BAD_LINES.values() for line in lines]
    for i, line in enumerate(valid):
        mixed.append(line)
        if i < len(bad):
            mixed.append(bad[i])
    mixed.append("")
    for line in mixed:
        pipeline.feed_line(line)
    pipeline.finish()
    counters = pipeline.counters.as_dict()
    assert counters["records"] == len(valid)
    assert counters["rejected"] == len(bad)
    assert counters["rejected_by_reason"] == {reason: len(lines) for reason, lines in BAD_LINES.items()}
    assert sum(row["rounds"] for row in rows) == 200  # every valid step's round was counted


def test_replay_cli_exits_zero_and_reports_reasons(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"kind": "bundle", "v": 1, "ts": 100.0, "worker": "w1", "bundle_id": "b1", "card": CARD})]
    lines += [_step(i) for i in range(50)] + BAD_LINES["invalid_json"] + BAD_LINES["negative_time"]
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "decisions.jsonl"
    proc = specwatch_ok("replay", str(src), "--output", str(out), "--json", timeout=120)
    summary = json.loads(proc.stdout)
    assert summary["records"] == 51
    assert summary["rejected_by_reason"] == {"invalid_json": 2, "negative_time": 1}
    assert out.read_text() == ""  # nothing wrong in 0.5 s of healthy telemetry
