"""Permissive stand-in modules for what cannot import on a CPU machine (torch_npu, CANN, parts of vLLM).

The way vllm-ascend's own CPU unit tests fake torch_npu, generalised: any attribute of an :class:`AutoModule`
exists; a CamelCase name is a class (subclassable, instantiable with any arguments; its own class-level
attributes are cached MagicMocks, for enum-like use), anything else a cached MagicMock. :class:`AutoFinder` serves
one for every module under given top-level packages that a sandbox does not hold as a real file.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path
from typing import Any, Callable
from unittest.mock import MagicMock


class AutoMeta(type):
    """Class-level attribute access on an auto class yields a cached MagicMock."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{cls.__qualname__}.{name}")
        type.__setattr__(cls, name, value)
        return value


class AutoBase(metaclass=AutoMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class AutoModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper() and not name.isupper():
            value: Any = AutoMeta(name, (AutoBase,), {"__module__": self.__name__, "__qualname__": name})
        else:
            value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class AutoFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An :class:`AutoModule` package for every module under the top-level names ``roots`` that ``real`` (a sandbox
    directory) does not hold as a file; a stand-in over a directory of ``real`` still finds the real files in it.
    ``overrides()``: ``{module: {name: value}}`` set on a stand-in as it is created (behaviour a test needs)."""

    def __init__(self, name: str, roots, real: Path | None = None,
                 overrides: Callable[[], dict] | None = None) -> None:
        self.name, self.roots, self.real, self.overrides = name, tuple(roots), real, overrides

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.roots:
            return None
        search = []
        if self.real is not None:
            base = self.real.joinpath(*fullname.split("."))
            if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
                return None  # a real file (or a bootstrap): the path finder loads it
            if base.is_dir():
                search = [str(base)]
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        spec.submodule_search_locations = search
        return spec

    def create_module(self, spec):
        mod = AutoModule(spec.name)
        mod.__path__ = list(spec.submodule_search_locations or ())
        return mod

    def exec_module(self, module) -> None:
        if self.overrides is not None:
            module.__dict__.update(self.overrides().get(module.__name__, {}))


def add_finder(finder: AutoFinder) -> AutoFinder:
    """Put ``finder`` on ``sys.meta_path`` unless one of the same name is there (that one is returned), behind the
    import-hook finders of wrapt / omni_patches: their post-import hooks must see the imports they wait for."""
    for f in sys.meta_path:
        if isinstance(f, AutoFinder) and f.name == finder.name:
            return f
    pos = 0
    for i, f in enumerate(sys.meta_path):
        if type(f).__module__.split(".")[0] in ("wrapt", "omni_patches"):
            pos = i + 1
    sys.meta_path.insert(pos, finder)
    return finder
