"""Fetch real upstream distributions from PyPI once and cache them for every test run.

Nothing here imports the upstream code: a wheel is installed ``--no-deps --target`` by uv into a cache
directory (its files hard-linked from the uv cache the stack venvs share, see ``stacks.py``); an sdist is
downloaded (from the index directly: pip cannot build their metadata) and extracted. Tests then load single
real files (``loader.py``, ``parallel_state.py`` ...) next to small stubs.

Cache root: ``$OMNI_TEST_CACHE`` or ``~/.cache/omni-patches-tests``.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from omni_patches.tools import index


CACHE = Path(os.environ.get("OMNI_TEST_CACHE", Path.home() / ".cache" / "omni-patches-tests"))


@contextmanager
def _locked(name: str):
    """Serialise concurrent fetches of the same artefact (pytest-xdist, parallel CI tiers)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sandbox(label: str, recipe: str, fill, *, root: Path | None = None) -> Path:
    """``CACHE/sandboxes/<label>-<sha256(recipe)[:12]>`` (or under ``root``), filled once by ``fill(tmp_dir)`` and
    renamed into place: a build that failed or was interrupted is never taken for a finished one."""
    import hashlib

    dst = (root or CACHE / "sandboxes") / f"{label}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if (dst / ".complete").exists():
        return dst
    with _locked(f"sandbox-{dst.name}"):
        if not (dst / ".complete").exists():
            tmp = dst.with_name(dst.name + ".part")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            fill(tmp)
            (tmp / ".complete").touch()
            shutil.rmtree(dst, ignore_errors=True)
            tmp.rename(dst)
    return dst


def deps_dir(name: str, requirements: list[str], *, no_deps: bool = True, check: str | None = None) -> Path:
    """A ``pip install --target`` directory of ``requirements`` for *this* interpreter, built once and cached as
    ``CACHE/deps/<name>-py<XY>``; ``check``: a statement that must then run with it on PYTHONPATH."""
    target = CACHE / "deps" / f"{name}-py{sys.version_info[0]}{sys.version_info[1]}"
    with _locked("deps-" + target.name):
        if not (target / ".complete").exists():
            shutil.rmtree(target, ignore_errors=True)
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                   *(["--no-deps"] if no_deps else []), "--target", str(target), *requirements],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"installing {requirements} into {target} failed:\n{proc.stdout[-3000:]}\n"
                                   f"{proc.stderr[-3000:]}")
            if check:
                chk = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                                     env={**os.environ, "PYTHONPATH": str(target)})
                if chk.returncode != 0:
                    raise RuntimeError(f"{target} + this interpreter fail `{check}`:\n{chk.stderr[-2000:]}")
            (target / ".complete").touch()
    return target


def download(dist: str, version: str, *, sdist: bool = False, extra_env: dict | None = None) -> Path:
    """Return the path of the cached wheel (or sdist) of ``dist==version``, downloading it if needed."""
    key = f"{dist}-{version}{'-sdist' if sdist else ''}"
    dest = CACHE / "dists" / key
    with _locked(key):
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


def _uv_target(dist: str, version: str, out: Path, extra_env: dict | None) -> None:
    """Install the wheel of ``dist==version`` (no dependencies, never built from source) into ``out`` with uv:
    its files are hard-linked from the uv cache the stack venvs use, so a release held by a stack venv and
    unpacked here is stored once, and no archive is kept."""
    from .stacks import uv_command, uv_env

    cmd = [*uv_command(), "pip", "install", "--quiet", "--no-deps", "--no-build", "--prerelease", "allow",
           "--python", sys.executable, "--target", str(out), f"{dist}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**uv_env(), **(extra_env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"fetching the wheel of {dist}=={version} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")


def unpacked(dist: str, version: str, *, sdist: bool = False, extra_env: dict | None = None) -> Path:
    """Return a directory holding the unpacked files of ``dist==version`` (wheel root, or sdist top dir)."""
    if not sdist:
        out = CACHE / "unpacked" / f"{dist}-{version}-wheel"
        with _locked("unpack-" + out.name):
            if not (out / ".complete").exists():
                tmp = out.with_name(out.name + ".part")
                shutil.rmtree(tmp, ignore_errors=True)
                _uv_target(dist, version, tmp, extra_env)
                (tmp / ".complete").touch()
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
                # The zip-unpacked tree an earlier layout of this cache kept: superseded.
                for old in (CACHE / "unpacked").glob(f"{dist.replace('-', '_')}-{version}-*.whl"):
                    shutil.rmtree(old, ignore_errors=True)
        return out
    archive = download(dist, version, sdist=sdist, extra_env=extra_env)
    out = CACHE / "unpacked" / archive.name
    with _locked("unpack-" + archive.name):
        if not (out / ".complete").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            if archive.suffix == ".whl" or archive.suffix == ".zip":
                with zipfile.ZipFile(archive) as zf:
                    zf.extractall(out)
            else:
                with tarfile.open(archive) as tf:
                    if hasattr(tarfile, "data_filter"):
                        tf.extractall(out, filter="data")
                    else:  # Python < 3.10.12 / 3.11.4: no filters; an sdist needs its regular files only
                        tf.extractall(out, [m for m in tf.getmembers() if m.isfile() and not m.name.startswith("/")
                                            and ".." not in m.name.split("/")])
            (out / ".complete").touch()
    tops = [p for p in out.iterdir() if p.is_dir()]
    return tops[0] if len(tops) == 1 else out


def real_file(dist: str, version: str, relpath: str, **kw) -> Path:
    """Path of one real upstream file, e.g. ``real_file("vllm-omni", "0.28.0", "vllm_omni/diffusion/lora/loader.py")``."""
    path = unpacked(dist, version, **kw) / relpath
    if not path.exists():
        raise FileNotFoundError(f"{relpath} is not in {dist}=={version}")
    return path


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
