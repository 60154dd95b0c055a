"""Qualification logic on recorded responses: the dataset, checks, Gate 1 and Gate 2 verdicts with
their named reasons, the sweep's Dynamic SD table (validated by vLLM's own code), the archived report
and `bundles show`, and admission's require_qualification switch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specwatch.actions.admission import AdmissionController
from specwatch.archive.store import Archive
from specwatch.cli import main
from specwatch.qualify.checks import run_checks
from specwatch.qualify.completion import Completion
from specwatch.qualify.dataset import Checks, QualificationRequest, context_overflow, load_dataset
from specwatch.qualify.gate1 import judge_gate1
from specwatch.qualify.gate2 import judge_gate2
from specwatch.qualify.sweep import SweepPoint, draft_length_candidates, dynamic_sd_table
from specwatch.schemas import BundleCard, DrafterCard, Policy, TargetCard, bundle_digest
from specwatch.schemas.qualification import GateResult, Qualification


def _request(id, bucket="coding", **sampling):
    return QualificationRequest(id=id, bucket=bucket, prompt="p", sampling=sampling)


def _pair(id, standard, speculative, rounds=((3, 3),)):
    return [Completion(id, "standard", 0, token_ids=list(standard), finish_reason="length"),
            Completion(id, "speculative", 0, token_ids=list(speculative), finish_reason="length", rounds=list(rounds))]


def test_the_shipped_dataset_covers_every_bucket_and_a_bad_file_loses_only_its_bad_lines(tmp_path):
    data = load_dataset()
    assert data.buckets() == {"coding": 4, "extraction": 3, "long_context": 3, "reasoning": 3, "structured": 4,
                              "summarization": 3}
    assert sum(not r.sampling.greedy for r in data.requests) == 3
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a", "bucket": "coding", "prompt": "x"}\nnot json\n'
                    '{"id": "a", "bucket": "coding", "prompt": "y"}\n'
                    '{"id": "b", "bucket": "coding"}\n'
                    '{"id": "c", "bucket": "coding", "prompt": "z", "sampling": {"temperature": 0, "samples": 4}}\n')
    loaded = load_dataset(path)
    assert [r.id for r in loaded.requests] == ["a"]
    assert loaded.rejected == {2: "not JSON: Expecting value", 3: "duplicate id 'a'",
                               4: "line: Value error, give exactly one of prompt (completions) or messages "
                                  "(chat completions)",
                               5: "sampling: Value error, a greedy request is drawn once: samples must be 1 when "
                                  "temperature is 0"}
    path.write_text("nothing here\n")
    with pytest.raises(ValueError, match="holds no request"):
        load_dataset(path)


def test_checks_name_what_failed():
    schema = {"x-tool-name": "get_weather", "type": "object", "required": ["city"],
              "properties": {"city": {"type": "string"}}}
    ok = '{"name": "get_weather", "arguments": {"city": "Lisbon"}}'
    assert run_checks(Checks(tool_call=schema), ok, "stop") == {"tool_call": None}
    assert run_checks(Checks(tool_call=schema), '{"name": "search", "arguments": {}}', "stop") == {
        "tool_call": "tool 'search', expected 'get_weather'"}
    assert run_checks(Checks(tool_call=schema), '{"name": "get_weather", "arguments": {}}', "stop") == {
        "tool_call": "arguments: 'city' is a required property"}
    assert run_checks(Checks(json_schema={"type": "array"}), "no json", "stop") == {
        "json_schema": "no JSON value in the output"}
    command = "python3 -c \"import sys; sys.exit(0 if open('{output}').read().strip() == '42' else 3)\""
    assert run_checks(Checks(code_test=command), "42\n", "stop") == {"code_test": None}
    assert run_checks(Checks(code_test=command), "41", "stop")["code_test"].startswith("exit 3")


def test_gate1_passes_identical_greedy_output_and_reports_acceptance_per_bucket():
    requests = [_request("a"), _request("b", bucket="structured")]
    completions = _pair("a", [1, 2, 3, 4], [1, 2, 3, 4], [(3, 3), (3, 0)]) + _pair("b", [5, 6], [5, 6], [(3, 1)])
    gate = judge_gate1(requests, completions)
    assert (gate.verdict, gate.reasons) == ("pass", [])
    assert gate.detail["greedy"] == {"requests": 2, "identical": 2, "divergences": []}
    assert {b: (a["mean"], a["rounds"]) for b, a in gate.detail["acceptance"].items()} == {
        "coding": (2.5, 2), "structured": (2.0, 1)}


def test_gate1_names_the_first_divergent_token_of_each_request():
    requests = [_request("a"), _request("b", bucket="extraction")]
    completions = _pair("a", [1, 2, 3, 4], [1, 2, 9, 9]) + _pair("b", [5, 6, 7], [5, 6])
    gate = judge_gate1(requests, completions)
    assert gate.verdict == "fail"
    assert gate.reasons == ["a (coding): greedy output diverges at token 2 (standard 3, speculative 9)",
                            "b (extraction): greedy output diverges at token 2 (standard 7, speculative None)"]
    assert [d["id"] for d in gate.detail["greedy"]["divergences"]] == ["a", "b"]


def test_gate1_judges_sampled_requests_by_distribution_with_power_stated():
    rng = np.random.default_rng(7)
    request = _request("s", temperature=0.7, samples=200)

    def draws(path, p):
        return [Completion("s", path, i, token_ids=list(rng.choice(4, size=4, p=p))) for i in range(200)]

    same = draws("standard", [.4, .3, .2, .1]) + draws("speculative", [.4, .3, .2, .1])
    gate = judge_gate1([request], same)
    assert (gate.verdict, gate.detail["sampled"]["rejected"]) == ("pass", 0)
    test = gate.detail["sampled"]["tests"][0]
    assert test["positions_tested"] == 4 and all(0 < p["detectable_w"] < 0.5 for p in test["per_position"])
    shifted = draws("standard", [.4, .3, .2, .1]) + draws("speculative", [.1, .2, .3, .4])
    gate = judge_gate1([request], shifted)
    assert gate.verdict == "fail"
    assert gate.reasons[0].startswith("s (coding): sampled token distribution differs at output position 0 (p = ")


def test_gate1_fails_a_check_that_passes_on_standard_and_fails_on_the_speculative_path():
    request = QualificationRequest(id="j", bucket="structured", prompt="p", checks={"json_schema": {"type": "object"}})
    completions = [Completion("j", "standard", 0, token_ids=[1], text='{"a": 1}', finish_reason="stop"),
                   Completion("j", "speculative", 0, token_ids=[1], text='{"a": 1', finish_reason="stop")]
    gate = judge_gate1([request], completions)
    assert gate.reasons == ["j (structured): check json_schema passes on standard decoding (1/1) and fails on the "
                            "speculative path (0/1): no JSON value in the output"]
    both_fail = [Completion("j", p, 0, token_ids=[1], text="x") for p in ("standard", "speculative")]
    assert judge_gate1([request], both_fail).verdict == "pass"  # the same on both paths: not a regression


def test_gate1_fails_a_request_that_errs_only_on_the_speculative_path():
    completions = [Completion("a", "standard", 0, token_ids=[1]),
                   Completion("a", "speculative", 0, error="HTTP 500: engine dead")]
    gate = judge_gate1([_request("a")], completions)
    assert gate.reasons == ["a (coding): 1 speculative request(s) failed against 0 standard: HTTP 500: engine dead",
                            "no request completed on both paths: nothing was compared"]


def test_a_request_longer_than_the_servers_hold_is_skipped_with_its_own_verdict_not_failed(tmp_path):
    from specwatch.analysis.qualification import render_text

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in (
        {"id": "short", "bucket": "coding", "prompt": "x", "sampling": {"max_tokens": 32}},
        {"id": "edge", "bucket": "long_context", "prompt": "y", "sampling": {"max_tokens": 32}},
        {"id": "long", "bucket": "long_context", "prompt": "z", "sampling": {"max_tokens": 32}})))
    data = load_dataset(path)
    # prompt plus output beyond the limit, not the prompt alone: vLLM would cut the output short
    skipped = context_overflow(data.requests, {"short": 40, "edge": 480, "long": 481}, 512)
    assert skipped == [{"id": "long", "bucket": "long_context", "verdict": "skipped: exceeds max_model_len 512",
                        "prompt_tokens": 481, "max_tokens": 32}]
    assert context_overflow(data.requests, {"short": 40}, 512) == []  # an uncounted prompt is run, not guessed
    fitting = data.without(skipped)
    assert [r.id for r in fitting.requests] == ["short", "edge"] and fitting.buckets() == {"coding": 1,
                                                                                          "long_context": 1}
    assert fitting.summary()["skipped"] == {"long": "skipped: exceeds max_model_len 512"}
    completions = _pair("short", [1, 2], [1, 2]) + _pair("edge", [3], [3])
    gate = judge_gate1(fitting.requests, completions, skipped=fitting.skipped)
    assert (gate.verdict, gate.reasons, gate.detail["skipped"]) == ("pass", [], skipped)
    assert gate.detail["greedy"]["requests"] == 2 and gate.detail["errors"] == {"standard": 0, "speculative": 0}
    # everything skipped: nothing was compared, which fails, and the reason says why
    nothing = judge_gate1([], [], skipped=skipped)
    assert nothing.reasons == ["no request completed on both paths: nothing was compared (1 skipped as longer "
                               "than the servers hold)"]
    report = {"bundle_id": "b-1", "verdict": "pass", "card": {"drafter": {"mechanism": "ngram", "draft_length": 2}},
              "gate1": json.loads(gate.model_dump_json()), "gate2": {"verdict": "pass", "reasons": [], "detail": {}}}
    assert "\n  long (long_context): skipped: exceeds max_model_len 512 (481 prompt + 32 output tokens)\n" in (
        render_text(report))


def _row(concurrency, output_tok_s, tpot, failed=0, kv=0.2):
    return {"concurrency": concurrency, "output_tok_s": output_tok_s, "tpot_p50_ms": tpot, "ttft_p50_ms": 20.0,
            "ttft_p99_ms": 25.0, "tpot_p99_ms": tpot * 1.2, "itl_p99_ms": tpot * 1.3, "e2e_p99_ms": 900.0,
            "failed": failed, "completed": 16 - failed, "kv_peak": kv}


def test_gate2_passes_when_a_concurrency_pays_and_names_every_slice_when_none_does():
    policy = Policy()
    standard = [_row(1, 100.0, 10.0), _row(4, 300.0, 13.0)]
    gate = judge_gate2([_row(1, 150.0, 6.0), _row(4, 280.0, 14.0)], standard, policy)
    assert (gate.verdict, gate.reasons) == ("pass", [])
    assert [(s["concurrency"], s["pays"], s["faster_part"]) for s in gate.detail["slices"]] == [
        (1, True, "decode"), (4, False, "neither")]
    gate = judge_gate2([_row(1, 80.0, 12.0, failed=2), _row(4, 200.0, 20.0)], standard, policy)
    assert gate.verdict == "fail"
    assert gate.reasons[0] == ("concurrency 1: not faster: output 0.8x the baseline (decode 0.833x, first token 1x); "
                               "tpot p99 14.4 ms over the baseline's 12.0 ms by more than 10%, itl p99 15.6 ms over "
                               "the baseline's 13.0 ms by more than 10%, error rate 12.5% against the baseline's 0.0%")
    assert gate.reasons[1].startswith("concurrency 4: not faster: output 0.667x the baseline")


def test_the_dynamic_sd_table_turns_speculation_off_where_it_loses_and_vllm_accepts_it():
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    points = [SweepPoint("draft_model", d, c, tp, 1.0) for d, c, tp in (
        (0, 1, 100), (2, 1, 130), (4, 1, 150), (0, 4, 300), (2, 4, 320), (4, 4, 290), (0, 8, 500), (2, 8, 450))]
    table = dynamic_sd_table(points, "draft_model", 64)
    assert table == [[1, 1, 4], [2, 4, 2], [5, 64, 0]]
    assert validate_and_normalize_dynamic_sd_schedule(table) == [(1, 1, 4), (2, 4, 2), (5, 64, 0)]
    losing = [SweepPoint("draft_model", d, c, tp, 1.0) for d, c, tp in ((0, 1, 100), (3, 1, 60), (0, 4, 300), (3, 4, 90))]
    assert dynamic_sd_table(losing, "draft_model", 8) == [[1, 8, 0]]
    with pytest.raises(ValueError, match="no standard-decoding point at concurrency 1"):
        dynamic_sd_table([SweepPoint("draft_model", 2, 1, 5.0, 1.0)], "draft_model", 8)
    # G = 4 (32 heads, 8 KV heads): 128/G - 1 = 31 and the tile boundaries 31, 63, with neighbours
    assert draft_length_candidates(4, 4, 64) == [3, 4, 5, 30, 31, 32, 62, 63, 64]


CARD = BundleCard(target=TargetCard(model_id="m", revision="r1"), drafter=DrafterCard(mechanism="ngram", draft_length=3))


def _qualification(card=CARD, gate1="pass", gate2="pass", ts=100.0):
    return Qualification.for_card(card, ts=ts, gate1=GateResult(verdict=gate1, reasons=[] if gate1 == "pass"
                                                                   else ["a (coding): greedy output diverges at token 2"]),
                                  gate2=GateResult(verdict=gate2), cost={"engine_starts": 2})


def test_a_qualification_is_archived_under_its_card_and_bundles_show_prints_it(tmp_path, capsys):
    dsn = f"chdb://{tmp_path / 'archive'}"
    with Archive.open(dsn) as archive:
        archive.write_qualification(json.loads(_qualification(gate1="fail").model_dump_json()))
        archive.write_qualification(json.loads(_qualification(ts=200.0).model_dump_json()))
        rows = archive.qualifications(bundle_digest(CARD))
        assert [r["verdict"] for r in rows] == ["fail", "pass"] and archive.qualifications("b-other") == []
    page = tmp_path / "q.html"
    assert main(["bundles", "show", bundle_digest(CARD), "--archive", dsn, "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"bundle {bundle_digest(CARD)}: not judged (admission off)\n")
    assert f"\nqualification of {bundle_digest(CARD)}: PASS (ngram, D = 3)\n" in out
    assert "2 qualification run(s) of this card" in out
    assert 'data-verdict="pass"' in page.read_text()
    assert main(["bundles", "show", "b-0000000000000000", "--archive", dsn]) == 1
    assert capsys.readouterr().err == "specwatch bundles: no bundle b-0000000000000000 in the archive\n"


def _entered(controller, bundle_id, card):
    from specwatch.schemas.slice_stats import SliceStats

    controller.seen(bundle_id, card, 10.0)
    return controller.observe(bundle_id, None, None, SliceStats(), 11.0, speculating=True)


def test_admission_with_require_qualification_refuses_shadow_to_an_unqualified_card_and_names_why():
    policy = Policy.model_validate({"admission": {"enforce": True, "require_qualification": True}})
    card = CARD.model_dump(mode="json")
    bundle = bundle_digest(CARD)
    controller = AdmissionController(policy)
    [unadmitted] = _entered(controller, bundle, card)
    assert (unadmitted.action, unadmitted.reason, unadmitted.evidence["stage"]) == (
        "disable_speculation", "unadmitted_bundle", "unadmitted")
    assert unadmitted.evidence["qualification"] == "missing"
    assert unadmitted.evidence["shadow_refused"].startswith("no qualification of this card")
    # a passing qualification arriving later starts it in shadow
    [shadow] = controller.qualified(bundle, {"verdict": "pass", "qualification_id": "q-1"}, 20.0)
    assert (shadow.action, shadow.evidence["stage"], shadow.evidence["qualification_id"]) == ("promote", "shadow", "q-1")
    # a failed one keeps it out, with the failing findings
    failed = AdmissionController(policy, {bundle: {"verdict": "fail", "qualification_id": "q-2",
                                                   "reasons": ["gate 2: concurrency 1: not faster"]}})
    [decision] = _entered(failed, bundle, card)
    assert decision.evidence["shadow_refused"] == "its qualification q-2 failed"
    assert decision.evidence["qualification_reasons"] == ["gate 2: concurrency 1: not faster"]
    # qualified: shadow at once
    qualified = AdmissionController(policy, {bundle: {"verdict": "pass", "qualification_id": "q-3"}})
    assert [d.evidence["stage"] for d in _entered(qualified, bundle, card)] == ["unadmitted", "shadow"]
    # the card changes (another target revision): the qualification was of the old card
    changed = CARD.model_copy(update={"target": TargetCard(model_id="m", revision="r2")})
    [again] = _entered(qualified, bundle_digest(changed), changed.model_dump(mode="json"))
    assert again.evidence["qualification"] == "missing" and again.evidence["stage"] == "unadmitted"


def test_admission_without_the_switch_decides_as_before():
    card = CARD.model_dump(mode="json")
    off = Policy.model_validate({"admission": {"enforce": True}})
    assert Policy().admission.require_qualification is False
    decisions = _entered(AdmissionController(off), bundle_digest(CARD), card)
    assert [(d.action, d.evidence["stage"]) for d in decisions] == [("disable_speculation", "unadmitted"),
                                                                   ("promote", "shadow")]
    assert "shadow_refused" not in decisions[0].evidence
    # a failed qualification changes nothing while the switch is off
    with_failed = AdmissionController(off, {bundle_digest(CARD): {"verdict": "fail"}})
    assert [d.model_dump() for d in _entered(with_failed, bundle_digest(CARD), card)] == [
        d.model_dump() for d in decisions]


def test_the_sweep_draws_a_pareto_front_per_bucket_from_each_load_runs_requests():
    from specwatch.analysis.qualification import render_html, render_text
    from specwatch.qualify.gate2 import bucket_rows
    from specwatch.qualify.procedure import QualifyPlan, _sweep_report

    # one load run: per request its bucket, output tokens, latency and TTFT (seconds); one failed request
    run = {"buckets": ["coding", "chat", "coding", "chat"], "output_lens": [33, 9, 33, 0],
           "latencies": [1.0, 0.5, 1.2, 0.0], "ttfts": [0.04, 0.02, 0.06, 0.0], "errors": ["", "", "", "timeout"]}
    rows = bucket_rows(run, 2)
    assert rows == {"chat": {"requests": 1, "output_tok_s": 36.0, "tpot_p50_ms": 60.0, "tpot_p99_ms": 60.0,
                             "ttft_p99_ms": 20.0, "e2e_p99_ms": 500.0},
                    "coding": {"requests": 2, "output_tok_s": 60.0, "tpot_p50_ms": 32.8125, "tpot_p99_ms": 35.5688,
                               "ttft_p99_ms": 59.8, "e2e_p99_ms": 1198.0}}
    # coding pays with D = 3 at concurrency 1 (faster on both axes); chat is better off without speculation
    points = [SweepPoint("standard", 0, 1, 100.0, 20.0), SweepPoint("draft_model", 3, 1, 90.0, 22.0),
              SweepPoint("standard", 0, 1, 50.0, 10.0, bucket="coding"),
              SweepPoint("draft_model", 3, 1, 70.0, 14.0, bucket="coding"),
              SweepPoint("standard", 0, 1, 40.0, 30.0, bucket="chat"),
              SweepPoint("draft_model", 3, 1, 30.0, 25.0, bucket="chat"),
              SweepPoint("draft_model", 3, 4, 45.0, 12.0, bucket="chat")]
    sweep = _sweep_report(points, "draft_model", QualifyPlan(max_batch_size=8))
    assert {b: [(p["mechanism"], p["draft_length"], p["concurrency"]) for p in front]
            for b, front in sweep["pareto_by_bucket"].items()} == {
        "chat": [("standard", 0, 1), ("draft_model", 3, 4)], "coding": [("draft_model", 3, 1)]}
    assert [(p["mechanism"], p["draft_length"]) for p in sweep["pareto"]["1"]] == [("draft_model", 3), ("standard", 0)]
    assert len(sweep["points"]) == 2 and len(sweep["bucket_points"]) == 5  # the table reads whole-load points only
    assert sweep["dynamic_sd"]["table"] == [[1, 8, 0]]
    report = {"bundle_id": "b-1", "verdict": "fail", "card": {"drafter": {"mechanism": "draft_model", "draft_length": 3}},
              "gate1": {"verdict": "pass", "reasons": [], "detail": {}},
              "gate2": {"verdict": "fail", "reasons": [], "detail": {}}, "sweep": sweep}
    text = render_text(report)
    assert "    chat           standard D=0 c=1 40/30, draft_model D=3 c=4 45/12\n" in text
    assert "    coding         draft_model D=3 c=1 70/14\n" in text
    assert 'id="pareto-by-bucket"' in render_html(report)


def test_tune_starts_from_a_qualifications_per_position_acceptance(tmp_path, capsys):
    card = BundleCard(target=TargetCard(model_id="m", revision="r1"),
                      drafter=DrafterCard(mechanism="external", draft_length=3))
    acceptance = {"coding": {"accepted_at_least": [900, 700, 400], "drafted_at_least": [1000, 1000, 1000]},
                  "chat": {"accepted_at_least": [300, 60, 10], "drafted_at_least": [1000, 1000, 1000]}}
    # concurrency 1: a standard step 10 ms; a speculative step TPOT 5 ms x AL 3 = 15 ms, so a drafted token costs 5/3 ms
    ledger = {"standard": [{"concurrency": 1, "tpot_p50_ms": 10.0}],
              "speculative": [{"concurrency": 1, "tpot_p50_ms": 5.0, "acceptance_length": 3.0}]}
    qualification = Qualification.for_card(card, ts=100.0, gate1=GateResult(verdict="pass", detail={"acceptance": acceptance}),
                                           gate2=GateResult(verdict="pass", detail=ledger))
    path = tmp_path / "q.json"
    path.write_text(qualification.model_dump_json())
    assert main(["tune", "--from-qualification", str(path), "--json", "--heads-per-kv", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bundle_id"] == bundle_digest(card) and report["source"]["verdict"] == "pass"
    buckets = {b["bucket"]: b for b in report["buckets"]}
    assert [p["acceptance_length"] for p in buckets["coding"]["curve"]] == [1.9, 2.6, 3.0]
    assert [round(p["speedup"], 3) for p in buckets["coding"]["curve"]] == [1.629, 1.95, 2.0]
    assert (buckets["coding"]["best_d"], buckets["chat"]["best_d"], buckets["coding"]["current_d"]) == (3, 1, 3)
    assert report["step_cost"]["draft_fit"] == "qualification_ledger" and report["starting_draft_length"] == 15
    # the same from the archive, by the card's bundle id
    dsn = f"chdb://{tmp_path / 'archive'}"
    with Archive.open(dsn) as archive:
        archive.write_qualification(json.loads(qualification.model_dump_json()))
    assert main(["tune", "--from-qualification", bundle_digest(card), "--archive", dsn]) == 0
    out = capsys.readouterr().out
    assert "from the qualification of 1970-01-01 00:01:40 UTC (pass)" in out and "\ncoding: best D 3, current D 3" in out
    assert main(["tune", "--from-qualification", "b-0000000000000000", "--archive", dsn]) == 2
    assert "b-0000000000000000: neither a file nor a bundle with an archived qualification" in capsys.readouterr().err
