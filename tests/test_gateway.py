"""specwatch gateway against an in-process fake of two vLLM OpenAI servers (httpx's mock transport):
routing by flags and stage, records per response, streaming pass-through, retries, shadow, limits."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from specwatch.actions.flags import FlagStore
from specwatch.collectors.export import InMemoryExporter
from specwatch.gateway import Gateway, GatewaySettings, LabelRule, LabelRules, build_app
from specwatch.schemas import Decision

_SPEC = {"method": "draft_model", "model": "/nonexistent/drafter", "num_speculative_tokens": 4}
_MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "root": "/nonexistent/target"}]}
_PROMPT = "SECRET-PROMPT-TEXT def mean(values):"


class FakePools:
    """Two fake vLLM servers behind one mock transport, told apart by host: ``spec`` and ``std``."""

    def __init__(self, spec_tokens=(5, 6, 7), std_tokens=(5, 6, 7)) -> None:
        self.spec_tokens = list(spec_tokens)
        self.std_tokens = list(std_tokens)
        self.spec_down = False
        self.seen: list[tuple[str, dict]] = []

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        pool = request.url.host
        path = request.url.path
        if pool == "spec" and self.spec_down:
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/v1/models":
            return httpx.Response(200, json=_MODELS)
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text=_METRICS if pool == "spec" else "")
        body = json.loads(request.content)
        self.seen.append((pool, body))
        tokens = self.spec_tokens if pool == "spec" else self.std_tokens
        tokens = tokens[:body.get("max_tokens", len(tokens))]
        metrics = None
        if pool == "spec":
            steps = len(tokens) - 1
            metrics = {"speculative_decoding": {
                "mean_acceptance_length": 1.0, "draft_acceptance_rate": 0.0, "acceptance_histogram": [steps, 0, 0, 0, 0],
                "num_spec_steps": steps, "num_accepted_draft_tokens": 0, "num_draft_tokens": 4 * steps,
                "num_spec_tokens": 4, "per_step_accepted": [0] * steps, "per_step_drafted": [4] * steps}}
        text = "".join(f"t{t}" for t in tokens)
        if not body.get("stream"):
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            if body.get("return_token_ids"):
                choice["token_ids"] = tokens
            payload = {"id": "cmpl-1", "choices": [choice], "usage": {"completion_tokens": len(tokens)}}
            if metrics:
                payload["metrics"] = metrics
            return httpx.Response(200, json=payload)
        events = []
        for i, token in enumerate(tokens):
            choice = {"index": 0, "text": f"t{token}", "finish_reason": "length" if i == len(tokens) - 1 else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = [token]
            events.append({"id": "cmpl-1", "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": len(tokens)}}
            if metrics:
                usage["metrics"] = metrics
            events.append(usage)
        stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=stream.encode(), headers={"content-type": "text/event-stream"})


_METRICS = """vllm:spec_decode_num_drafts_total{engine="0"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0"} 40.0
vllm:spec_decode_num_accepted_tokens_total{engine="0"} 0.0
vllm:kv_cache_usage_perc{engine="0"} 0.125
"""


def _run(pools: FakePools, flags: FlagStore, calls, **settings):
    """Start a gateway on the fake pools, run ``calls(client, gateway)``, return (result, records, gateway)."""
    sink = InMemoryExporter()
    sink.emit = lambda record: sink.export([record])  # noqa: E731 - the gateway's sink interface

    async def go():
        gateway = Gateway(GatewaySettings("http://spec", "http://std", _SPEC, **settings), flags, sink,
                          transport=pools.transport())
        await gateway.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gateway)),
                                     base_url="http://gateway") as client:
            result = await calls(client, gateway)
        await gateway.close()
        return result, gateway

    result, gateway = asyncio.run(go())
    return result, sink.records, gateway


def _completion(client, bucket="coding", cohort=None, stream=False, **extra):
    headers = {"x-specwatch-bucket": bucket}
    if cohort:
        headers["x-specwatch-cohort"] = cohort
    body = {"model": "tiny", "prompt": _PROMPT, "max_tokens": 3, "temperature": 0, "stream": stream, **extra}
    return client.post("/v1/completions", json=body, headers=headers)


def test_a_speculative_answer_becomes_step_and_request_records_of_its_scope():
    pools = FakePools()

    async def calls(client, gateway):
        return await _completion(client)
    response, records, gateway = _run(pools, FlagStore(), calls)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "t5t6t7"
    assert [pool for pool, _ in pools.seen] == ["spec"]
    kinds = [r.kind for r in records]
    assert kinds == ["bundle", "step", "step", "request"]
    steps = [r for r in records if r.kind == "step"]
    assert [(e.bucket, e.cohort, e.drafted, e.accepted) for s in steps for e in s.requests] == [
        ("coding", "main", 4, 0)] * 2
    assert {s.kv_usage for s in steps} == {0.125} and {s.worker for s in steps} == {"gateway:speculative"}
    request = records[-1]
    assert (request.speculative, request.output_tokens, request.finish_reason, request.bucket) == (
        True, 3, "length", "coding")
    assert request.bundle_id == records[0].bundle_id == gateway.bundle_id
    assert gateway.metrics.value("requests", ("/v1/completions", "speculative", "speculating")) == 1


def test_a_disabled_bucket_goes_to_the_standard_pool_and_its_records_say_standard():
    pools = FakePools()
    flags = FlagStore()

    async def calls(client, gateway):
        flags.apply(Decision(ts=1.0, bundle_id=gateway.bundle_id, bucket="coding", action="disable_speculation",
                             reason="acceptance_drop", detector="acceptance_gate"))
        return [await _completion(client, "coding"), await _completion(client, "chat")]
    (coding, chat), records, gateway = _run(pools, flags, calls)
    assert coding.status_code == chat.status_code == 200
    assert (coding.headers["x-specwatch-pool"], coding.headers["x-specwatch-route"]) == ("standard", "acceptance_drop")
    assert (chat.headers["x-specwatch-pool"], chat.headers["x-specwatch-route"]) == ("speculative", "speculating")
    assert [pool for pool, _ in pools.seen] == ["std", "spec"]
    requests = {r.bucket: r for r in records if r.kind == "request"}
    assert (requests["coding"].speculative, requests["coding"].worker) == (False, "gateway:standard")
    assert requests["chat"].speculative is True
    assert not [r for r in records if r.kind == "step" and r.requests[0].bucket == "coding"]
    assert gateway.metrics.value("requests", ("/v1/completions", "standard", "acceptance_drop")) == 1


def test_streaming_passes_every_chunk_and_hides_the_usage_chunk_the_client_did_not_ask_for():
    pools = FakePools()

    async def calls(client, gateway):
        plain = await _completion(client, stream=True)
        asked = await _completion(client, stream=True, stream_options={"include_usage": True})
        return plain.text, asked.text
    (plain, asked), records, _ = _run(pools, FlagStore(), calls)
    plain_events = [e for e in plain.split("\n\n") if e]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in plain_events[:-1]] == ["t5", "t6", "t7"]
    assert plain_events[-1] == "data: [DONE]" and "usage" not in plain
    assert '"usage"' in asked and "speculative_decoding" in asked
    # the gateway asked the pool for usage either way: both requests carry their acceptance
    assert all(body["stream_options"]["include_usage"] for _, body in pools.seen)
    requests = [r for r in records if r.kind == "request"]
    assert [(r.output_tokens, r.finish_reason) for r in requests] == [(3, "length"), (3, "length")]
    assert len([r for r in records if r.kind == "step"]) == 4
    assert all(r.tpot_ms is not None and r.ttft_ms <= r.e2e_ms for r in requests)


def test_a_speculative_pool_that_refuses_is_retried_once_on_standard_counted_and_recorded(caplog):
    pools = FakePools()

    async def start_then_fail(client, gateway):
        pools.spec_down = True  # after the card was read
        return [await _completion(client), await _completion(client, stream=True)]
    with caplog.at_level(logging.DEBUG):
        (whole, streamed), records, gateway = _run(pools, FlagStore(), start_then_fail)
    assert whole.status_code == streamed.status_code == 200
    assert whole.headers["x-specwatch-route"] == streamed.headers["x-specwatch-route"] == "retry"
    assert whole.json()["choices"][0]["text"] == "t5t6t7" and "t7" in streamed.text
    assert gateway.metrics.value("retries", ("error",)) == 2
    assert gateway.metrics.value("upstream_failures", ("speculative", "error")) == 2
    requests = [r for r in records if r.kind == "request"]
    assert [(r.speculative, r.finish_reason, r.error) for r in requests] == [
        (True, "error", "ConnectError"), (False, "length", None)] * 2
    assert all(r.sample.prompt_sha256 == requests[0].sample.prompt_sha256 for r in requests)
    assert _PROMPT not in caplog.text and "SECRET" not in caplog.text


def test_without_retry_a_failure_is_a_502_and_still_a_record():
    pools = FakePools()

    async def calls(client, gateway):
        pools.spec_down = True
        return await _completion(client)
    response, records, gateway = _run(pools, FlagStore(), calls, retry=False)
    assert response.status_code == 502
    assert [(r.kind, getattr(r, "finish_reason", None)) for r in records][-1] == ("request", "error")


def test_shadow_mirrors_the_shadow_cohort_and_records_a_strict_mismatch():
    pools = FakePools(spec_tokens=(5, 6, 9))  # a lossy speculative pool: its third token differs
    flags = FlagStore()

    async def calls(client, gateway):
        flags.apply(Decision(ts=1.0, bundle_id=gateway.bundle_id, action="promote", reason="unadmitted_bundle",
                             detector="admission_registry",
                             evidence={"stage": "shadow", "cohort": "shadow", "cohort_share": 0.0}))
        answers = [await _completion(client, cohort="shadow"), await _completion(client, cohort="shadow", stream=True),
                   await _completion(client, cohort="main")]
        in_flight = gateway.mirrors_in_flight
        assert b"specwatch_gateway_shadow_in_flight %d.0" % in_flight in gateway.metrics.render()
        await asyncio.gather(*gateway._mirrors)
        return answers, in_flight
    ((whole, streamed, main), in_flight), records, gateway = _run(pools, flags, calls)
    assert 0 <= in_flight <= 2 and gateway.mirrors_in_flight == 0
    assert b"specwatch_gateway_shadow_in_flight 0.0" in gateway.metrics.render()
    # the client gets the standard answer, without the token ids the gateway asked for
    assert whole.json()["choices"][0] == {"index": 0, "text": "t5t6t7", "finish_reason": "length"}
    assert "token_ids" not in streamed.text and "t7" in streamed.text
    assert main.status_code == 200
    assert [pool for pool, _ in pools.seen].count("spec") == 2  # the two mirrors; main is unadmitted
    shadows = [r for r in records if r.kind == "shadow"]
    assert [(s.check, s.match, s.bucket) for s in shadows] == [("token_exact", False, "coding")] * 2
    assert gateway.metrics.value("shadow_checks", ("mismatch",)) == 2
    mirrored = [r for r in records if r.kind == "request" and r.speculative]
    assert {r.cohort for r in mirrored} == {"shadow"}
    assert {r.cohort for r in records if r.kind == "request" and not r.speculative} == {"main"}


def test_shadow_of_a_lossless_pool_matches():
    pools = FakePools()
    flags = FlagStore()

    async def calls(client, gateway):
        flags.apply(Decision(ts=1.0, bundle_id=gateway.bundle_id, action="promote", reason="unadmitted_bundle",
                             detector="admission_registry",
                             evidence={"stage": "shadow", "cohort": "shadow", "cohort_share": 1.0}))
        answer = await _completion(client)  # the share draws the cohort: all of it is shadow
        await asyncio.gather(*gateway._mirrors)
        return answer
    _, records, gateway = _run(pools, flags, calls)
    assert [(r.match, r.check) for r in records if r.kind == "shadow"] == [(True, "token_exact")]


def test_limits_and_bad_bodies_are_refused_and_counted():
    pools = FakePools()

    async def calls(client, gateway):
        big = await client.post("/v1/completions", content=b"{" + b" " * 5000 + b"}")
        bad = await client.post("/v1/completions", content=b"[1, 2]")
        return big.status_code, bad.status_code
    (big, bad), _, gateway = _run(pools, FlagStore(), calls, max_body_bytes=4096)
    assert (big, bad) == (413, 400)
    assert gateway.metrics.value("rejected", ("body_too_large",)) == 1
    assert gateway.metrics.value("rejected", ("invalid_json",)) == 1
    assert pools.seen == []


def test_rules_label_requests_and_metrics_and_models_are_served():
    pools = FakePools()
    rules = LabelRules(rule=[LabelRule(json_path="metadata.task"), LabelRule(route="/v1/chat/completions",
                                                                             bucket="chat", cohort="canary")])

    async def calls(client, gateway):
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "metadata": {"task": "sql"}})
        await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": 2})
        metrics = (await client.get("/metrics")).text
        models = (await client.get("/v1/models")).json()
        health = (await client.get("/health")).json()
        return metrics, models, health
    (metrics, models, health), records, gateway = _run(pools, FlagStore(), calls, rules=rules)
    assert [(r.bucket, r.cohort) for r in records if r.kind == "request"] == [("sql", "main"), ("chat", "canary")]
    assert 'specwatch_gateway_requests_total{pool="speculative",reason="speculating",route="/v1/completions"} 1.0' \
        in metrics
    assert 'specwatch_gateway_pool_spec_draft_tokens_total{pool="speculative"} 40.0' in metrics
    assert models == _MODELS and health == {"standard": True, "speculative": True, "bundle_id": gateway.bundle_id}


def test_the_card_names_the_served_drafter_and_leaves_unseen_fields_at_defaults():
    pools = FakePools()

    async def calls(client, gateway):
        return gateway.card
    card, records, _ = _run(pools, FlagStore(), calls)
    assert (card.target.model_id, card.drafter.mechanism, card.drafter.draft_length) == ("tiny", "external", 4)
    assert card.drafter.revision == "draft_model:/nonexistent/drafter@"
    assert (card.runtime.engine, card.runtime.gpu, card.runtime.parallelism, card.target.quantization) == (
        "vllm-0.32.0", "", "", "none")
    assert card.policy.acceptance_rule == "strict"


@pytest.mark.parametrize("value", ["", "*", "a/b", "x" * 65, "\x1b[31m"])
def test_a_header_that_cannot_name_a_bucket_is_ignored(value):
    pools = FakePools()

    async def calls(client, gateway):
        return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                 headers={"x-specwatch-bucket": value})
    _, records, _ = _run(pools, FlagStore(), calls)
    assert [r.bucket for r in records if r.kind == "request"] == ["default"]
