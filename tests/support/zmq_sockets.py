"""Real pyzmq in the pytest process, for the wrapper tests of the stage-client patches
(tests/patches/omni_stage_send_dead_engine/test_stage_send.py,
tests/patches/omni_stage_shutdown_nonblocking/test_stage_shutdown.py): pyzmq from the cached ``--target`` directory
of support.stage_client_sandbox (the test venv has none).
Import the fixtures into the test module: ``from support.zmq_sockets import push, zmq``."""
import subprocess
import sys

import pytest

from .omni_children import ROOT
from .stage_client_sandbox import zmq_dir


@pytest.fixture
def zmq(monkeypatch):
    monkeypatch.syspath_prepend(str(zmq_dir()))
    import zmq

    return zmq


@pytest.fixture
def push(zmq, tmp_path):
    """A PUSH socket bound to ``ipc://<tmp_path>/req``, no peer yet (closed with linger 0 afterwards)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.bind(f"ipc://{tmp_path}/req")
    yield sock
    sock.close(linger=0)
    ctx.term()


def assert_imports_without_zmq(module: str) -> None:
    """``module`` imports in a fresh interpreter without importing zmq (nothing heavy before its target is)."""
    from .venvs import clean_env

    code = f"import sys; import {module} as m; assert 'zmq' not in sys.modules, 'zmq imported'; print(m.PATCH_ID)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(),
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
