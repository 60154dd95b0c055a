"""Contract-v1 records as OTLP logs: exact round trips, standard bytes, rejections for garbage."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from specwatch.schemas import (BundleCard, BundleRecord, DrafterCard, Rejection, RequestRecord, RoundEntry, RuntimeCard,
                               Sample, Sampling, ShadowRecord, StepRecord, TargetCard, bundle_digest, encode_record)
from specwatch.schemas.contract import printable, scope_name_ok
from specwatch.schemas.otlp import (MAX_REQUEST_BYTES, decode_request, encode_records,
                                    iter_encoded_chunks, log_entry, record_from_attributes)

CARD = BundleCard(
    target=TargetCard(model_id="llama-3.1-8b", revision="r7", tokenizer_digest="tk-1", quantization="fp8"),
    drafter=DrafterCard(mechanism="eagle3", revision="d3", draft_length=4),
    runtime=RuntimeCard(engine="vllm-0.32", gpu="H100", parallelism="tp2"),
)
BUNDLE = bundle_digest(CARD)


def _step(n: int = 16, seq: int = 17, worker: str = "w1", ts: float = 1_767_225_600.123456) -> StepRecord:
    return StepRecord(
        v=1, ts=ts, worker=worker, seq=seq, bundle_id=BUNDLE, draft_ms=0.9, verify_ms=11.8, kv_usage=0.61,
        requests=[RoundEntry(id=f"req-{seq}-{i}", bucket=("coding", "chat")[i % 2], cohort="canary",
                             drafted=4 if i % 5 else 0, accepted=(i % 5) if i % 5 else 0) for i in range(n)],
    )


RECORDS = {
    "bundle": BundleRecord(v=1, ts=1_767_225_600.0, worker="w1", bundle_id=BUNDLE, card=CARD),
    "step": _step(),
    "step_empty": _step(n=0, seq=0, ts=0.0),
    "request": RequestRecord(
        v=1, ts=1_767_225_601.5, worker="w1", bundle_id=BUNDLE, id="r1", bucket="coding", cohort="canary",
        speculative=True, ttft_ms=95.0, tpot_ms=11.2, e2e_ms=2950.0, output_tokens=256, finish_reason="stop",
        error=None,
        sample=Sample(prompt_sha256="a" * 64, output_sha256="b" * 64,
                      sampling=Sampling(temperature=0.0, top_p=1.0, seed=7, max_tokens=256)),
    ),
    "request_nulls": RequestRecord(
        v=1, ts=3.0, worker="w2", bundle_id=BUNDLE, id="r2", bucket="chat", cohort="baseline",
        speculative=False, ttft_ms=0.0, tpot_ms=None, e2e_ms=40.0, output_tokens=1, finish_reason="error",
        error="engine died: CUDA error", sample=None,
    ),
    "request_empty_sample": RequestRecord(
        v=1, ts=4.0, worker="w2", bundle_id=BUNDLE, id="r3", bucket="chat", cohort="baseline",
        speculative=False, ttft_ms=1.0, tpot_ms=2.0, e2e_ms=40.0, output_tokens=2, finish_reason="length",
        sample=Sample(sampling=Sampling()),
    ),
    "shadow": ShadowRecord(v=1, ts=5.0, bundle_id=BUNDLE, id="r9", bucket="structured", check="token_exact",
                           match=False),
}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_round_trip_is_exact_for_each_kind(name):
    record = RECORDS[name]
    decoded = decode_request(encode_records([record]))
    assert decoded == [record]
    assert encode_record(decoded[0]) == encode_record(record)  # the JSON form too, null for null


def test_a_mixed_batch_keeps_its_order():
    batch = [RECORDS[name] for name in ("bundle", "step", "request", "shadow", "step_empty", "request_nulls")]
    batch += [_step(seq=s, worker=f"w{s % 3}") for s in range(50)]
    assert decode_request(encode_records(batch)) == batch


def test_bytes_are_a_standard_export_logs_service_request():
    data = encode_records([RECORDS["step"], RECORDS["bundle"], RECORDS["request_nulls"]])
    request = ExportLogsServiceRequest.FromString(data)
    # protobuf's own serializer writes exactly the same bytes for the parsed message
    assert request.SerializeToString() == data
    (resource_logs,) = request.resource_logs
    assert [(kv.key, kv.value.string_value) for kv in resource_logs.resource.attributes] == [
        ("service.name", "specwatch")]
    (scope_logs,) = resource_logs.scope_logs
    assert (scope_logs.scope.name, scope_logs.scope.version) == ("specwatch", "1")
    step, bundle, request_record = scope_logs.log_records

    assert step.event_name == "specwatch.step"
    assert step.time_unix_nano == step.observed_time_unix_nano == round(RECORDS["step"].ts * 1e9)
    attributes = {kv.key: kv.value for kv in step.attributes}
    assert attributes["specwatch.worker"].string_value == "w1"
    assert attributes["specwatch.seq"].int_value == 17
    assert attributes["specwatch.ts"].double_value == RECORDS["step"].ts
    assert attributes["specwatch.kv_usage"].double_value == 0.61
    ids = [v.string_value for v in attributes["specwatch.requests.id"].array_value.values]
    assert ids == [r.id for r in RECORDS["step"].requests]
    drafted = attributes["specwatch.requests.drafted"].array_value.values
    assert [v.WhichOneof("value") for v in drafted] == ["int_value"] * 16
    assert [v.int_value for v in drafted] == [r.drafted for r in RECORDS["step"].requests]

    assert bundle.event_name == "specwatch.bundle"
    card = {kv.key: kv.value for kv in bundle.attributes}["specwatch.card"].kvlist_value
    target = {kv.key: kv.value for kv in card.values}["target"].kvlist_value
    assert {kv.key: kv.value.string_value for kv in target.values}["model_id"] == "llama-3.1-8b"

    nulls = {kv.key: kv.value for kv in request_record.attributes}
    assert nulls["specwatch.tpot_ms"].WhichOneof("value") is None  # null is the empty AnyValue
    assert nulls["specwatch.sample"].WhichOneof("value") is None
    assert nulls["specwatch.speculative"].WhichOneof("value") == "bool_value"


def test_chunks_stay_under_the_limit_and_keep_order():
    records = [_step(seq=s, n=s % 40) for s in range(300)]
    chunks = list(iter_encoded_chunks([log_entry(r) for r in records], max_bytes=20_000))
    assert len(chunks) > 5
    assert all(len(data) <= 20_000 for data, _ in chunks)
    decoded = [record for data, _ in chunks for record in decode_request(data)]
    assert decoded == records
    assert sum(count for _, count in chunks) == len(records)


def test_an_entry_bigger_than_the_limit_still_gets_its_own_chunk():
    big, small = _step(n=400), _step(n=1, seq=2)
    chunks = list(iter_encoded_chunks([log_entry(small), log_entry(big), log_entry(small)], max_bytes=1000))
    assert [count for _, count in chunks] == [1, 1, 1]
    with pytest.raises(ValueError):
        list(iter_encoded_chunks([], max_bytes=0))


def test_garbage_bytes_become_rejections_and_never_raise():
    # arbitrary bytes: test_fuzz_otlp; here the input types a Kafka client hands over
    assert decode_request(b"") == []
    assert decode_request(bytearray(b"\xff" * 10))[0].reason == "invalid_otlp"
    assert decode_request(memoryview(b"\x0a\xff\xff\xff\xff\x0f"))[0].reason == "invalid_otlp"


def test_an_oversized_request_is_refused_before_parsing():
    (rejection,) = decode_request(b"\x00" * (MAX_REQUEST_BYTES + 1))
    assert rejection.reason == "message_too_large"


def _mutated(record, **replace_attributes) -> bytes:
    request = ExportLogsServiceRequest.FromString(encode_records([record]))
    log_record = request.resource_logs[0].scope_logs[0].log_records[0]
    for key, setter in replace_attributes.items():
        key = "specwatch." + key.replace("__", ".")
        for pair in log_record.attributes:
            if pair.key == key:
                setter(pair.value)
    return request.SerializeToString()


def _set_column(values):
    def setter(value):
        del value.array_value.values[:]
        for v in values:
            item = value.array_value.values.add()
            if isinstance(v, str):
                item.string_value = v
            else:
                item.int_value = v
    return setter


@pytest.mark.parametrize(
    ("mutation", "reason"),
    [
        ({"requests__accepted": _set_column([5] * 16)}, "accepted_exceeds_drafted"),
        ({"draft_ms": lambda v: setattr(v, "double_value", math.nan)}, "not_finite"),
        ({"verify_ms": lambda v: setattr(v, "double_value", -1.0)}, "negative_time"),
        ({"requests__id": _set_column(["only-one"])}, "array_length_mismatch"),
        ({"requests__drafted": _set_column([4] * 15 + ["4x"])}, "invalid_value"),
        ({"requests__drafted": _set_column([4] * 15 + [200])}, "invalid_value"),
        ({"requests__bucket": _set_column(["coding"] * 15 + [7])}, "invalid_value"),
        ({"requests__drafted": lambda v: setattr(v, "string_value", "four")}, "invalid_value"),
        ({"v": lambda v: setattr(v, "int_value", 2)}, "unsupported_version"),
        ({"worker": lambda v: v.Clear()}, "invalid_value"),
        ({"kv_usage": lambda v: setattr(v, "double_value", 1.5)}, "invalid_value"),
    ],
)
def test_impossible_values_are_rejected_with_a_reason(mutation, reason):
    (rejection,) = decode_request(_mutated(RECORDS["step"], **mutation))
    assert isinstance(rejection, Rejection)
    assert rejection.reason == reason, rejection.detail
    assert rejection.raw  # kept for the dead-letter topic


def test_missing_fields_and_foreign_events_are_rejected():
    request = ExportLogsServiceRequest.FromString(encode_records([RECORDS["step"], RECORDS["shadow"]]))
    step, shadow = request.resource_logs[0].scope_logs[0].log_records
    keep = [kv for kv in step.attributes if kv.key != "specwatch.bundle_id"]
    del step.attributes[:]
    step.attributes.extend(keep)
    shadow.event_name = "app.checkout"
    first, second = decode_request(request.SerializeToString())
    assert (first.reason, second.reason) == ("missing_field", "unknown_kind")


def test_a_step_without_round_columns_is_missing_its_requests():
    record = RECORDS["step"]
    attributes = {k: v for k, v in log_entry(record).attributes.items() if not k.startswith("specwatch.requests.")}
    assert record_from_attributes("specwatch.step", attributes).reason == "missing_field"
    attributes["specwatch.requests.id"] = ["a"]
    assert record_from_attributes("specwatch.step", attributes).reason == "missing_field"


def test_too_many_requests_are_refused_before_validation():
    record = RECORDS["step"]
    attributes = dict(log_entry(record).attributes)
    for column in ("id", "bucket", "cohort"):
        attributes[f"specwatch.requests.{column}"] = ["x"] * 5000
    for column in ("drafted", "accepted"):
        attributes[f"specwatch.requests.{column}"] = [0] * 5000
    assert record_from_attributes("specwatch.step", attributes).reason == "too_many_requests"


def test_unknown_attributes_are_ignored_and_time_falls_back_to_the_record_time():
    attributes = {k: v for k, v in log_entry(RECORDS["shadow"]).attributes.items() if k != "specwatch.ts"}
    attributes["specwatch.future_field"] = "x"
    attributes["host.name"] = "gpu-7"
    record = record_from_attributes("specwatch.shadow", attributes, time_unix_nano=5_000_000_000)
    assert record == RECORDS["shadow"]


_names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=200).filter(printable)
_scope_names = _names.filter(scope_name_ok)
_millis = st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False)


@st.composite
def _steps(draw):
    rounds = []
    for _ in range(draw(st.integers(0, 40))):
        drafted = draw(st.integers(0, 64))
        rounds.append(RoundEntry(id=draw(_names), bucket=draw(_scope_names), cohort=draw(_scope_names), drafted=drafted,
                                 accepted=draw(st.integers(0, drafted))))
    return StepRecord(v=1, ts=draw(st.floats(0, 4e9)), worker=draw(_names), seq=draw(st.integers(0, 2**63 - 1)),
                      bundle_id=draw(_names), draft_ms=draw(_millis), verify_ms=draw(_millis),
                      kv_usage=draw(st.floats(0, 1)), requests=rounds)


@settings(max_examples=150, deadline=None)
@given(_steps())
def test_any_valid_step_round_trips(step):
    data = encode_records([step])
    assert decode_request(data) == [step]
    assert ExportLogsServiceRequest.FromString(data).SerializeToString() == data
