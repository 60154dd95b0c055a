"""Runs every doctest example in the installed specwatch packages."""

import doctest
import importlib
import pkgutil

import pytest

import specwatch

# need vllm importable; covered by their own tests
_SKIP_PREFIXES = ("specwatch.collectors.vllm", "specwatch.engines.vllm", "specwatch.lab.demo")


# The architecture folders are mapped into the namespace by the installer, so each
# is walked on its own (walk_packages does not see mapped subpackages).
_PACKAGES = ("specwatch", "specwatch.schemas", "specwatch.collectors", "specwatch.detectors",
             "specwatch.actions", "specwatch.streams", "specwatch.archive", "specwatch.transport",
             "specwatch.gateway", "specwatch.qualify", "specwatch.engines", "specwatch.lab")


def _modules():
    for package_name in _PACKAGES:
        package = importlib.import_module(package_name)
        yield package_name
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            if not info.name.startswith(_SKIP_PREFIXES) and info.name not in _PACKAGES:
                yield info.name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_doctests(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"
