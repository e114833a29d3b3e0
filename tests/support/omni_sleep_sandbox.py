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

Stand-ins shadow ``vllm``/``vllm_omni``: use the sandbox in a subprocess, never in the pytest process.
"""
from __future__ import annotations

import ast
import hashlib
import sys
from pathlib import Path

# async_omni_base.py (0.30.0rc1+; AsyncEventResolver lives in async_omni.py before) is copied where it exists.
REAL = ["vllm_omni/entrypoints/async_omni.py", "vllm_omni/entrypoints/async_omni_base.py"]
DATA = "vllm_omni/diffusion/data.py"
DATA_CLASSES = ("OmniACK", "OmniSleepTask", "OmniWakeTask", "CuMemTag")
TARGET = "vllm_omni.entrypoints.async_omni"

# The project's one permissive stand-in (omni_patches.testing.standins), reached from the sandbox through a module
# of its own: the hook the generated files call to turn an imported module permissive.
_AUTO = "from omni_patches.testing.standins import AutoModule, install  # noqa: F401\n"


def _imported(text: str) -> set[str]:
    """Every module a file imports (at any level; relative imports are not used by these files)."""
    mods = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module)
    return mods


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
            "from typing import Any\n\nimport _omni_auto\n\n_omni_auto.install(__name__)\n\n\n")
    return head + "\n\n\n".join(decorated) + "\n"


def auto_sandbox(label: str, version: str, real_files: list[str], generated: dict[str, str], *,
                 passthrough: frozenset = frozenset(), metadata_version: str | None = None) -> Path:
    """A cached directory with ``real_files`` (relative paths; the first must exist, the others are copied where
    the release has them) copied from the vllm-omni ``version`` wheel, ``generated`` files (relative path ->
    text: stand-ins written for this sandbox) and a permissive stand-in module for every other module those
    files import, except the standard library and the top-level packages in ``passthrough`` (real ones on
    ``sys.path``, e.g. pyzmq)."""
    from .fakes import write_dist_info
    from .wheels import real_file, sandbox

    meta = metadata_version or version
    real = {}
    for rel in real_files:
        try:
            real[rel] = real_file("vllm-omni", version, rel).read_text()
        except FileNotFoundError:
            assert rel != real_files[0], f"{rel} is not in vllm-omni {version}"
    provided = {rel[:-3].replace("/", ".").removesuffix(".__init__") for rel in [*real, *generated]}
    stubs = set()
    for text in real.values():
        for mod in _imported(text):
            top = mod.split(".")[0]
            if top in sys.stdlib_module_names or top in passthrough or mod in provided:
                continue
            parts = mod.split(".")
            stubs.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    packages = {m.rsplit(".", 1)[0] for m in stubs | provided if "." in m}
    packages |= {".".join(m.split(".")[:i]) for m in packages for i in range(1, m.count(".") + 1)}

    def fill(dst: Path) -> None:
        (dst / "_omni_auto.py").write_text(_AUTO)
        for mod in sorted(stubs | packages):
            if mod in provided:
                continue
            rel = mod.replace(".", "/") + ("/__init__.py" if mod in packages else ".py")
            path = dst / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            # vllm_omni's own package files stay empty (the real ones import the world); the rest are automatic.
            body = "" if mod == "vllm_omni" or (mod.startswith("vllm_omni.") and mod in packages) else (
                '"""Stand-in (omni-patches sandbox)."""\nimport _omni_auto\n\n_omni_auto.install(__name__)\n')
            path.write_text(body)
        for rel, text in [*real.items(), *generated.items()]:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            (dst / rel).write_text(text)
        write_dist_info(dst, "vllm-omni", meta, "vllm_omni")

    digest = hashlib.sha256("".join([*real.values(), repr(sorted(generated.items())), _AUTO,
                                     *sorted(stubs)]).encode()).hexdigest()
    return sandbox(f"{label}-{version}-as-{meta}", f"{version}|{meta}|{digest}", fill)


def sleep_dir(version: str, *, metadata_version: str | None = None) -> Path:
    """Directory to put first on ``sys.path`` to import the real AsyncOmni of vllm-omni ``version``."""
    from .wheels import real_file

    data = _data_module(real_file("vllm-omni", version, DATA).read_text())
    return auto_sandbox("omni-sleep", version, REAL, {DATA: data}, metadata_version=metadata_version)


def paths(version: str, **kw) -> list[str]:
    return [str(sleep_dir(version, **kw))]
