"""omni-diffusion-idle-abort-terminal: end an aborted diffusion request's stream when no request is left to run

Why:         DiffusionEngine's busy loop sends an aborted request's terminal output only with the next scheduler
             wave (or, from 0.30.0rc1, while the scheduler is paused). An abort that leaves the scheduler with no
             request (the last one queued behind a running request) waits: the caller's stream stays open and
             the request's state, stream and cancellation entry stay until another request arrives.
Upstream:    https://github.com/vllm-project/vllm-omni (0.32.0rc1, vllm_omni/diffusion/diffusion_engine.py:
             ``DiffusionEngine._busy_loop`` emits the scheduler's pending finished requests when it is paused or
             has no request; no upstream PR or issue thread found for it)
Affected:    vllm-omni >=0.30.0rc1,<0.32.0rc1; fixed upstream in vllm-omni 0.32.0rc1 (also found by feature: the
             busy loop's pending-finished emission tests has_requests()). 0.28.0rc1-0.29.0rc1 (and older) leave
             the same abort waiting, but their scheduler has no pending_finished_request_ids (not covered).
How:         DiffusionEngine._process_rpc_queue is wrapped (wrapt): where the busy loop calls it between waves
             (on the busy-loop thread, not paused, no wave in flight) and the scheduler has no request, the
             wrapper emits scheduler.pending_finished_request_ids() through the engine's own
             _emit_finished_outputs, as the paused branch does. _emit_request_started_outputs / _emit_outputs
             are wrapped only to know when a wave is in flight (its own update emits its aborts). A scheduler
             without that method: stock, noted once in status.
Remove when: the oldest supported vllm-omni is 0.32.0rc1 or later.
"""
import ast
import functools
import inspect
import logging
import textwrap
import threading

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.30.0rc1,<0.32.0rc1"},
    "fixed_in": {"vllm-omni": "0.32.0rc1"},
    "targets": ["vllm_omni.diffusion.diffusion_engine"],
}

PATCH_ID = "omni-diffusion-idle-abort-terminal"


def _pending_gates(loop):
    """The tests of the busy loop's ``if`` statements whose body asks the scheduler for its pending finished
    requests (0.30.0rc1+: one, ``if self._scheduling_paused:``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(loop)))
    gates = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(
                isinstance(n, ast.Attribute) and n.attr == "pending_finished_request_ids"
                for stmt in node.body for n in ast.walk(stmt)):
            gates.append(node.test)
    return gates


def _names(node):
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def check(ctx):
    loop = ctx.resolve("DiffusionEngine._busy_loop")
    for name in ("_process_rpc_queue", "_emit_request_started_outputs", "_emit_outputs", "_emit_finished_outputs"):
        ctx.resolve(f"DiffusionEngine.{name}")
    try:
        gates = _pending_gates(loop)
    except (OSError, TypeError, SyntaxError):
        ctx.drift("the source of DiffusionEngine._busy_loop cannot be read")
    if any("has_requests" in _names(test) for test in gates):
        ctx.fixed_upstream("the busy loop emits pending finished requests when the scheduler has none (0.32.0rc1+)")
    if not gates:
        # Said plainly for builds without version metadata: the failure is there, the means to fix it is not.
        ctx.drift("DiffusionEngine._busy_loop never asks the scheduler for its pending finished requests (the "
                  "vllm-omni 0.29.0rc1-and-older layout, whose scheduler has no pending_finished_request_ids): an "
                  "abort that empties the scheduler waits for the next request there too; this patch needs that "
                  "scheduler method (0.30.0rc1+)")
    if not any("_scheduling_paused" in _names(test) for test in gates):
        ctx.drift("DiffusionEngine._busy_loop emits pending finished requests under a condition other than "
                  "_scheduling_paused")
    names = loop.__code__.co_names
    if "_process_rpc_queue" not in names or "_emit_request_started_outputs" not in names:
        ctx.drift("DiffusionEngine._busy_loop no longer calls _process_rpc_queue / _emit_request_started_outputs")
    ctx.describe("DiffusionEngine._busy_loop: pending finished requests emitted only while paused "
                 "(0.30.0rc1-0.31.0rc1 layout)")


def apply(ctx):
    local = threading.local()  # per busy-loop thread, so per engine: in_wave
    ctx.wrap("DiffusionEngine", "_emit_request_started_outputs", functools.partial(_wave_starts, ctx.run, local))
    ctx.wrap("DiffusionEngine", "_emit_outputs", functools.partial(_wave_ends, local))
    ctx.wrap("DiffusionEngine", "_process_rpc_queue", functools.partial(_between_waves, ctx.run, local))


def _on_busy_loop(engine):
    return threading.current_thread() is getattr(engine, "worker_thread", None)


def _wave_starts(run, local, wrapped, instance, args, kwargs):
    """Called by the busy loop right after ``scheduler.schedule()``, with its output: a wave is in flight until
    ``_emit_outputs`` (an empty output goes straight back to the top of the loop)."""
    if _on_busy_loop(instance):
        sched_output = args[0] if args else kwargs.get("sched_output")
        try:
            local.in_wave = not sched_output.is_empty
        except Exception:  # an output of another shape: no emission between waves from here on (stock)
            local.in_wave = True
            run.fallback("a scheduler output without is_empty")
    return wrapped(*args, **kwargs)


def _wave_ends(local, wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    finally:
        if _on_busy_loop(instance):
            local.in_wave = False


def _between_waves(run, local, wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if not _on_busy_loop(instance) or getattr(local, "in_wave", False) or instance._scheduling_paused:
        return result  # inside a wave the wave's own update emits; while paused stock's branch does
    scheduler = instance.scheduler
    pending_of = getattr(scheduler, "pending_finished_request_ids", None)
    if not callable(pending_of):
        run.fallback("the engine's scheduler has no pending_finished_request_ids")
        return result
    with instance._cv:
        if scheduler.has_requests():
            return result
        pending = set(pending_of())
    if pending:
        instance._emit_finished_outputs(pending, None)
        _report(run, len(pending))
    return result


def _report(run, n):
    run.tally("surfaced", "finished requests surfaced while the scheduler was idle: {n}", by=n,
              log="finished request(s) surfaced with no request left to schedule", level=logging.DEBUG)
