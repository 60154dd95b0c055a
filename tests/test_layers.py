"""Imports point only down the pipeline: a module imports its own layer (`LAYERS`) and those below,
never one above, and packages that share a layer never import each other."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (package prefix, layer); the longest matching prefix places a module.
LAYERS: tuple[tuple[str, int], ...] = (
    ("specwatch.schemas", 0),
    ("specwatch.detectors", 1),
    ("specwatch.actions", 2),
    ("specwatch.archive", 3),
    ("specwatch.transport", 3),
    ("specwatch.collectors", 4),
    ("specwatch.actions.sinks", 4),
    ("specwatch.streams", 5),
    ("specwatch", 6),
    ("specwatch.qualify", 6),
)


def _package_dirs() -> dict[str, Path]:
    """Import package -> folder, as pyproject.toml maps them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in mapping.items()}


def _modules() -> dict[str, Path]:
    """Every module of the product by its import name."""
    dirs = _package_dirs()
    modules: dict[str, Path] = {}
    # the most specific folder names a file: walk the deepest mappings last
    for package, folder in sorted(dirs.items(), key=lambda item: len(item[0])):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _layer(module: str) -> tuple[str, int]:
    best = max((prefix for prefix, _ in LAYERS if module == prefix or module.startswith(prefix + ".")),
               key=len)
    return best, dict(LAYERS)[best]


def _imports(module: str, path: Path) -> set[str]:
    """The product modules ``path`` imports, by ``ast``: a lazy import is a dependency too."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            # `from specwatch.x import y` may import the submodule y
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "specwatch" or name.startswith("specwatch.")}


def _violations() -> list[str]:
    modules = _modules()
    wrong: list[str] = []
    for module, path in sorted(modules.items()):
        own_prefix, own = _layer(module)
        for target in sorted(_imports(module, path)):
            if target not in modules:
                continue  # a name inside a module, not a module
            prefix, layer = _layer(target)
            if layer > own or (layer == own and prefix != own_prefix and own_prefix != "specwatch"):
                wrong.append(f"{module} imports {target} ({prefix} is not below {own_prefix})")
    return wrong


def test_kafka_is_one_boundary_that_knows_only_the_contract():
    """transport/ may import the contract and itself, nothing else of the product."""
    modules = _modules()
    wrong = {module: sorted(target for target in _imports(module, path) if target in modules
                            and not target.startswith(("specwatch.schemas", "specwatch.transport")))
             for module, path in modules.items() if module.startswith("specwatch.transport")}
    assert {module: targets for module, targets in wrong.items() if targets} == {}


def test_the_partition_runner_runs_without_faust():
    tree = ast.parse((ROOT / "streams" / "runner.py").read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not [name for name in names if name.split(".")[0] in ("faust", "mode", "aiokafka")], names


def test_imports_point_only_down_the_pipeline():
    modules = _modules()
    assert "specwatch.streams.topology" in modules and "specwatch.schemas.contract" in modules
    assert _violations() == []  # which places every module (`_layer` raises where no layer fits)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule itself: a schema importing a stream is reported."""
    folder = tmp_path / "schemas"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "bad.py").write_text("from specwatch.streams.topology import Stage1\n")
    (tmp_path / "streams").mkdir()
    (tmp_path / "streams" / "__init__.py").write_text("")
    (tmp_path / "streams" / "topology.py").write_text("from ..schemas import bad\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "specwatch.schemas" = "schemas", "specwatch.streams" = "streams" }\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _violations() == [
        "specwatch.schemas.bad imports specwatch.streams.topology (specwatch.streams is not below specwatch.schemas)"]
