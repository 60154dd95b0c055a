"""The start-up section of `specwatch bench`: how long `specwatch replay` takes before its first record.

`specwatch replay` of a file with one record does nothing but start (interpreter, imports,
policy, pipeline) and stop, so its wall time is the start-up a replay of any file pays
first. Beside it, in the same run and alternated with it, a bare interpreter
(``python -c pass``): what no command can go below.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["run_startup_bench"]

_REPEATS = {"smoke": 1, "quick": 3, "full": 5}


def _one_record() -> str:
    """The first record of a simulated fleet (its bundle record) as a contract-v1 line."""
    from specwatch.schemas.codec import encode_record
    from specwatch.simulation.simulator import Simulator

    return encode_record(next(iter(Simulator("healthy", seed=17, minutes=0.05, workers=1).records())))


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - start


def run_startup_bench(quick: bool = False, smoke: bool = False) -> dict:
    """Least wall seconds of `specwatch replay` of one record and of a bare interpreter, alternated."""
    repeats = _REPEATS["smoke" if smoke else ("quick" if quick else "full")]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "one.jsonl"
        path.write_text(_one_record() + "\n")
        replay = [sys.executable, "-m", "specwatch.cli", "replay", str(path), "--output", str(Path(tmp) / "out.jsonl")]
        bare = [sys.executable, "-c", "pass"]
        replay_s, bare_s = [], []
        for turn in range(repeats):
            for name in (("replay", "bare") if turn % 2 == 0 else ("bare", "replay")):  # neither always second
                (replay_s if name == "replay" else bare_s).append(_wall(replay if name == "replay" else bare))
    return {"repeats": repeats, "replay_one_record_s": min(replay_s), "bare_interpreter_s": min(bare_s),
            "startup_over_bare_interpreter": min(replay_s) / min(bare_s)}
