"""Directories that make the REAL idle-MoE-LoRA targets importable in a fresh interpreter via ``sys.path`` alone.

``omni_manager.omni_sandbox`` installs its stand-ins in the running process; the contract
(``omni_patches.testing.child``) only prepends ``Env.paths()``. So each directory here holds the real upstream files, byte for byte, plus a ``<dist>-<version>.dist-info`` (the engine's version
gate reads it) and a package ``__init__`` that installs the same stand-ins on first import:

* :func:`omni_manager_dir` -- ``vllm_omni/diffusion/lora/**``, ``diffusion/offloader/config.py`` and
  ``lora/utils.py`` of a vllm-omni wheel; ``vllm_omni/__init__.py`` puts ``omni_manager``'s vLLM stand-ins
  into ``sys.modules``. The patch requires vllm-ascend (only its MoE runners take a MoE-LoRA context): the
  directory also holds a vllm-ascend dist-info alone (STAND-IN: the runners the tests drive are
  ``omni_manager``'s Ascend-like ones), unless ``ascend=None``.

(The real vllm-ascend releases, with the real vLLM each was built for, live in :mod:`support.ascend_real`.)

The bootstrap imports ``omni_manager``: tests/ must be on ``sys.path`` (it is in the
contract child and in the subprocesses the tests start).
"""
from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

from support import wheels
from support.fakes import write_dist_info
from support.venvs import without_switches

_OMNI_COPY = ("vllm_omni/diffusion/lora", "vllm_omni/diffusion/offloader/config.py", "vllm_omni/lora/utils.py")
_OMNI_EMPTY = ("vllm_omni/diffusion/__init__.py", "vllm_omni/diffusion/offloader/__init__.py",
               "vllm_omni/lora/__init__.py")
_OMNI_INIT = '''\
"""omni-patches test sandbox: vLLM stand-ins (omni_manager.py), then the real omni files."""
import sys

from patches.moe_lora_idle_detach import omni_manager as _om

for _name, _mod in _om._vllm_stub_modules("cuda").items():
    sys.modules.setdefault(_name, _mod)
'''


ASCEND = "0.30.0rc2"  # the vllm-ascend the dist-info stand-in names (the newest release, built for vLLM 0.30.0)


def omni_manager_dir(version: str = "0.32.0rc1", *, metadata_version: str | None = None,
                     ascend: str | None = ASCEND) -> Path:
    """Real ``vllm_omni.diffusion.lora.manager`` of ``version``; dist-info says ``metadata_version``; a
    vllm-ascend ``ascend`` dist-info beside it (None: vllm-ascend not installed)."""
    meta = metadata_version or version
    src = wheels.fetch_or_skip("vllm-omni", version)

    def fill(dst: Path) -> None:
        for rel in _OMNI_COPY:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            if (src / rel).is_dir():
                shutil.copytree(src / rel, dst / rel)
            else:
                shutil.copy2(src / rel, dst / rel)
        for rel in _OMNI_EMPTY:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            (dst / rel).write_text("")
        (dst / "vllm_omni/__init__.py").write_text(_OMNI_INIT)
        write_dist_info(dst, "vllm-omni", meta, "vllm_omni")
        if ascend:
            write_dist_info(dst, "vllm-ascend", ascend, "vllm_ascend")

    return wheels.sandbox(f"omni-manager-{version}-as-{meta}-ascend-{ascend}",
                          f"{version}|{meta}|{ascend}|{_OMNI_INIT}|{_OMNI_COPY}", fill)


def run_python(code: str, *paths: str, env: dict | None = None, timeout: int = 300):
    """Run ``code`` in a fresh interpreter with ``paths`` first on sys.path and the repo importable."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    full = without_switches()
    full.update(env or {})
    full["PYTHONPATH"] = os.pathsep.join([*paths, str(root / "tests"), str(root), full.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full, timeout=timeout, cwd=str(root))
