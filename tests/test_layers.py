"""Imports point only down the pipeline: a module imports its own layer (`LAYERS`) and those below,
never one above, and packages that share a layer never import each other. The lab (`LAB`) sits
above the product and the command line above both; the product never imports the lab, keeps its
modules and functions short, and no module reads another's private names."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (package prefix, layer); the longest matching prefix places a module. Layers 0-6 are the product
# (`specwatch` itself: analysis and the figures' output), 7 the lab around it, 8-9 the command line.
LAYERS: tuple[tuple[str, int], ...] = (
    ("specwatch.schemas", 0),
    ("specwatch.detectors", 1),
    ("specwatch.actions", 2),
    ("specwatch.archive", 3),
    ("specwatch.transport", 3),
    ("specwatch.collectors", 4),
    ("specwatch.actions.sinks", 4),
    ("specwatch.streams", 5),
    ("specwatch.engines", 5),
    ("specwatch", 6),
    ("specwatch.gateway", 6),
    ("specwatch.qualify", 6),
    ("specwatch.lab", 7),
    ("specwatch.commands", 8),
    ("specwatch.cli", 9),
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


def _imports_by_line(module: str, path: Path) -> dict[str, int]:
    """The specwatch modules ``path`` imports, each with the line of its first import, by ``ast``:
    a lazy import is a dependency too."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = _import_source(node, package)
            # `from specwatch.x import y` may import the submodule y
            names = [name, *(f"{name}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if (name == "specwatch" or name.startswith("specwatch.")) and node.lineno < found.get(name, node.lineno + 1):
                found[name] = node.lineno
    return found


def _violations() -> list[str]:
    modules = _modules()
    wrong: list[str] = []
    for module, path in sorted(modules.items()):
        own_prefix, own = _layer(module)
        for target, line in sorted(_imports_by_line(module, path).items()):
            if target not in modules:
                continue  # a name inside a module, not a module
            prefix, layer = _layer(target)
            if layer > own or (layer == own and prefix != own_prefix and own_prefix != "specwatch"):
                wrong.append(f"imports point down the pipeline: {_where(path, line)} {module} imports {target} "
                             f"({prefix} is not below {own_prefix})")
    return wrong


def _lab_imports() -> list[str]:
    """Each import of the lab by a product module, by place."""
    modules = _modules()
    return [f"the product never imports the lab: {_where(path, line)} {module} imports {target}"
            for module, path in sorted(modules.items()) if not _in_lab(module) and not _in_cli(module)
            for target, line in sorted(_imports_by_line(module, path).items())
            if target in modules and _in_lab(target)]


def test_kafka_is_one_boundary_that_knows_only_the_contract():
    """transport/ may import the contract and itself, nothing else of the product."""
    modules = _modules()
    rule = "transport/ imports only the contract (schemas/) and itself"
    assert [f"{rule}: {_where(path, line)} {module} imports {target}"
            for module, path in sorted(modules.items()) if module.startswith("specwatch.transport")
            for target, line in sorted(_imports_by_line(module, path).items())
            if target in modules and not target.startswith(("specwatch.schemas", "specwatch.transport"))] == []


def test_the_partition_runner_runs_without_faust():
    tree = ast.parse((ROOT / "streams" / "partition_runner.py").read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not [name for name in names if name.split(".")[0] in ("faust", "mode", "aiokafka")], names


def test_imports_point_only_down_the_pipeline():
    modules = _modules()
    assert "specwatch.streams.merge" in modules and "specwatch.schemas.contract" in modules
    assert _violations() == []  # which places every module (`_layer` raises where no layer fits)


def test_the_lab_sits_above_the_product_and_the_command_line_above_both():
    """Every product layer is below the lab's, and the lab's below the command line's."""
    layers = dict(LAYERS)
    lab, cli = layers[LAB[0]], min(layers[prefix] for prefix in CLI)
    product = {prefix: layer for prefix, layer in LAYERS if prefix not in (*LAB, *CLI)}
    assert {prefix: layer for prefix, layer in product.items() if layer >= lab} == {}
    assert lab < cli


def test_the_product_never_imports_the_lab():
    assert _lab_imports() == []


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
        "imports point down the pipeline: schemas/bad.py:1 specwatch.schemas.bad imports specwatch.streams.merge "
        "(specwatch.streams is not below specwatch.schemas)"]


def test_the_check_sees_the_product_import_the_lab(tmp_path, monkeypatch):
    """The rule itself: a gateway module reading the simulator is reported by place; the command line
    importing the lab is not."""
    for folder, text in (("gateway", "import os\nfrom specwatch.lab.simulation import simulator\n"),
                         ("lab/simulation", ""), ("specwatch/commands", "from specwatch.lab.simulation import simulator\n")):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
        (tmp_path / folder / "simulator.py").write_text(text)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "specwatch" = "specwatch", "specwatch.gateway" = "gateway", '
        '"specwatch.lab" = "lab" }\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _lab_imports() == [
        "the product never imports the lab: gateway/simulator.py:2 specwatch.gateway.simulator imports "
        "specwatch.lab.simulation",
        "the product never imports the lab: gateway/simulator.py:2 specwatch.gateway.simulator imports "
        "specwatch.lab.simulation.simulator"]


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
        '[tool.setuptools]\npackage-dir = { "specwatch.lab.bench" = "bench", "specwatch.transport" = "transport" }\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _kafka_clients_built() == ["bench/clients.py:1 imports KafkaConsumer",
                                      "bench/clients.py:3 calls AIOKafkaProducer",
                                      "transport/kafka_io.py:2 calls AIOKafkaConsumer"]


# ---------------------------------------------------------------- the product's size and surface
# The product is every module but the lab around it (lab/: the simulator, the benchmarks, the
# detection evaluation, the vLLM demo and the tiny models that tests and demos run on) and the
# command line above both.
LAB: tuple[str, ...] = ("specwatch.lab",)
CLI: tuple[str, ...] = ("specwatch.commands", "specwatch.cli")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# Today's offenders, each a place to split; the list only shrinks. A module or function that
# comes back under its limit must leave the list (the rule says so), and nothing new joins it.
LONG_MODULES: frozenset[str] = frozenset()
LONG_FUNCTIONS: frozenset[str] = frozenset()
PRIVATE_IMPORTS: frozenset[str] = frozenset()


def _in_lab(module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in LAB)


def _in_cli(module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in CLI)


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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports() -> dict[str, str]:
    """Another module's private name read by any module, the lab's and the command line's too: by
    ``from x import _name`` (``module imports x._name`` -> message), or as ``alias._name`` of a module
    imported under a name (``module reads x._name`` -> message)."""
    modules = _modules()
    found = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # a local name -> the module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({alias.asname: alias.name for alias in node.names
                                if alias.asname and alias.name in modules})
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _import_source(node, package)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:  # a module, not a name inside one
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                elif source in modules and source != module and _private(alias.name):
                    found[f"{module} imports {source}.{alias.name}"] = (
                        f"{_where(path, node.lineno)} imports the private name {alias.name} of {source}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr)
                    and aliases.get(node.value.id, module) != module):
                source = aliases[node.value.id]
                found.setdefault(f"{module} reads {source}.{node.attr}",
                                 f"{_where(path, node.lineno)} reads the private name {node.attr} of {source}")
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
    """The rules themselves: a long module, a long method, a private import and a private name read
    through a module alias are each reported, by place."""
    folder = tmp_path / "schemas"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (folder / "big.py").write_text("class Codec:\n    def decode(self):\n" + body + "\n" + "\n" * MAX_MODULE_LINES)
    (folder / "user.py").write_text("from .big import _hidden\n")
    (folder / "alias.py").write_text("from . import big as codec\nimport os\n\nlimit = codec._hidden + os._exit\n")
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "specwatch.schemas" = "schemas" }\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    lines = 2 + MAX_FUNCTION_LINES + MAX_MODULE_LINES
    assert _check("modules", _long_modules(), frozenset(), "LONG_MODULES") == [
        f"modules: schemas/big.py has {lines} lines"]
    assert _check("functions", _long_functions(), frozenset({"specwatch.schemas.gone:f"}), "LONG_FUNCTIONS") == [
        f"functions: schemas/big.py:2 Codec.decode has {MAX_FUNCTION_LINES + 1} lines",
        "functions: specwatch.schemas.gone:f keeps to it now; take it off LONG_FUNCTIONS"]
    assert _check("private", _private_imports(), frozenset(), "PRIVATE_IMPORTS") == [
        "private: schemas/alias.py:4 reads the private name _hidden of specwatch.schemas.big",
        "private: schemas/user.py:1 imports the private name _hidden of specwatch.schemas.big"]
