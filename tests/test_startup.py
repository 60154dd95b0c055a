"""`specwatch replay` loads no library it does not use: a start-up is paid on every run.

Each check runs a fresh interpreter, so what earlier tests imported cannot hide an import.
"""

from __future__ import annotations

import json
import pkgutil

from specwatch.simulation.simulator import Simulator
from specwatch.schemas import encode_record

from machine import fresh_python

# Libraries a JSON Lines replay has no use for: plotting, stats tests, Kafka, Faust, the
# OpenTelemetry SDK and protobuf classes, the vLLM glue.
_NOT_FOR_REPLAY = ("scipy", "matplotlib", "faust", "aiokafka", "kafka", "vllm", "opentelemetry")

_REPLAY = """
import json, sys
from specwatch.cli import main
code = main(["replay", sys.argv[1], "--output", sys.argv[2], "--json"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in set(sys.argv[3].split(",")))
print(json.dumps({"code": code, "heavy": heavy}))
"""


def _replay_in_fresh_python(tmp_path, sim: Simulator) -> tuple[dict, dict, list[str]]:
    """(replay summary, {code, heavy modules loaded}, actions of the decisions written)."""
    telemetry, decisions = tmp_path / "telemetry.jsonl", tmp_path / "decisions.jsonl"
    telemetry.write_text("".join(encode_record(record) + "\n" for record in sim.records()))
    summary_line, result_line = fresh_python(_REPLAY, telemetry, decisions, ",".join(_NOT_FOR_REPLAY)).splitlines()
    actions = [json.loads(line)["action"] for line in decisions.read_text().splitlines()]
    return json.loads(summary_line), json.loads(result_line), actions


def test_replay_of_a_small_file_imports_none_of_the_other_commands_libraries(tmp_path):
    """Every detector runs on every key (ADWIN included); no plotting, Kafka, Faust, OTel or scipy."""
    summary, result, actions = _replay_in_fresh_python(tmp_path, Simulator("healthy", seed=3, minutes=1, workers=2))
    assert (result["code"], summary["records"], summary["rejected"], actions) == (0, 9362, 0, [])
    assert result["heavy"] == []


def test_replay_that_fits_a_draft_length_loads_scipy_and_nothing_else(tmp_path):
    """Lowering D fits the step-cost model (scipy's Theil-Sen and least squares): that replay
    needs scipy, and still none of the others."""
    sim = Simulator("acceptance_drop", seed=7, minutes=3, workers=2, incident_at=70)
    summary, result, actions = _replay_in_fresh_python(tmp_path, sim)
    assert (result["code"], summary["records"], summary["rejected"]) == (0, 26708, 0)
    assert actions == ["reduce_draft_length", "disable_speculation"]
    assert {name.split(".")[0] for name in result["heavy"]} == {"scipy"}


def test_the_command_line_parser_imports_no_command_dependencies():
    """`specwatch --help` and argument parsing build every subcommand's parser without its libraries."""
    script = ("import json, sys\nfrom specwatch.cli import build_parser\nbuild_parser()\n"
              "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = set(json.loads(fresh_python(script)))
    assert loaded & {*_NOT_FOR_REPLAY, "pydantic", "numpy", "pyarrow", "chdb", "clickhouse_connect", "river"} == set()


def test_the_command_list_loads_no_command_module_and_a_command_loads_only_its_own():
    """`specwatch --help` is the table in `specwatch.cli`; `specwatch replay` builds only replay's arguments."""
    script = ("import json, sys\nfrom specwatch.cli import build_parser\nbuild_parser(sys.argv[1:])\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.startswith('specwatch.commands.'))))")
    assert json.loads(fresh_python(script, "--help")) == ["specwatch.commands._arguments"]
    assert json.loads(fresh_python(script, "-v", "replay", "x.jsonl")) == ["specwatch.commands._arguments",
                                                                         "specwatch.commands.replay"]


def test_every_command_in_the_table_has_a_module_that_builds_and_runs_it():
    from specwatch import commands
    from specwatch.cli import COMMANDS, build_parser

    modules = sorted(m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_"))
    assert list(COMMANDS) == modules
    parser = build_parser()
    assert parser.parse_args(["replay", "in.jsonl", "-o", "out.jsonl"]).func.__module__ == "specwatch.commands.replay"
    assert parser.parse_args(["query", "bundles"]).func.__name__ == "_bundles"
