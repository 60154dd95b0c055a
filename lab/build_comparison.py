"""Two builds of specwatch on the same inputs, their outputs compared byte for byte: the decisions
a replay writes for every scenario, `evaluate --quick` and the demo's, for a restructure that must change none."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

__all__ = ["compare_builds", "main"]

# what differs between two runs of one build: wall time, and paths under each build's own folder
_RUN_FIELDS = frozenset({"seconds", "elapsed", "elapsed_s", "wall_s", "wall_seconds", "cpu_s", "outdir", "archive",
                         "timeline", "picture", "started", "finished", "date", "load"})


def _run(specwatch: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([specwatch, *args], cwd=cwd, capture_output=True, text=True, check=False)


def _scenarios(specwatch: str, cwd: Path) -> list[str]:
    listed = _run(specwatch, "simulate", "--list", cwd=cwd).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _without_run_fields(value):
    """``value`` (parsed JSON) without the fields that differ between two runs of one build."""
    if isinstance(value, dict):
        return {k: _without_run_fields(v) for k, v in value.items() if k not in _RUN_FIELDS}
    if isinstance(value, list):
        return [_without_run_fields(v) for v in value]
    return value


def _differences(base, head, path: str = "") -> list[str]:
    """Where two parsed JSON values differ, by path (at most the first few of a long list)."""
    if isinstance(base, dict) and isinstance(head, dict):
        return [d for key in sorted(set(base) | set(head), key=str)
                for d in _differences(base.get(key), head.get(key), f"{path}.{key}")]
    if isinstance(base, list) and isinstance(head, list) and len(base) == len(head):
        return [d for i, (b, h) in enumerate(zip(base, head)) for d in _differences(b, h, f"{path}[{i}]")]
    return [] if base == head else [f"{path}: {json.dumps(base)[:120]} != {json.dumps(head)[:120]}"]


def _replays(base: str, head: str, workdir: Path, minutes: float | None, workers: int) -> dict[str, str]:
    """Each scenario simulated once (by the head build, seed 7), replayed by both builds: 'same' or what differs."""
    found = {}
    for scenario in _scenarios(head, workdir):
        telemetry = workdir / f"{scenario}.jsonl"
        extra = ["--workers", str(workers), *(["--minutes", str(minutes)] if minutes else [])]
        _run(head, "simulate", "--scenario", scenario, "--seed", "7", "-o", str(telemetry), *extra, cwd=workdir)
        outputs = []
        for name, specwatch in (("base", base), ("head", head)):
            out = workdir / f"{scenario}.{name}.decisions.jsonl"
            done = _run(specwatch, "replay", str(telemetry), "-o", str(out), cwd=workdir)
            outputs.append(out.read_bytes() if done.returncode == 0 else f"exit {done.returncode}".encode())
        base_lines, head_lines = (output.count(b"\n") for output in outputs)
        found[scenario] = (f"same ({base_lines} decisions)" if outputs[0] == outputs[1]
                           else f"differ (base {base_lines}, head {head_lines} lines)")
    return found


def _json_runs(base: str, head: str, workdir: Path, args: list[str]) -> list[str]:
    """One command with --json on both builds: its parsed output's differences, run fields left out."""
    parsed = []
    for name, specwatch in (("base", base), ("head", head)):
        folder = workdir / name
        folder.mkdir(parents=True, exist_ok=True)
        done = _run(specwatch, *args, "--json", cwd=folder)
        if done.returncode != 0:
            return [f"{name} exited {done.returncode}: {done.stderr[-400:]}"]
        parsed.append(_without_run_fields(json.loads(done.stdout.strip().splitlines()[-1])))
    return _differences(*parsed)


def compare_builds(base: str, head: str, workdir: Path, minutes: float | None = None, workers: int = 8,
                   evaluate: bool = True, demo: bool = True) -> dict:
    """The comparison's report: per scenario replayed, and the differences of evaluate and demo."""
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict = {"replay": _replays(base, head, workdir, minutes, workers)}
    if demo:
        report["demo"] = _json_runs(base, head, workdir / "demo", ["demo", "--no-archive", "--seed", "7"])
    if evaluate:
        report["evaluate"] = _json_runs(base, head, workdir / "evaluate", ["evaluate", "--quick"])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", required=True, help="the specwatch command of the build before")
    parser.add_argument("--head", required=True, help="the specwatch command of the build after")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--minutes", type=float, help="simulated minutes of each scenario (default: its own)")
    parser.add_argument("--workers", type=int, default=8, help="engine workers of each simulated fleet")
    parser.add_argument("--no-evaluate", action="store_true")
    parser.add_argument("--no-demo", action="store_true")
    args = parser.parse_args(argv)
    report = compare_builds(args.base, args.head, args.workdir, args.minutes, args.workers, not args.no_evaluate,
                            not args.no_demo)
    json.dump(report, sys.stdout, indent=1)
    print()
    same = all(v.startswith("same") for v in report["replay"].values()) and not any(
        report.get(part) for part in ("demo", "evaluate"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
