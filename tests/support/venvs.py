"""Fresh virtual environments with omni-patches installed for real (non-editable or editable)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# Kept in every child: tests/conftest.py points it at the session's own directory, so no process a test
# starts ever writes a record into the production state directory.
TEST_SETTINGS = ("OMNI_PATCHES_STATE_DIR",)


def without_switches(environ=None) -> dict:
    """``environ`` (default os.environ) without OMNI_PATCHES* switches, keeping the test-session settings."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith("OMNI_PATCHES") or k in TEST_SETTINGS}


def clean_env(**extra) -> dict:
    """The calling environment without any OMNI_PATCHES* switch / PYTHONPATH leaking into the child."""
    env = {k: v for k, v in without_switches().items()
           if k not in ("PYTHONPATH", "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY")}
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    return env


def make_venv(path: Path, *, editable: bool = False, project: Path = ROOT, no_deps: bool = False,
              also: tuple = ()) -> Path:
    """Create ``path`` as a venv and pip-install ``project`` (this checkout) into it. Returns the venv's python.

    ``no_deps`` leaves omni-patches' dependencies out (``also`` names the ones to install after all): an
    environment where one is missing, as an operator's broken image has it.
    """
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    args = ["install", "-q", "--disable-pip-version-check", *(["--no-deps"] if no_deps else [])]
    if editable:  # it must point at the tree itself: one build at a time writes its egg-info and build/ there
        from .wheels import locked

        with locked(f"project-build-{hashlib.sha256(str(project).encode()).hexdigest()[:12]}"):
            pip(python, [*args, "-e", str(project)], path)
    else:
        with install_source(project) as src:
            pip(python, [*args, str(src)], path)
    if also:
        pip(python, ["install", "-q", "--disable-pip-version-check", *also], path)
    return python


def pip(python: Path, args, where) -> None:
    proc = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True, env=clean_env())
    if proc.returncode != 0:
        raise RuntimeError(f"pip {' '.join(map(str, args))} for {where} failed:\n{proc.stdout}\n{proc.stderr}")


def project_copy(dest: Path, project: Path = ROOT) -> Path:
    """The files ``pip install`` needs from ``project`` (this checkout), copied to ``dest`` (an install that can be
    moved)."""
    import shutil

    dest.mkdir(parents=True)
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "patches.toml", "README.md"):
        shutil.copy2(project / name, dest / name)
    shutil.copytree(project / "omni_patches", dest / "omni_patches",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "patches.toml"))
    return dest


@contextlib.contextmanager
def install_source(project: Path = ROOT):
    """What a non-editable ``pip install`` of ``project`` reads: a fresh copy of its files. pip builds in the source
    tree (setuptools' ``build/``, the egg-info): two xdist workers installing the checkout at once tore each
    other's wheel apart (an install without its ``.pth``), and ``build/lib`` keeps modules deleted from the source."""
    with tempfile.TemporaryDirectory(prefix="omni-patches-src-") as tmp:
        yield project_copy(Path(tmp) / "src", project)


def site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, env=clean_env())
    return Path(out.stdout.strip())


def run(python: Path, code: str, *args: str, timeout: int = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args, "-c", code], capture_output=True, text=True,
                          env=clean_env(**env), timeout=timeout)
