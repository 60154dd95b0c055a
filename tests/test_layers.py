"""Imports point only down the pipeline: a module imports its own layer (`LAYERS`) and those below,
never one above, and packages that share a layer never import each other. The product (all but
the lab, `LAB`) keeps its modules and functions short and imports no other module's private names."""

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
    ("specwatch.gateway", 6),
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


def _import_source(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` reads from, relative imports resolved against ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path) -> set[str]:
    """The product modules ``path`` imports, by ``ast``: a lazy import is a dependency too."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            name = _import_source(node, package)
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
    tree = ast.parse((ROOT / "streams" / "partition_runner.py").read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not [name for name in names if name.split(".")[0] in ("faust", "mode", "aiokafka")], names


def test_imports_point_only_down_the_pipeline():
    modules = _modules()
    assert "specwatch.streams.merge" in modules and "specwatch.schemas.contract" in modules
    assert _violations() == []  # which places every module (`_layer` raises where no layer fits)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule itself: a schema importing a stream is reported."""
    folder = tmp_path / "schemas"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "bad.py").write_text("from specwatch.streams.merge import Stage2\n")
    (tmp_path / "streams").mkdir()
    (tmp_path / "streams" / "__init__.py").write_text("")
    (tmp_path / "streams" / "merge.py").write_text("from ..schemas import bad\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "specwatch.schemas" = "schemas", "specwatch.streams" = "streams" }\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _violations() == [
        "specwatch.schemas.bad imports specwatch.streams.merge (specwatch.streams is not below specwatch.schemas)"]


# ---------------------------------------------------------------- one place builds Kafka clients
KAFKA_CLIENTS = frozenset({"KafkaProducer", "KafkaConsumer", "KafkaAdminClient",
                           "AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient"})


def _kafka_clients_built() -> list[str]:
    """Each import or call of a Kafka client class in a module other than specwatch.transport.clients,
    by place; transport/clients.py builds them all, so their settings live in one place."""
    found = []
    for module, path in sorted(_modules().items()):
        if module == "specwatch.transport.clients":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name.rpartition(".")[2] for alias in node.names]
            elif isinstance(node, ast.Call):
                func = node.func
                names = [func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")]
            else:
                continue
            found += [f"{_where(path, node.lineno)} {'calls' if isinstance(node, ast.Call) else 'imports'} {name}"
                      for name in names if name in KAFKA_CLIENTS]
    return found


def test_no_module_but_transport_clients_builds_a_kafka_client():
    rule = "no module but specwatch.transport.clients builds a Kafka client (use its builders)"
    assert [f"{rule}: {place}" for place in _kafka_clients_built()] == []


def test_the_kafka_client_rule_sees_an_offender(tmp_path, monkeypatch):
    """The rule itself: an import and a call of a Kafka client outside transport/clients.py are
    reported by place, in transport/ too; the same in transport/clients.py are not."""
    for folder, text in (("bench", "from kafka import KafkaConsumer\nimport aiokafka\n"
                                   "c = aiokafka.AIOKafkaProducer()\n"),
                         ("transport", "from aiokafka.admin import AIOKafkaAdminClient\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
        (tmp_path / folder / "clients.py").write_text(text)
    (tmp_path / "transport" / "kafka_io.py").write_text("import aiokafka\nr = aiokafka.AIOKafkaConsumer()\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "specwatch.bench" = "bench", "specwatch.transport" = "transport" }\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _kafka_clients_built() == ["bench/clients.py:1 imports KafkaConsumer",
                                      "bench/clients.py:3 calls AIOKafkaProducer",
                                      "transport/kafka_io.py:2 calls AIOKafkaConsumer"]


# ---------------------------------------------------------------- the product's size and surface
# The product is every module but the lab around it: the simulator, the benchmarks, the detection
# evaluation, and the vLLM demo and the tiny models that tests and demos run on.
LAB: tuple[str, ...] = (
    "specwatch.simulation",
    "specwatch.bench",
    "specwatch.evaluation",
    "specwatch.collectors.vllm.demo",
    "specwatch.collectors.vllm.tiny_models",
)
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# Today's offenders, each a place to split; the list only shrinks. A module or function that
# comes back under its limit must leave the list (the rule says so), and nothing new joins it.
LONG_MODULES: frozenset[str] = frozenset({
    "specwatch.schemas.fastdecode",
})
LONG_FUNCTIONS: frozenset[str] = frozenset({
    "specwatch.streams.faust_app:create_app",
})
PRIVATE_IMPORTS: frozenset[str] = frozenset()


def _in_lab(module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in LAB)


def _product() -> dict[str, Path]:
    return {module: path for module, path in _modules().items() if not _in_lab(module)}


def _where(path: Path, line: int | None = None) -> str:
    place = path.relative_to(ROOT).as_posix()
    return place if line is None else f"{place}:{line}"


def _long_modules() -> dict[str, str]:
    """Product modules over MAX_MODULE_LINES: module -> what the failure message says."""
    found = {}
    for module, path in _product().items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            found[module] = f"{_where(path)} has {lines} lines"
    return found


def _long_functions() -> dict[str, str]:
    """Product functions and methods over MAX_FUNCTION_LINES: ``module:Class.function`` -> message."""
    found = {}
    for module, path in _product().items():
        tree = ast.parse(path.read_text(), str(path))

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = prefix + child.name
                    lines = child.end_lineno - child.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found[f"{module}:{name}"] = f"{_where(path, child.lineno)} {name} has {lines} lines"
                    visit(child, name + ".")
                elif isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")

        visit(tree, "")
    return found


def _private_imports() -> dict[str, str]:
    """``from x import _name`` of another product module: ``module imports x._name`` -> message."""
    modules = _modules()
    found = {}
    for module, path in _product().items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _import_source(node, package)
            if source not in modules or source == module:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found[f"{module} imports {source}.{alias.name}"] = (
                        f"{_where(path, node.lineno)} imports the private name {alias.name} of {source}")
    return found


def _check(rule: str, found: dict[str, str], allowed: frozenset[str], allowlist: str) -> list[str]:
    """What breaks ``rule``: offenders not allowed, and allowed ones that no longer offend."""
    wrong = [f"{rule}: {found[key]}" for key in sorted(set(found) - allowed)]
    wrong += [f"{rule}: {key} keeps to it now; take it off {allowlist}" for key in sorted(allowed - set(found))]
    return wrong


def test_no_product_module_is_over_600_lines():
    assert _check(f"no product module over {MAX_MODULE_LINES} lines", _long_modules(), LONG_MODULES,
                  "LONG_MODULES") == []


def test_no_product_function_is_over_80_lines():
    assert _check(f"no product function over {MAX_FUNCTION_LINES} lines", _long_functions(), LONG_FUNCTIONS,
                  "LONG_FUNCTIONS") == []


def test_no_private_name_is_imported_across_modules():
    assert _check("no private name imported across modules", _private_imports(), PRIVATE_IMPORTS,
                  "PRIVATE_IMPORTS") == []


def test_the_size_and_surface_rules_see_an_offender(tmp_path, monkeypatch):
    """The rules themselves: a long module, a long method and a private import are each reported, by place."""
    folder = tmp_path / "schemas"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (folder / "big.py").write_text("class Codec:\n    def decode(self):\n" + body + "\n" + "\n" * MAX_MODULE_LINES)
    (folder / "user.py").write_text("from .big import _hidden\n")
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "specwatch.schemas" = "schemas" }\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    lines = 2 + MAX_FUNCTION_LINES + MAX_MODULE_LINES
    assert _check("modules", _long_modules(), frozenset(), "LONG_MODULES") == [
        f"modules: schemas/big.py has {lines} lines"]
    assert _check("functions", _long_functions(), frozenset({"specwatch.schemas.gone:f"}), "LONG_FUNCTIONS") == [
        f"functions: schemas/big.py:2 Codec.decode has {MAX_FUNCTION_LINES + 1} lines",
        "functions: specwatch.schemas.gone:f keeps to it now; take it off LONG_FUNCTIONS"]
    assert _check("private", _private_imports(), frozenset(), "PRIVATE_IMPORTS") == [
        "private: schemas/user.py:1 imports the private name _hidden of specwatch.schemas.big"]
