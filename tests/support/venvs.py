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


def make_venv(path: Path, *, editable: bool = False) -> Path:
    """Create ``path`` as a venv and pip-install this project into it. Returns the venv's python."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    cmd += ["-e", str(ROOT)] if editable else [str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env())
    if proc.returncode != 0:
        raise RuntimeError(f"pip install into {path} failed:\n{proc.stdout}\n{proc.stderr}")
    return python


def site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, env=clean_env())
    return Path(out.stdout.strip())


def run(python: Path, code: str, *args: str, timeout: int = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args, "-c", code], capture_output=True, text=True,
                          env=clean_env(**env), timeout=timeout)
