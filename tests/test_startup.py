"""`specwatch replay` loads no library it does not use: a start-up is paid on every run.

Each check runs a fresh interpreter, so what earlier tests imported cannot hide an import.
"""

from __future__ import annotations

import json
import pkgutil

import pytest

from specwatch.lab.simulation.simulator import Simulator
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


@pytest.mark.parametrize("scenario, seed, minutes, incident_at, records, actions, heavy", [
    ("healthy", 3, 1, None, 9362, [], set()),
    # lowering D fits the step-cost model (scipy's Theil-Sen and least squares): it needs scipy
    ("acceptance_drop", 7, 3, 70, 26708, ["reduce_draft_length", "disable_speculation"], {"scipy"}),
])
def test_replay_imports_none_of_the_other_commands_libraries(tmp_path, scenario, seed, minutes,
                                                             incident_at, records, actions, heavy):
    """Every detector runs on every key (ADWIN included); no plotting, Kafka, Faust, OTel, nor scipy
    unless a draft length is fitted."""
    sim = Simulator(scenario, seed=seed, minutes=minutes, workers=2, incident_at=incident_at)
    telemetry, decisions = tmp_path / "telemetry.jsonl", tmp_path / "decisions.jsonl"
    telemetry.write_text("".join(encode_record(record) + "\n" for record in sim.records()))
    summary, result = map(json.loads, fresh_python(_REPLAY, telemetry, decisions,
                                                   ",".join(_NOT_FOR_REPLAY)).splitlines())
    assert (result["code"], summary["records"], summary["rejected"]) == (0, records, 0)
    assert [json.loads(line)["action"] for line in decisions.read_text().splitlines()] == actions
    assert {name.split(".")[0] for name in result["heavy"]} == heavy


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
