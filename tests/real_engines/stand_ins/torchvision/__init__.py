"""Stand-in for ``torchvision`` in the real-engine tier's SGLang (test tooling, never shipped).

SGLang 0.5.23 imports ``torchvision.transforms`` at module level for its vision models, and
``transformers`` imports ``torchvision.io`` once it finds the package. PyPI's torchvision is a
CUDA build that breaks imports beside the CPU torch, and a text model never calls it. So
every ``torchvision.<name>`` import gets an empty module whose attributes are placeholders
that raise when called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.28.0"


class Placeholder:
    """Anything reached through the stand-in: attributes lead further, a call raises."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attribute: str) -> Placeholder:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Placeholder(f"{self.name}.{attribute}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name} is not in the test tier's torchvision stand-in")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # a class may name one as its base


def _attributes_of(module: str) -> Any:
    def lookup(name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{module}.{name}")

    return lookup


__getattr__ = _attributes_of(__name__)


class SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every ``torchvision.<name>`` import with an empty stand-in module."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _attributes_of(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, SubmoduleFinder())
