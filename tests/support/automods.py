"""Permissive stand-in modules for what cannot import on a CPU machine (torch_npu, CANN, parts of vLLM).

The way vllm-ascend's own CPU unit tests fake torch_npu, generalised: any attribute of an :class:`AutoModule`
exists; a CamelCase name is a class (subclassable, instantiable with any arguments; its own class-level
attributes are cached MagicMocks, for enum-like use), anything else a cached MagicMock.
"""
from __future__ import annotations

import types
from typing import Any
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
