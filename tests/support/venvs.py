"""Fresh virtual environments with omni-patches installed for real (non-editable or editable)."""
from __future__ import annotations

import os
import subprocess
import sys
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
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    cmd += ["--no-deps"] if no_deps else []
    cmd += ["-e", str(project)] if editable else [str(project)]
    pip(python, cmd[3:], path)
    if also:
        pip(python, ["install", "-q", "--disable-pip-version-check", *also], path)
    return python


def pip(python: Path, args, where) -> None:
    proc = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True, env=clean_env())
    if proc.returncode != 0:
        raise RuntimeError(f"pip {' '.join(map(str, args))} for {where} failed:\n{proc.stdout}\n{proc.stderr}")


def project_copy(dest: Path) -> Path:
    """The files ``pip install`` needs from this checkout, copied to ``dest`` (an install that can be moved)."""
    import shutil

    dest.mkdir(parents=True)
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "patches.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "omni_patches", dest / "omni_patches",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "patches.toml"))
    return dest


def site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, env=clean_env())
    return Path(out.stdout.strip())


def run(python: Path, code: str, *args: str, timeout: int = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args, "-c", code], capture_output=True, text=True,
                          env=clean_env(**env), timeout=timeout)
