"""Patching a vLLM module as its engine processes import it: the machinery the test runtimes'
``sitecustomize`` files share (each loads this file by path: only its own directory is on the path)."""

import importlib.abc
import importlib.machinery
import sys
from typing import Callable


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, target: str, patch: Callable) -> None:
        self.target = target
        self.patch = patch

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self.patch(module)


def patch_on_import(target: str, patch: Callable) -> None:
    """Call ``patch(module)`` right after module ``target`` is first executed, in this process."""
    sys.meta_path.insert(0, _PatchOnImport(target, patch))

