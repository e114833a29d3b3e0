"""Contract case and scenarios for omni-diffusion-engine-shutdown-rpcs: the REAL diffusion_engine.py of each release.

Affected: 0.30.0rc1 (the first whose _busy_loop returns early once closed) and 0.30.0; 0.31.0rc1 breaks to the tail.

The scenarios below run in a child on a release (``Release.call``): the release's real ``DiffusionEngine`` (its busy
loop, RPC queue, ``collective_rpc``, ``close``), built with ``__new__`` and its own ``_init_runtime_state`` (its
``__init__`` builds workers), permissive stand-ins for the rest of its import graph. What stands in for the hardware:
a scheduler holding one request, and an executor whose batch call blocks until shutdown interrupts it (then raises,
as a diffusion executor's call does when its workers are stopped under it) and whose collective RPCs answer at once.
"""
import threading
import time
import types

from omni_patches.testing import Case, Env, Release, Unexpected
from support.omni_cases import skipped, source_built

PATCH_ID = "omni-diffusion-engine-shutdown-rpcs"
ENGINE = "vllm_omni/diffusion/diffusion_engine.py"
AFFECTED = ["0.30.0rc1", "0.30.0"]
FIXED = ["0.31.0rc1", "0.32.0rc1"]
BEFORE = "0.29.0rc1"  # the newest release before the early return: the loop always reaches its tail
SHUTTING_DOWN = "RuntimeError: DiffusionEngine is shutting down."


def release(version):
    return Release("vllm-omni", version, files=[ENGINE], auto_standins=True)


def sandbox(version, env=None):
    return release(version).env(label=f"omni-{version}", env=env)


# -- what stands in for the hardware ---------------------------------------------------------------------------------
class OneRequestScheduler:
    """The scheduler side of one request, ``req-1``: scheduled once; what the busy loop reads of a scheduler."""

    def __init__(self):
        self.waiting, self.closed, self._kv_draining_requests = ["req-1"], False, set()

    def has_requests(self):
        return bool(self.waiting)

    def get_admission_wait_decision(self, now, dp_concurrent):
        return types.SimpleNamespace(should_wait=False)

    def schedule(self):
        ids, self.waiting = self.waiting, []
        return types.SimpleNamespace(scheduled_request_ids=ids, scheduled_new_reqs=[], finished_req_ids=set(),
                                     is_empty=not ids, num_waiting_reqs=0)

    def update_from_output(self, sched_output, runner_output):
        return set()  # nothing to deliver: no output stream is open

    def pending_finished_request_ids(self):
        return set()

    def close(self):
        self.closed = True


class BlockingExecutor:
    """A diffusion executor whose batch call runs until ``finish()`` (it returns) or ``interrupt()`` (shutdown
    stops its workers: it raises); a collective RPC answers at once, or raises once the executor is shut down."""

    def __init__(self):
        self.started, self._done, self.interrupted, self.rpcs = threading.Event(), threading.Event(), False, []

    def execute_batch(self, sched_output):
        self.started.set()
        self._done.wait(60)
        if self.interrupted:
            raise RuntimeError("diffusion workers stopped during shutdown")
        return types.SimpleNamespace(request_ids=list(sched_output.scheduled_request_ids))

    execute_step = execute_batch

    def finish(self):
        self._done.set()

    def interrupt(self):
        self.interrupted = True
        self._done.set()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, unique_reply_rank=None):
        if self.interrupted:
            raise RuntimeError("diffusion executor is shut down")
        self.rpcs.append(method)
        return [f"{method}: ok"]

    def shutdown(self):
        self.interrupt()


def engine_of(m, executor):
    """The release's DiffusionEngine without its ``__init__``: its own runtime state, request-batch mode."""
    engine = m.DiffusionEngine.__new__(m.DiffusionEngine)
    engine.od_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=1),
                                             distributed_executor_backend="mp", custom_pipeline_args=None,
                                             model_class_name="StandInPipeline", request_batch_max_wait_ms=0)
    engine.execution_mode = m.DiffusionExecutionMode.REQUEST_BATCH
    engine.executor, engine.scheduler = executor, OneRequestScheduler()
    engine._init_runtime_state()
    engine._init_execute_fn()
    return engine


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


# -- the scenarios ---------------------------------------------------------------------------------------------------
def rpc_during_batch(deadline_s, shutdown=True):
    """A batch runs; a caller's ``collective_rpc("sleep")`` (no timeout, as a stage's sleep / LoRA RPC thread
    calls it) queues behind it; then ``close()``, and shutdown interrupts the batch's executor call (``shutdown``;
    else the batch finishes normally and nothing is closed until the RPC answered). What the caller got within
    ``deadline_s`` of that moment: ``outcome`` ("blocked", the result, or ``Type: message``) and ``seconds``."""
    import asyncio

    from vllm_omni.diffusion import diffusion_engine as m

    executor = BlockingExecutor()
    engine = engine_of(m, executor)
    asyncio.run(engine._check_and_start_background_loop())
    loop_thread = engine.worker_thread
    assert executor.started.wait(10), "the busy loop never ran the batch"
    box = {}

    def caller():
        try:
            box["outcome"] = engine.collective_rpc("sleep", None, (), {"level": 1})
        except BaseException as exc:  # noqa: BLE001
            box["outcome"] = f"{type(exc).__name__}: {exc}"
        box["at"] = time.monotonic()

    rpc = threading.Thread(target=caller, name="stage-rpc", daemon=True)
    rpc.start()
    assert _wait(lambda: engine._rpc_queue.qsize() == 1), "the RPC was never queued"
    closer = None
    if shutdown:
        closer = threading.Thread(target=engine.close, name="stage-close", daemon=True)
        closer.start()
        assert _wait(lambda: engine._closed is True), "close() never marked the engine closed"
        t0 = time.monotonic()
        executor.interrupt()  # the workers are stopped under the running batch
        closer.join(30)
    else:
        t0 = time.monotonic()
        executor.finish()
    rpc.join(deadline_s)
    out = {"file": m.__file__, "closed": engine._closed, "outcome": box.get("outcome", "blocked"),
           "seconds": round(box["at"] - t0, 3) if "at" in box else None, "left_in_queue": engine._rpc_queue.qsize(),
           "executor_rpcs": list(executor.rpcs), "loop_ended": not loop_thread.is_alive(),
           "close_returned": closer is not None and not closer.is_alive()}
    # Let everything go: a caller still waiting is released by hand, a running engine is closed.
    while not engine._rpc_queue.empty():
        task = engine._rpc_queue.get_nowait()
        if not task.future.done():
            task.future.set_exception(RuntimeError("released by the test"))
    rpc.join(10)
    if not shutdown:
        engine.close()
    out["released"] = not rpc.is_alive()
    return out


def stock_then_patched(deadline_s):
    """Both scenarios on stock, then with the shim activated in the same process; the patch's status."""
    from support.omni_children import activate, status

    result = {"stock": rpc_during_batch(deadline_s), "stock_no_shutdown": rpc_during_batch(deadline_s, False)}
    result["status"] = activate(PATCH_ID)
    result["patched"] = rpc_during_batch(deadline_s)
    result["patched_no_shutdown"] = rpc_during_batch(deadline_s, False)
    result["status_after"] = status(PATCH_ID)
    return result


def _closed_engine_without_rpc_queue():
    """An engine built by hand, already closed and without an RPC queue: stock's loop tail raises AttributeError."""
    from vllm_omni.diffusion import diffusion_engine as m

    engine = m.DiffusionEngine.__new__(m.DiffusionEngine)
    engine.stop_event, engine._closed = threading.Event(), True
    engine.stop_event.set()
    return engine._busy_loop()


BASE = sandbox("0.30.0")
LOOP_RETURN = "                if self._closed:\n                    return\n"

CASE = Case(
    patch_id=PATCH_ID,
    affected=[sandbox(v) for v in AFFECTED],
    skipped=skipped(
        sandbox, "0.30.0", "OMNI_PATCHES_OMNI_DIFFUSION_ENGINE_SHUTDOWN_RPCS",
        # Upstream's fix found by feature although the version says 0.30.0 (a vendor backport of the break).
        backport=(ENGINE, LOOP_RETURN, LOOP_RETURN.replace("return", "break")),
        outside=BEFORE, fixed=tuple(FIXED)),
    source_built=source_built(sandbox, "0.30.0", "0.30.1.dev4+g1a2b3c4d", fixed="0.31.0rc1"),
    drifted=[
        (Env.edited("omni-0.30.0-renamed", BASE, ENGINE, "    def _fail_pending_rpcs(",
                    "    def _fail_queued_rpcs("), "no attribute '_fail_pending_rpcs'"),
        (Env.edited("omni-0.30.0-loop-renamed", BASE, ENGINE, "    def _busy_loop(self):",
                    "    def _engine_loop(self):"), "no attribute '_busy_loop'"),
    ],
    unexpected=[Unexpected(BASE, _closed_engine_without_rpc_queue, note="the engine has no RPC queue")],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.29.0rc1": "skip: out of range", "vllm-omni==0.30.0rc1": "would apply",
    "vllm-omni==0.30.0": "would apply", "vllm-omni==0.31.0rc1": "skip: fixed upstream",
    "vllm-omni==0.32.0rc1": "skip: fixed upstream",
}
