"""Does the REAL ``StageDiffusionProc.run_loop`` tear down when its executor dies between requests?

Usage: ``python -m patches.omni_stage_executor_failure_teardown.executor_failure_child JSON`` in an interpreter
whose ``sys.path`` starts with
:func:`paths` (``{"stock_wait": seconds, "env": {switch: value}}``; stock, then the shim activated).

The sandbox: the release's real ``vllm_omni/diffusion/stage_diffusion_proc.py``, real pyzmq, a pickle codec for
omni's msgpack encoder, permissive stand-ins for the rest (``omni_patches.testing.Release``). The
process object is built with ``__new__`` (its ``__init__`` would build the engine); its engine holds an executor
that behaves as ``MultiprocDiffusionExecutor``'s worker monitor does when a worker dies (``is_dead`` becomes
True, then every registered failure callback is called, from the monitor's own thread). ``run_loop`` runs in a
thread against a client's bound PUSH/PULL sockets; no request is in flight when the executor fails.
Prints ``RESULT {json}``: whether run_loop ended and whether the client got ``DIFFUSION_PROC_DEAD``.
"""
import asyncio
import functools
import tempfile
import threading
import time
import types

from support.omni_children import activate, child_main, status

PATCH_ID = "omni-stage-executor-failure-teardown"


class Executor:
    """What run_loop and 0.31.0rc1's watcher read of a diffusion executor."""

    def __init__(self):
        self._failed, self.callbacks = False, []

    @property
    def is_dead(self):
        return self._failed

    def register_failure_callback(self, cb):
        self.callbacks.append(cb)

    def worker_died(self):  # MultiprocDiffusionExecutor's monitor thread: _is_failed = True, shutdown(), callbacks
        self._failed = True
        for cb in self.callbacks:
            cb()


def scenario(wait_s, dead_before=False):
    import zmq

    from vllm_omni.diffusion import stage_diffusion_proc as m

    tmp = tempfile.mkdtemp(prefix="ef-")
    req, resp = f"ipc://{tmp}/req", f"ipc://{tmp}/resp"
    import inspect

    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    proc_binds = "request_socket.bind(" in inspect.getsource(m.StageDiffusionProc.run_loop)  # 0.23.0rc1 and older
    for sock, addr in ((push, req), (pull, resp)):
        (sock.connect if proc_binds else sock.bind)(addr)
    proc = m.StageDiffusionProc.__new__(m.StageDiffusionProc)
    executor = Executor()
    proc.__dict__.update(_model="m", _od_config=types.SimpleNamespace(streaming_output=False),
                         _engine=types.SimpleNamespace(executor=executor), _executor=None, _closed=False,
                         _active_tasks=None, _fatal_event=None)
    box = {}
    if dead_before:  # the worker died while the engine was being built: dead before run_loop starts
        executor.worker_died()

    def run():
        try:
            asyncio.run(proc.run_loop(req, resp))
            box["ended"] = "returned"
        except Exception as exc:  # noqa: BLE001
            box["ended"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if "self._fatal_event = " in inspect.getsource(m.StageDiffusionProc.run_loop):
        # run_loop is up once it set its event (or already gone: dead before it started, it ends at once and resets it)
        deadline = time.monotonic() + 10
        while proc._fatal_event is None and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    # else (0.21.0rc1 and older): nothing shows that it is up but a moment (it only binds two sockets)
    time.sleep(0.2)
    t0 = time.monotonic()
    if not dead_before:
        threading.Thread(target=executor.worker_died, name="diffusion-worker-monitor").start()
    thread.join(wait_s)
    out = {"file": m.__file__, "callbacks_registered": len(executor.callbacks),
           "torn_down": not thread.is_alive(), "ended": box.get("ended")}
    out["seconds"] = round(time.monotonic() - t0, 3) if out["torn_down"] else None
    out["dead_sentinel"] = bool(pull.poll(1000)) and pull.recv() == m.StageDiffusionProc.DIFFUSION_PROC_DEAD
    if thread.is_alive():  # stock: still serving; a request now would be the one that fails
        with __import__("contextlib").suppress(zmq.Again):
            push.send(__import__("pickle").dumps({"type": "shutdown"}), flags=zmq.NOBLOCK)
        thread.join(10)
    return out


PROC_RELPATH = "vllm_omni/diffusion/stage_diffusion_proc.py"


@functools.cache
def release(version, metadata_version=None):
    """The real stage_diffusion_proc.py of ``version``, a pickle codec for omni's msgpack one, pyzmq beside it."""
    from omni_patches.testing import Release
    from support.stage_client_sandbox import PICKLE_CODEC, zmq_dir

    return Release("vllm-omni", version, files=[PROC_RELPATH], auto_standins=True, passthrough=("zmq",),
                   standins={"vllm_omni.distributed.omni_connectors.utils.serialization": PICKLE_CODEC},
                   metadata_version=metadata_version, with_=zmq_dir)


def paths(version, metadata_version=None):
    """``sys.path`` entries for a child that imports the real stage_diffusion_proc.py of ``version``."""
    return release(version, metadata_version).paths()


def main(job):
    stock_wait = float(job.get("stock_wait", 3.0))
    result = {"stock": scenario(stock_wait), "stock_dead_before": scenario(stock_wait, dead_before=True)}
    result["status"] = activate(PATCH_ID, job.get("env"))
    # Applied: the patch gets a generous bound to tear down. Skipped: stock's code runs again, under stock's bound.
    patched_wait = 30.0 if result["status"]["state"] == "applied" else stock_wait
    result["patched"] = scenario(patched_wait)
    result["patched_dead_before"] = scenario(patched_wait, dead_before=True)
    result["status_after"] = status(PATCH_ID)
    return result


if __name__ == "__main__":
    child_main(main, tmp_prefix="omni-ef-")  # every IPC endpoint lives in one directory, removed at the end
