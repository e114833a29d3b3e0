"""omni-diffusion-engine-shutdown-rpcs: fail queued diffusion RPCs when shutdown interrupts a running batch

Why:         DiffusionEngine._busy_loop returns at once when the executor call of a batch fails after close()
             (``except Exception: if self._closed: return``), skipping its tail, which fails the queued
             collective RPCs with RuntimeError("DiffusionEngine is shutting down."). An RPC queued behind that
             batch (sleep, wake_up, LoRA add / remove / list) waits in future.result(timeout=None) forever, and
             the stage process's RPC thread with it.
Upstream:    https://github.com/vllm-project/vllm-omni/pull/3379 (the RPC queue and the tail that fails queued
             RPCs "so callers can't hang"). The early return came in 0.30.0rc1; 0.31.0rc1 ``break``s to the tail
             ("Exit through the loop tail so pending RPCs are failed instead of left waiting"); the PR of that
             change is not among upstream's threads we could search.
Affected:    vllm-omni >=0.30.0rc1,<0.31.0rc1; fixed upstream in vllm-omni 0.31.0rc1 (also found by feature:
             the ``if self._closed`` of _busy_loop's executor-call handler breaks instead of returning).
             Older code has no early return there (0.21.0rc1-0.29.0rc1) or no RPC queue at all (0.20.0 and
             before): an untagged build of it is "not affected".
How:         DiffusionEngine._busy_loop is wrapped (wrapt; the engine binds it as its worker thread's target).
             The stock loop runs unchanged; when it has returned and the engine is closed, the wrapper calls
             the engine's own _fail_pending_rpcs with the error of upstream's tail, as 0.31.0rc1's tail does.
             On a normal exit the tail already drained the queue: nothing is left to fail. An exception out of
             the loop propagates untouched (0.31.0rc1 skips its tail there too). An engine without a _closed
             flag or an RPC queue runs stock (noted once in status).
Remove when: the oldest supported vllm-omni is 0.31.0rc1 or later.
"""
import ast
import functools
import inspect
import textwrap

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.30.0rc1,<0.31.0rc1"},
    "fixed_in": {"vllm-omni": "0.31.0rc1"},
    "targets": ["vllm_omni.diffusion.diffusion_engine"],
}

PATCH_ID = "omni-diffusion-engine-shutdown-rpcs"
# What upstream's loop tail raises in every queued RPC's caller (0.21.0rc1 .. 0.32.0rc1 alike).
_SHUTTING_DOWN = "DiffusionEngine is shutting down."


def check(ctx):
    if not _uses(ctx.resolve("DiffusionEngine"), "_rpc_queue"):
        ctx.not_affected("DiffusionEngine has no RPC queue (added in vllm-omni 0.21.0rc1): no collective RPC waits "
                         "on its busy loop")
    loop = ctx.resolve("DiffusionEngine._busy_loop")
    code = getattr(loop, "__code__", None)
    if code is None or code.co_flags & 0x80:  # CO_COROUTINE
        ctx.drift("DiffusionEngine._busy_loop is no longer a plain function")
    ctx.require_params(ctx.resolve("DiffusionEngine._fail_pending_rpcs"), "exc")
    missing = {"_fail_pending_rpcs", "_rpc_queue"} - set(code.co_names)
    if missing:
        ctx.drift(f"DiffusionEngine._busy_loop no longer uses {', '.join(sorted(missing))}")
    exits = _closed_exits(loop)
    if exits is None:  # no source to read (a bytecode-only install): the version range decides
        ctx.describe("DiffusionEngine._busy_loop (source not readable: decided by version)")
        return
    if "return" in exits:
        ctx.describe("DiffusionEngine._busy_loop: returns past its RPC-failing tail when shutdown interrupts the "
                     "executor call (0.30.0rc1-0.30.0 layout)")
        return
    if exits:
        ctx.fixed_upstream("DiffusionEngine._busy_loop leaves through its tail when shutdown interrupts the "
                           "executor call (break, 0.31.0rc1+)")
    ctx.not_affected("DiffusionEngine._busy_loop has no early exit on _closed in an exception handler: it always "
                     "reaches its RPC-failing tail (vllm-omni 0.21.0rc1-0.29.0rc1; the early return came in "
                     "0.30.0rc1)")


def _uses(cls, name):
    """Whether a function defined on ``cls`` itself names ``name`` (``co_names``)."""
    for value in vars(cls).values():
        code = getattr(getattr(value, "__func__", value), "__code__", None)
        if code is not None and name in code.co_names:
            return True
    return False


def _closed_exits(fn):
    """How ``fn`` leaves an ``if self._closed:`` inside an exception handler: a set of "return" / "break" (empty:
    no such test), or None when its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    found = set()
    for handler in ast.walk(tree):
        if not isinstance(handler, ast.ExceptHandler):
            continue
        for node in ast.walk(handler):
            test = getattr(node, "test", None) if isinstance(node, ast.If) else None
            if (isinstance(test, ast.Attribute) and test.attr == "_closed" and isinstance(test.value, ast.Name)
                    and test.value.id == "self"):
                found.update("return" if isinstance(s, ast.Return) else "break" for s in node.body
                             if isinstance(s, (ast.Return, ast.Break)))
    return found


def apply(ctx):
    ctx.wrap("DiffusionEngine", "_busy_loop", functools.partial(_busy_loop, ctx.run))


def _unexpected(engine):
    """Why ``engine`` is not what the wrapper was built for (None: it is)."""
    if getattr(engine, "_closed", None) not in (True, False):
        return "the engine has no _closed flag"
    rpc_queue = getattr(engine, "_rpc_queue", None)
    if not callable(getattr(rpc_queue, "qsize", None)) or not callable(getattr(rpc_queue, "get_nowait", None)):
        return "the engine has no RPC queue"
    return None


def _busy_loop(run, wrapped, instance, args, kwargs):
    why = _unexpected(instance)
    if why is not None:
        return run.stock(why, wrapped, args, kwargs)
    result = wrapped(*args, **kwargs)
    if instance._closed is True:
        _fail_left_behind(run, instance)
    return result


def _fail_left_behind(run, engine):
    """The tail the stock loop skipped: every RPC still queued fails as upstream's tail fails it."""
    try:
        left = engine._rpc_queue.qsize()
        engine._fail_pending_rpcs(RuntimeError(_SHUTTING_DOWN))
    except Exception as exc:  # noqa: BLE001 - the stock loop has returned normally: never raise from here
        run.fallback(f"failing the queued RPCs raised {type(exc).__name__}: {exc}")
        return
    if left:
        _report(run, left)


def _report(run, left):
    shutdowns = run.count("shutdowns")
    text = (f"shutdown interrupted a running batch {shutdowns} time(s): {{n}} queued RPC(s) failed with "
            f"'{_SHUTTING_DOWN}' instead of waiting forever")
    run.tally("rpcs", text, by=left, log=text.format(n=left))
