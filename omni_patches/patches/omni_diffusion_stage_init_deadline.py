"""omni-diffusion-stage-init-deadline: bound a diffusion stage's start-up handshake with its stage_init_timeout

Why:         StageDiffusionProcManager._wait_until_started(handshake_address, stage_init_timeout) never uses
             its timeout: vLLM's wait_for_engine_startup returns on READY and raises only when the stage process
             exits. A diffusion stage that hangs while starting (model download, device init) blocks its
             launcher forever, its process left running.
Upstream:    https://github.com/vllm-project/vllm-omni/blob/bc0f652308a683ac2ea74b56eadceb2c3eb20301/vllm_omni/engine/stage_init_deadline.py
             (first released in 0.32.0rc1: ``wait_for_engine_startup_with_deadline``, called by
             ``_wait_until_started`` and by engine/stage_engine_startup.py; its PR was not found)
Affected:    vllm-omni >=0.24.0rc1,<0.32.0rc1; fixed upstream in vllm-omni 0.32.0rc1 (also found by feature:
             the module's wait_for_engine_startup_with_deadline). 0.20.0-0.23.0rc1 poll their own handshake
             with stage_init_timeout (no StageDiffusionProcManager: out of range).
How:         StageDiffusionProcManager._wait_until_started is wrapped (wrapt; once per stage launch). As
             upstream: a timer of stage_init_timeout seconds (None or <= 0: none) kills the stage process
             with the module's shutdown([proc]); vLLM's wait sees the exit and raises, and that is re-raised
             as TimeoutError("Diffusion stage process <name> did not become ready within <t>s
             (stage_init_timeout); its processes were terminated"), also when READY raced the timer. A
             timeout that is not a number, or a manager without a process: stock, noted once in status.
Remove when: the oldest supported vllm-omni is 0.32.0rc1 or later.
"""
import functools
import logging
import numbers
import threading

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.24.0rc1,<0.32.0rc1"},
    "fixed_in": {"vllm-omni": "0.32.0rc1"},
    "targets": ["vllm_omni.diffusion.stage_diffusion_proc"],
}

PATCH_ID = "omni-diffusion-stage-init-deadline"
_LOG = logging.getLogger("omni_patches")


def check(ctx):
    wait = ctx.resolve("StageDiffusionProcManager._wait_until_started")
    names = getattr(getattr(wait, "__code__", None), "co_names", ())
    if "wait_for_engine_startup_with_deadline" in names or ctx.has("wait_for_engine_startup_with_deadline"):
        ctx.fixed_upstream("_wait_until_started bounds the handshake (wait_for_engine_startup_with_deadline, "
                           "0.32.0rc1+)")
    ctx.require_params(wait, "stage_init_timeout")
    if not {"wait_for_engine_startup", "shutdown", "proc"} <= set(names):
        ctx.drift("StageDiffusionProcManager._wait_until_started no longer waits with vLLM's "
                  "wait_for_engine_startup on self.proc (and shuts it down with vLLM's shutdown)")
    ctx.describe("StageDiffusionProcManager._wait_until_started: unbounded wait_for_engine_startup "
                 "(0.24.0rc1-0.31.0rc1 layout)")


def apply(ctx):
    ctx.wrap("StageDiffusionProcManager", "_wait_until_started", functools.partial(_wait_until_started, ctx.run,
                                                                                   ctx.module))


def _timeout_of(handshake_address, stage_init_timeout, *args, **kwargs):
    return stage_init_timeout


def _wait_until_started(run, module, wrapped, instance, args, kwargs):
    try:
        timeout = _timeout_of(*args, **kwargs)
    except TypeError:
        return run.stock("_wait_until_started called without a stage_init_timeout", wrapped, args, kwargs)
    if timeout is None:  # upstream: no deadline
        return wrapped(*args, **kwargs)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        return run.stock(f"stage_init_timeout is not a number ({type(timeout).__name__})", wrapped, args, kwargs)
    if timeout <= 0:  # upstream: no deadline
        return wrapped(*args, **kwargs)
    proc = getattr(instance, "proc", None)
    if proc is None or not callable(getattr(proc, "is_alive", None)):
        return run.stock("the stage manager has no process to bound", wrapped, args, kwargs)
    shutdown = getattr(module, "shutdown", None)  # vLLM's, as the module imports it (what stock's cleanup calls)
    if not callable(shutdown):
        return run.stock("the module has no shutdown() to terminate the stage with", wrapped, args, kwargs)

    label = f"Diffusion stage process {getattr(proc, 'name', '?')}"
    fired = threading.Event()

    def on_deadline():
        fired.set()
        _LOG.error("[omni-patches] %s not READY after %ss (stage_init_timeout); terminating it", label, timeout)
        try:
            shutdown([proc])
        except Exception:  # noqa: BLE001 - vLLM's poll still ends when the process does
            _LOG.exception("[omni-patches] terminating %s after its start-up deadline failed", label)

    timer = threading.Timer(timeout, on_deadline)
    timer.daemon = True
    timer.name = "omni-patches-stage-init-deadline"
    timer.start()
    try:
        result = wrapped(*args, **kwargs)
    except Exception as exc:
        if fired.is_set():
            _report(run)
            raise _timed_out(label, timeout) from exc
        raise
    finally:
        timer.cancel()
        timer.join()  # a deadline already firing finishes first: its kill is final before we decide
    if fired.is_set():  # READY arrived as the deadline fired: the process is gone, never hand it back
        _report(run)
        raise _timed_out(label, timeout)
    return result


def _timed_out(label, timeout):
    return TimeoutError(f"{label} did not become ready within {timeout}s (stage_init_timeout); "
                        "its processes were terminated")


def _report(run):
    run.tally("timed-out", "{n} diffusion stage(s) not ready within stage_init_timeout: terminated")
