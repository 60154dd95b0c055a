"""Kafka has one boundary: transport/ imports only the contract, and the partition runner no Faust.

Read from the source (the AST, imports inside functions included), so a late import cannot hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = {"transport": "specwatch.transport", "collectors": "specwatch.collectors",
             "actions": "specwatch.actions", "streams": "specwatch.streams"}


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = _PACKAGES[path.relative_to(_ROOT).parts[0]]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            found.add(f"{base}.{node.module}" if base and node.module else base or node.module)
    return found


def _files(folder: str) -> list[Path]:
    return sorted((_ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _files("transport"), ids=lambda p: p.name)
def test_transport_imports_only_the_contract_and_itself(path):
    ours = {name for name in _imports(path) if name.startswith("specwatch")}
    assert all(name.startswith(("specwatch.schemas", "specwatch.transport")) for name in ours), ours


def test_actions_and_collectors_do_not_import_each_other_for_kafka():
    for path in _files("actions"):
        assert not [n for n in _imports(path) if n.startswith("specwatch.collectors")], path
    for path in _files("collectors"):
        # the flag state engines keep is the actions' pure FlagStore; nothing else of actions/
        assert {n for n in _imports(path) if n.startswith("specwatch.actions")} <= {"specwatch.actions.flags"}, path


def test_the_partition_runner_runs_without_faust():
    names = _imports(_ROOT / "streams" / "runner.py")
    assert not [n for n in names if n.split(".")[0] in ("faust", "mode", "aiokafka")], names
