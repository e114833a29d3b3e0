"""Import the REAL ``vllm_omni/entrypoints/async_omni.py`` (AsyncOmni's sleep / wake_up) of a vllm-omni release
without vLLM, torch or a GPU.

:func:`sleep_dir` builds (once per version, cached) a directory holding

* ``vllm_omni/entrypoints/async_omni.py`` and ``async_omni_base.py`` (the real ``AsyncEventResolver``) copied
  byte for byte from the PyPI wheel,
* ``vllm_omni/diffusion/data.py`` holding the real ``OmniACK``, ``OmniSleepTask``, ``OmniWakeTask`` and
  ``CuMemTag`` class definitions, cut out of the release's own ``data.py`` (the rest of that file needs torch and
  diffusers),
* permissive stand-in modules (any attribute exists: a CamelCase name is a subclassable class, anything else a
  MagicMock) for every other module those files import: vLLM, the engine, metrics, anyio ... Nothing of them
  runs in sleep / wake_up except what a test puts on the instance (``engine.stage_configs``,
  ``collective_rpc``: the RPC boundary, answered with real ACKs),
* a ``vllm_omni-<version>.dist-info`` for the engine's version gate.

Built by :class:`~omni_patches.testing.Release` (``auto_standins``). Stand-ins shadow ``vllm``/``vllm_omni``: use the
release in a child, never in the pytest process.
"""
from __future__ import annotations

import ast
import functools

from omni_patches.testing import Release
from omni_patches.testing.releases import real_file

# async_omni_base.py (0.30.0rc1+; AsyncEventResolver lives in async_omni.py before) is copied where it exists.
REAL = ["vllm_omni/entrypoints/async_omni.py", "vllm_omni/entrypoints/async_omni_base.py?"]
DATA = "vllm_omni/diffusion/data.py"
DATA_CLASSES = ("OmniACK", "OmniSleepTask", "OmniWakeTask", "CuMemTag")
TARGET = "vllm_omni.entrypoints.async_omni"


def _data_module(text: str) -> str:
    """The four real classes of ``data.py`` (with their decorators), and what they need to be defined."""
    tree = ast.parse(text)
    decorated = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in DATA_CLASSES:
            decos = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in node.decorator_list)
            decorated.append(decos + ast.get_source_segment(text, node))
    assert len(decorated) == len(DATA_CLASSES), f"{DATA}: found {len(decorated)} of {DATA_CLASSES}"
    head = ('"""The real OmniACK / OmniSleepTask / OmniWakeTask / CuMemTag of this release (cut out of data.py)."""\n'
            "from __future__ import annotations\n\nfrom dataclasses import dataclass, field\nfrom enum import Enum\n"
            "from typing import Any\n\n\n")
    return head + "\n\n\n".join(decorated) + "\n"


@functools.cache
def release(version: str, metadata_version: str | None = None) -> Release:
    """The real AsyncOmni of vllm-omni ``version`` (its dist-info saying ``metadata_version``)."""
    data = _data_module(real_file("vllm-omni", version, DATA).read_text())
    return Release("vllm-omni", version, files=REAL, standins={"vllm_omni.diffusion.data": data},
                   auto_standins=True, metadata_version=metadata_version)


def paths(version: str, *, metadata_version: str | None = None) -> list[str]:
    return release(version, metadata_version).paths()
