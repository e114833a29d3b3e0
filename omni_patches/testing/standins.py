"""Stand-ins: the one mechanism for modules that cannot run on this machine (torch_npu, CANN, compiled kernels, or
the parts of vLLM a test does not exercise). Test-only.

A stand-in is *permissive*, the way vllm-ascend's own CPU unit tests fake torch_npu, generalised: any attribute of a
stand-in module exists -- a CamelCase name is a class (subclassable, instantiable with any arguments; its own
class-level attributes are cached MagicMocks, for enum-like use), anything else a cached MagicMock -- unless the
stand-in's source defines it. Where they come from:

* on disk, written by :class:`omni_patches.testing.releases.Release` (``standins=`` / ``auto_standins=``): each file
  calls :func:`install` on its own module;
* in memory: :func:`modules` puts stand-ins into a test's own process for a block (and takes them out again),
  :func:`put` into a child's for the rest of its life; :class:`Finder` serves one for every module under given
  top-level names that a directory does not hold as a file.
"""
from __future__ import annotations

import contextlib
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
    """A module on which every missing attribute exists (see the module docstring)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = self._submodule_file(name)
        if sub is not None:  # a module file of this package on disk: ``from pkg import sub`` imports it
            import importlib

            return importlib.import_module(f"{self.__name__}.{name}")
        if name[:1].isupper() and not name.isupper():
            value: Any = AutoMeta(name, (AutoBase,), {"__module__": self.__name__, "__qualname__": name})
        else:
            value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

    def _submodule_file(self, name: str):
        for entry in self.__dict__.get("__path__") or ():
            base = Path(entry) / name
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    return path
        return None


def install(name: str, **attrs) -> types.ModuleType:
    """Make the imported module ``name`` permissive (its own definitions stay), setting ``attrs`` on it: what a
    stand-in file written by a :class:`~omni_patches.testing.releases.Release` calls on itself."""
    mod = sys.modules[name]
    mod.__class__ = AutoModule
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def module(name: str, *, permissive: bool = True, **attrs) -> types.ModuleType:
    """A module object ``name`` with ``attrs`` (not put into ``sys.modules``: see :func:`modules`): permissive (an
    :class:`AutoModule`), or, ``permissive=False``, exactly ``attrs`` (for code that asks ``getattr(mod, name,
    default)`` and must get the default)."""
    mod = AutoModule(name) if permissive else types.ModuleType(name)
    mod.__path__ = []  # a package: submodules of a stand-in are stand-ins too
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def put(spec: dict, *, permissive: bool = True, parents: bool = True) -> dict:
    """Stand-ins for ``spec``'s names (``{"torch_npu": {...attrs}, "torch.npu": {}}``) in ``sys.modules`` for the
    rest of the process -- a child that runs code on a release -- and ``{name: module}`` of those made: a parent
    package is made for each dotted name that has none (a real one stays), each child is set on its parent.
    ``permissive=False``: modules holding exactly their ``attrs``. ``parents=False``: no parent is made, so a
    package that is not installed still fails to import (vllm-ascend's conftest puts ``triton.runtime`` alone).
    In a test's own process use :func:`modules`."""
    made = {}
    for name in sorted(_with_parents(spec) if parents else spec, key=lambda n: n.count(".")):
        if sys.modules.get(name) is not None and name not in spec:
            continue  # a real parent package stays
        made[name] = sys.modules[name] = module(name, permissive=permissive, **spec.get(name, {}))
        parent, _, leaf = name.rpartition(".")
        if sys.modules.get(parent) is not None:
            setattr(sys.modules[parent], leaf, made[name])
    return made


@contextlib.contextmanager
def modules(spec: dict, *, permissive: bool = True):
    """``with modules({"torch_npu": {...attrs}, "vllm.logger": {}}) as mods:`` -- :func:`put` for the block, and
    ``sys.modules`` as it was afterwards."""
    before = {name: sys.modules.get(name) for name in _with_parents(spec)}
    try:
        yield put(spec, permissive=permissive)
    finally:
        for name, old in before.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def _with_parents(names) -> list:
    out = []
    for name in names:
        parts = name.split(".")
        out += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return list(dict.fromkeys(out))


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An :class:`AutoModule` package for every module under the top-level names ``roots`` that ``real`` (a
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
            base = Path(self.real).joinpath(*fullname.split("."))
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

    def add(self) -> "Finder":
        """Put this finder on ``sys.meta_path`` unless one of the same name is there (that one is returned), behind
        the import-hook finders of wrapt / omni_patches: their post-import hooks must see the imports they wait
        for."""
        for f in sys.meta_path:
            if isinstance(f, Finder) and f.name == self.name:
                return f
        pos = 0
        for i, f in enumerate(sys.meta_path):
            if type(f).__module__.split(".")[0] in ("wrapt", "omni_patches"):
                pos = i + 1
        sys.meta_path.insert(pos, self)
        return self
