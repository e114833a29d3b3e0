"""omni-stage-executor-failure-teardown: tear a diffusion stage process down when its executor dies between requests

Why:         StageDiffusionProc.run_loop tears the subprocess down (DIFFUSION_PROC_DEAD to the client, exit) on a
             fatal engine failure, but only notices one when a request or RPC fails on a dead executor. A
             worker that dies while the stage is idle (OOM kill, segfault, SIGKILL) leaves the process up and
             its heartbeats healthy: the next request routed to it fails ("DiffusionExecutor is closed").
Upstream:    https://github.com/vllm-project/vllm-omni (0.31.0rc1, vllm_omni/diffusion/stage_diffusion_proc.py:
             ``StageDiffusionProc._watch_executor_failure``: the executor's failure callback signals run_loop's
             fatal engine failure on run_loop's event loop)
Affected:    vllm-omni >=0.22.0,<0.31.0rc1; fixed upstream in vllm-omni 0.31.0rc1 (also found by feature:
             StageDiffusionProc._watch_executor_failure). Before 0.22.0 run_loop has no fatal-failure teardown
             at all (not covered: an untagged 0.20.0rc1-0.21.x is drifted, with that reason; 0.18.0 has no
             stage subprocess).
How:         StageDiffusionProc.run_loop is wrapped (wrapt; it runs once per subprocess). Before the stock
             coroutine starts, the wrapper registers the same callback on the engine's executor
             (register_failure_callback), and for an executor already dead schedules the same signal; both run
             on the loop only after run_loop's first await, when its fatal event exists, so upstream's own
             teardown path runs unchanged. No executor: stock, as upstream; an executor without
             register_failure_callback: stock, noted once in status.
Remove when: the oldest supported vllm-omni is 0.31.0rc1 or later.
"""
import asyncio
import contextlib
import functools

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.22.0,<0.31.0rc1"},
    "fixed_in": {"vllm-omni": "0.31.0rc1"},
    "targets": ["vllm_omni.diffusion.stage_diffusion_proc"],
}

PATCH_ID = "omni-stage-executor-failure-teardown"


def check(ctx):
    if ctx.has("StageDiffusionProc._watch_executor_failure"):
        ctx.fixed_upstream("StageDiffusionProc watches its executor (_watch_executor_failure, 0.31.0rc1+)")
    run_loop = ctx.resolve("StageDiffusionProc.run_loop")
    if not run_loop.__code__.co_flags & 0x80:  # CO_COROUTINE
        ctx.drift("StageDiffusionProc.run_loop is no longer a coroutine function")
    teardown = ctx.has("StageDiffusionProc._signal_fatal_engine_failure") or "_fatal_event" in run_loop.__code__.co_names
    if not teardown:
        # Said plainly for builds without version metadata: the failure is there (worse), the layout is not ours.
        ctx.drift("StageDiffusionProc has no fatal-failure teardown (no _signal_fatal_engine_failure, no _fatal_event: "
                  "the vllm-omni 0.20.0rc1-0.21.x layout): a dead executor is never torn down there, not even after "
                  "a failed request; this patch, like upstream's _watch_executor_failure, needs the teardown 0.22.0 "
                  "added")
    ctx.require_params(ctx.resolve("StageDiffusionProc._signal_fatal_engine_failure"), "reason")
    if "_fatal_event" not in run_loop.__code__.co_names:
        ctx.drift("StageDiffusionProc.run_loop no longer keeps its fatal event on self._fatal_event")
    ctx.describe("StageDiffusionProc.run_loop: fatal teardown only after a failed request (0.22.0-0.30.0 layout)")


def apply(ctx):
    ctx.wrap("StageDiffusionProc", "run_loop", functools.partial(_run_loop, ctx.run))


async def _run_loop(run, wrapped, instance, args, kwargs):
    executor = getattr(getattr(instance, "_engine", None), "executor", None)
    if executor is None:  # upstream's rule: nothing to watch
        return await wrapped(*args, **kwargs)
    register = getattr(executor, "register_failure_callback", None)
    if not callable(register):
        run.fallback("the engine's executor takes no failure callback")
        return await wrapped(*args, **kwargs)
    loop = asyncio.get_running_loop()
    signal = instance._signal_fatal_engine_failure

    def on_executor_failure():  # the executor's monitor thread
        _report(run)
        with contextlib.suppress(RuntimeError):  # the loop is closed once run_loop has exited
            loop.call_soon_threadsafe(signal, "diffusion executor failed")

    register(on_executor_failure)
    if getattr(executor, "is_dead", False) is True:
        loop.call_soon(signal, "diffusion executor failed before run_loop started")
    return await wrapped(*args, **kwargs)


def _report(run):
    run.tally("torn-down", "executor failure between requests: {n} stage process(es) torn down at once")
