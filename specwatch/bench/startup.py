"""The start-up section of `specwatch bench`: wall seconds of `specwatch replay` of one record,
alternated with a bare interpreter (``python -c pass``), what no command can go below."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specwatch.bench import alternated, timed

__all__ = ["run_startup_bench"]

_REPEATS = {"smoke": 1, "quick": 3, "full": 5}


def _one_record() -> str:
    """The first record of a simulated fleet (its bundle record) as a contract-v1 line."""
    from specwatch.schemas.codec import encode_record
    from specwatch.simulation.simulator import Simulator

    return encode_record(next(iter(Simulator("healthy", seed=17, minutes=0.05, workers=1).records())))


def _wall(argv: list[str]) -> float:
    return timed(lambda: subprocess.run(argv, check=True, capture_output=True),
                 clock=time.perf_counter)[0]


def run_startup_bench(quick: bool = False, smoke: bool = False) -> dict:
    """Least wall seconds of `specwatch replay` of one record and of a bare interpreter, alternated."""
    repeats = _REPEATS["smoke" if smoke else ("quick" if quick else "full")]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "one.jsonl"
        path.write_text(_one_record() + "\n")
        replay = [sys.executable, "-m", "specwatch.cli", "replay", str(path), "--output", str(Path(tmp) / "out.jsonl")]
        bare = [sys.executable, "-c", "pass"]
        runs = alternated({"replay": lambda: _wall(replay), "bare": lambda: _wall(bare)}, repeats)
    replay_s, bare_s = min(runs["replay"]), min(runs["bare"])
    return {"repeats": repeats, "replay_one_record_s": replay_s, "bare_interpreter_s": bare_s,
            "startup_over_bare_interpreter": replay_s / bare_s}
