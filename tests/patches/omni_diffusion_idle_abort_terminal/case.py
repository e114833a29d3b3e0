"""Contract case for omni-diffusion-idle-abort-terminal: the REAL diffusion_engine.py and diffusion scheduler of each
release, driven by the engine's own busy loop.

The sandbox (:func:`release`): the release's real ``diffusion/diffusion_engine.py``, ``diffusion/sched/*.py``,
``diffusion/worker/utils.py`` (RunnerOutput) and ``diffusion/diffusion_kv/config.py``; the real ``DiffusionOutput``
class cut out of the release's ``diffusion/data.py`` (the rest of that file needs diffusers, pydantic and vLLM's
config); a stand-in KV connector that is off (no KV transfer configured, as ``create_scheduler_kv_connector``
answers then); permissive stand-ins for everything else the real files import. The scenarios (:func:`scenario`) build
a ``DiffusionEngine`` around a real ``RequestScheduler`` with ``__new__`` plus the engine's own
``_init_runtime_state`` (its ``__init__`` builds the executor, the workers and the model), an executor whose
``execute_batch`` answers like a request-mode worker, and run the real ``_busy_loop`` thread through the engine's
own ``_check_and_start_background_loop`` on an asyncio loop.
"""
from __future__ import annotations

import ast

from omni_patches.testing import Release

PATCH_ID = "omni-diffusion-idle-abort-terminal"
SWITCH = "OMNI_PATCHES_OMNI_DIFFUSION_IDLE_ABORT_TERMINAL"
ENGINE = "vllm_omni/diffusion/diffusion_engine.py"
SCHED = ["vllm_omni/diffusion/sched/__init__.py", "vllm_omni/diffusion/sched/base_scheduler.py",
         "vllm_omni/diffusion/sched/interface.py", "vllm_omni/diffusion/sched/request_scheduler.py",
         "vllm_omni/diffusion/sched/step_scheduler.py", "vllm_omni/diffusion/sched/sigma_schedule.py?"]
REAL = [ENGINE, *SCHED, "vllm_omni/diffusion/worker/utils.py", "vllm_omni/diffusion/diffusion_kv/config.py"]
DATA = "vllm_omni/diffusion/data.py"
# What the scheduler imports of the KV connector module when no KV transfer is configured: no connector at all.
KV_CONNECTOR = """
def create_scheduler_kv_connector(*args, **kwargs):
    return None


def shutdown_kv_connector(*args, **kwargs):
    return None


def native_prefetch_enabled(*args, **kwargs):
    return False
"""


def _diffusion_output(version: str) -> str:
    """The real ``DiffusionOutput`` dataclass of ``version`` (its decorators and body), cut out of data.py."""
    from omni_patches.testing.releases import release_root

    text = (release_root("vllm-omni", version) / DATA).read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == "DiffusionOutput":
            decos = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in node.decorator_list)
            return ("from __future__ import annotations\n\nfrom dataclasses import dataclass, field\n"
                    "from typing import Any, Callable\n\n\n" + decos + ast.get_source_segment(text, node) + "\n")
    raise AssertionError(f"{DATA} of vllm-omni {version} has no DiffusionOutput")


def release(version: str, **kw) -> Release:
    return Release("vllm-omni", version, files=REAL, auto_standins=True, label=f"omni-idle-abort-{version}",
                   standins={"vllm_omni.diffusion.data": _diffusion_output(version),
                             "vllm_omni.diffusion.diffusion_kv.kv_connector": KV_CONNECTOR}, **kw)


# -- the scenarios (run in a child on a release) ----------------------------------------------------------------------
class _Params:
    """Sampling parameters: every field the batching key reads is None (the defaults of a plain request)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _request(rid):
    import types

    return types.SimpleNamespace(request_id=rid, sampling_params=_Params(), diffusion_kv_requests=None,
                                 kv_transfer_params=None, batch_compatibility_key=None, use_step_execution=False,
                                 cancellation_signal=None, scheduler_queue_wait_ms=0.0)


class _Executor:
    """A request-mode executor: ``execute_batch`` finishes every scheduled request with an image-less result,
    after ``gate`` (when set) lets it go. Records what each wave scheduled and which finished ids it carried to the
    workers (their cleanup)."""

    def __init__(self, m):
        import threading

        self.m, self.gate, self.waves, self.started = m, None, [], threading.Event()

    def execute_batch(self, sched_output):
        self.waves.append({"scheduled": sorted(sched_output.scheduled_request_ids),
                           "finished": sorted(sched_output.finished_req_ids)})
        self.started.set()
        if self.gate is not None:
            self.gate.wait(30)
        m = self.m
        return m.BatchRunnerOutput.from_list([
            m.RunnerOutput(request_id=rid, step_index=None, finished=True,
                           result=m.DiffusionOutput(output={"done": rid}))
            for rid in sched_output.scheduled_request_ids])

    def shutdown(self):
        pass

    def drop_output(self, *args):
        pass

    def collective_rpc(self, *args, **kwargs):
        return None


def _engine(m, accessor=True):
    import types

    from vllm_omni.diffusion.diffusion_kv.config import DiffusionKVCacheMode

    od = types.SimpleNamespace(max_num_seqs=1, step_execution=False, streaming_output=False, model_class_name="Tiny",
                               parallel_config=types.SimpleNamespace(data_parallel_size=1), custom_pipeline_args=None,
                               request_batch_max_wait_ms=0, diffusion_kv_mode=DiffusionKVCacheMode.DENSE_LEGACY,
                               omni_kv_config={}, enable_prefix_caching=False)
    eng = m.DiffusionEngine.__new__(m.DiffusionEngine)
    eng.od_config = od
    eng.execution_mode = m.DiffusionExecutionMode.REQUEST_BATCH
    eng.step_execution = False
    eng.pre_process_func = eng.post_process_func = eng.prefix_cache_func = None
    eng._diffusion_kv_profile_limits = None
    eng.executor = _Executor(m)
    eng.scheduler = m.RequestScheduler()
    if not accessor:  # a custom scheduler (the engine takes one) that predates pending_finished_request_ids
        eng.scheduler.pending_finished_request_ids = None
    eng.scheduler.initialize(od)
    eng._init_runtime_state()
    eng._init_execute_fn()
    return eng


def _out(o):
    return {k: getattr(o, k, None) for k in ("aborted", "abort_message", "error", "finished", "output")}


def _state(eng, rid):
    """What the engine still holds for ``rid``: its output stream, its scheduler state; the scheduler's load."""
    sch = eng.scheduler
    st = sch.get_request_state(rid)
    pending = getattr(sch, "pending_finished_request_ids", None)
    return {"stream_kept": rid in eng._out_streams, "scheduler_state": None if st is None else st.status.name,
            "has_requests": sch.has_requests(), "pending_finished": sorted(pending()) if callable(pending) else None}


TIMINGS = ("victim_s", "victim_late_s")


def scenario(wait_s, accessor=True):
    """The request ``victim`` is aborted while it waits behind the request ``running`` (its worker call held until
    the abort is queued): when ``running`` ends, the scheduler is idle. The caller reads victim's stream as the
    stage process does (``async for``) and gets ``wait_s`` seconds (``victim_s``: when it ended, None: still open);
    then the request ``late`` arrives (``victim_late_s``: when victim's stream ended after that)."""
    import asyncio
    import threading
    import time

    from vllm_omni.diffusion import diffusion_engine as m

    eng = _engine(m, accessor=accessor)
    ex = eng.executor
    res = {"file": m.__file__, "loop_error": None}
    hook = threading.excepthook

    def died(info):  # the busy loop's thread ended on an exception (the engine is dead: every stream waits)
        if info.thread is eng.worker_thread:
            res["loop_error"] = f"{info.exc_type.__name__}: {info.exc_value}"
        else:
            hook(info)

    def consume(gen):
        outs = []

        async def read():
            async for out in gen:
                outs.append(_out(out))

        return asyncio.ensure_future(read()), outs

    async def ended(task, timeout):
        """Seconds until the caller's stream ended, or None: still open after ``timeout`` (the read goes on)."""
        t0 = time.monotonic()
        done, _ = await asyncio.wait({task}, timeout=timeout)
        return round(time.monotonic() - t0, 3) if done else None

    async def main():
        await eng._check_and_start_background_loop()
        ex.gate = threading.Event()
        running, res["running"] = consume(eng.async_add_req_and_stream_response(_request("running")))
        await asyncio.get_running_loop().run_in_executor(None, ex.started.wait, 10)
        victim, res["victim"] = consume(eng.async_add_req_and_stream_response(_request("victim")))
        eng.abort("victim")
        ex.gate.set()
        await ended(running, 10)
        res["victim_s"] = await ended(victim, wait_s)
        res["victim_in_time"] = list(res["victim"])
        res["after"] = _state(eng, "victim")
        late, res["late"] = consume(eng.async_add_req_and_stream_response(_request("late")))
        await ended(late, 10)
        res["victim_late_s"] = await ended(victim, 5)
        await asyncio.sleep(0.05)
        res["end"] = _state(eng, "victim")
        res["waves"] = ex.waves
        res["loop_alive"] = eng.worker_thread.is_alive()

    threading.excepthook = died
    try:
        asyncio.run(main())
    finally:
        threading.excepthook = hook
        eng.stop_event.set()
        with eng._cv:
            eng._cv.notify_all()
        eng.worker_thread.join(5)
    return res


def run(wait_s, env=None):
    """The scenario stock, then with the shim activated in the same process."""
    from support.omni_children import activate, status

    out = {"stock": scenario(wait_s)}
    out["status"] = activate(PATCH_ID, env)
    out["patched"] = scenario(wait_s)
    out["status_after"] = status(PATCH_ID)
    return out


# -- the contract -------------------------------------------------------------------------------------------------
AFFECTED = ["0.30.0rc1", "0.30.0", "0.31.0rc1"]
PAUSED_GATE = "            if self._scheduling_paused:\n                # No wave runs while paused"
PENDING_CALL = "pending_finished = self.scheduler.pending_finished_request_ids()"


def sandbox(version, env=None):
    """The contract Env of ``version``: its release environment, built when a child first needs it."""
    from omni_patches.testing import Env

    return Env(f"omni-{version}", lambda: release(version).paths(), dict(env or {}))


def _scheduler_without_pending_accessor():
    """An engine whose (custom) scheduler has no pending_finished_request_ids: the abort waits, as stock."""
    out = scenario(0.3, accessor=False)
    return {k: v for k, v in out.items() if k not in ("file", *TIMINGS)}


def _case():
    from omni_patches.testing import Case, Env, Unexpected
    from support.omni_cases import skipped, source_built

    base = sandbox("0.30.0")
    return Case(
        patch_id=PATCH_ID,
        affected=[sandbox(v) for v in AFFECTED],
        skipped=skipped(
            sandbox, "0.30.0", SWITCH,
            # Upstream's fix found by feature although the version says 0.30.0 (a vendor backport).
            backport=(ENGINE, PAUSED_GATE, PAUSED_GATE.replace(
                "self._scheduling_paused:", "self._scheduling_paused or not self.scheduler.has_requests():")),
            # 0.29.0rc1: the same waiting abort, but no pending_finished_request_ids to surface it with.
            outside="0.29.0rc1", fixed=("0.32.0rc1",)),
        source_built=source_built(sandbox, "0.30.0", "0.30.1.dev4+g1a2b3c4d", fixed="0.32.0rc1"),
        drifted=[
            (Env.edited("omni-0.30.0-rpc-renamed", base, ENGINE, "    def _process_rpc_queue(self)",
                        "    def _process_control_queue(self)"), "no attribute '_process_rpc_queue'"),
            (Env.edited("omni-0.30.0-other-gate", base, ENGINE, PAUSED_GATE,
                        PAUSED_GATE.replace("self._scheduling_paused:", "self._gate_closed:")),
             "under a condition other than _scheduling_paused"),
            (Env.edited("omni-0.30.0-no-pending", base, ENGINE, PENDING_CALL, "pending_finished = set()"),
             "never asks the scheduler for its pending finished requests"),
        ],
        unexpected=[Unexpected(base, _scheduler_without_pending_accessor,
                               note="the engine's scheduler has no pending_finished_request_ids")],
    )


CASE = _case()


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.29.0rc1": "skip: out of range", "vllm-omni==0.30.0rc1": "would apply",
    "vllm-omni==0.30.0": "would apply", "vllm-omni==0.31.0rc1": "would apply",
    "vllm-omni==0.32.0rc1": "skip: fixed upstream",
}
